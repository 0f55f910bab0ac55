"""DeepSeek's split of the prompt into cache hits and misses (vllm/patches/patch_usage.py), on stand-ins shaped
like vLLM's usage models (extra fields allowed, as vLLM's are)."""

from typing import Optional

from pydantic import BaseModel, ConfigDict

from deepinfer_plugins.vllm.patches.patch_usage import split_cache_hits


class Details(BaseModel):
    cached_tokens: Optional[int] = None


class Usage(BaseModel):
    model_config = ConfigDict(extra="allow")
    prompt_tokens: int = 0
    prompt_tokens_details: Optional[Details] = None


def test_hits_and_misses_add_up_to_the_prompt():
    usage = Usage(prompt_tokens=300, prompt_tokens_details=Details(cached_tokens=256))
    split_cache_hits(usage)
    dumped = usage.model_dump()
    assert (dumped["prompt_cache_hit_tokens"], dumped["prompt_cache_miss_tokens"]) == (256, 44)


def test_no_split_without_a_cached_count():
    for usage in (Usage(prompt_tokens=5), Usage(prompt_tokens=5, prompt_tokens_details=Details())):
        split_cache_hits(usage)
        assert "prompt_cache_hit_tokens" not in usage.model_dump()
