"""Preemption and chunked prefill with the offline engine: a KV cache too small for the batch forces vLLM to
preempt requests and recompute them; every output still equals the reference model's greedy decoding. Run on the
tiny checkpoint and on a variant whose every compressed layer is its own KV source, so that a compressed row
holds the records of several sources (two per ratio) at their own columns.

Runs the engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) in a subprocess of its own, so its memory and
threads go away with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from pathlib import Path

import pytest

from deepinfer_plugins.models.deepseek_v41 import DeepseekV41ForCausalLM
from deepinfer_plugins.models.deepseek_v41.checkpoint import write_random_checkpoint
from deepinfer_plugins.models.deepseek_v41.generate import SamplingParams, generate

SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    if __name__ == "__main__":
        prompts = json.loads(sys.argv[2])
        llm = LLM(sys.argv[1], dtype="float32", max_model_len=1024, tokenizer_mode="deepinfer",
                  kv_cache_memory_bytes=int(sys.argv[3]), max_num_batched_tokens=96, disable_log_stats=False,
                  enable_prefix_caching=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=40, temperature=0))
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        print("RESULT" + json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in outs],
                                     "preemptions": metrics.get("vllm:num_preemptions", 0)}))
""")


@pytest.fixture(scope="module")
def packed_checkpoint(tmp_path_factory) -> Path:
    """Tiny V4.1 with layers 2, 3 (ratio 2) and 4, 5 (ratio 1) each compressing their own KV."""
    return write_random_checkpoint(tmp_path_factory.mktemp("packed"), "tiny", seed=1,
                                   kv_source_layer_ids=[2, 3, 4, 5], index_source_layer_ids=[2, 3, 4, 5, 6])


@pytest.fixture(params=["tiny", "packed"])
def model_under_test(request, checkpoint, core_model):
    if request.param == "tiny":
        return checkpoint, core_model
    packed = request.getfixturevalue("packed_checkpoint")
    return packed, DeepseekV41ForCausalLM.from_pretrained(packed)


def test_outputs_survive_preemption_and_chunked_prefill(model_under_test, tmp_path):
    checkpoint, core_model = model_under_test
    # 8 prompts just short of a 256-token block: each needs a new block while decoding, which a 640 KiB pool of
    # byte-record caches cannot give all of them at once (the assertion below checks that it really preempts).
    prompts = [[0] + [100 + (7 * i + 13 * j) % 5000 for j in range(240 + i)] for i in range(8)]
    script = tmp_path / "offline.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(checkpoint), json.dumps(prompts), str(5 * 2**17)],
                            capture_output=True, text=True, timeout=900, env=dict(os.environ))
    line = next((l for l in result.stdout.splitlines() if l.startswith("RESULT")), None)
    assert line, result.stderr[-4000:]
    data = json.loads(line[len("RESULT"):])
    assert data["preemptions"] > 0, "the KV cache was meant to be too small for the batch"
    for prompt, output in zip(prompts, data["outputs"], strict=True):
        assert output == generate(core_model, prompt, SamplingParams(max_new_tokens=40, stop_token_ids=(1,)))
