"""Report prompt-cache hits in every response's usage (see the ledger in __init__.py)."""

from __future__ import annotations

_PATCHED_FLAG = "_deepinfer_patched"


def split_cache_hits(usage) -> None:
    """DeepSeek's API reports every prompt token as a cache hit or a miss, because they are priced differently;
    the split is vLLM's ``prompt_tokens_details.cached_tokens`` and the rest of ``prompt_tokens``."""
    details = usage.prompt_tokens_details
    if details is None or details.cached_tokens is None:
        return
    usage.__pydantic_extra__["prompt_cache_hit_tokens"] = details.cached_tokens
    usage.__pydantic_extra__["prompt_cache_miss_tokens"] = usage.prompt_tokens - details.cached_tokens


def apply() -> bool:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    original_init = OpenAIServingChat.__init__
    if getattr(original_init, _PATCHED_FLAG, False):
        return True
    original_setattr = UsageInfo.__setattr__

    def init_reporting_cache_hits(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.enable_prompt_tokens_details = True

    def setattr_splitting_cache_hits(self, name, value):
        original_setattr(self, name, value)
        if name == "prompt_tokens_details":
            split_cache_hits(self)

    setattr(init_reporting_cache_hits, _PATCHED_FLAG, True)
    OpenAIServingChat.__init__ = init_reporting_cache_hits
    UsageInfo.__setattr__ = setattr_splitting_cache_hits
    return True
