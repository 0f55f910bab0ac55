"""What a vLLM decode step costs per request in the adapter's cache bookkeeping, in-process on its own paged
caches (integration_tests/vllm/paged_caches.py; no engine, tiny preset, every window layer in one cache group).

Per batch size: torch calls made outside the op kernels (on a GPU each is a kernel launch or a host tensor op:
the part of a step that grows with the batch unless it is batched), host reads of tensors (on a GPU each stalls
the host), and the CPU time of a decode step. The anchor is the 1-request step of the same run: the ratio is
torch calls per request against it (1.0 = nothing batched, towards 0 = batched). Run with the vLLM environment:

    .venv-vllm/bin/python benchmarks/paged_step.py [--out benchmarks/results/paged_step.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from deepinfer_plugins.models.deepseek_v41 import DeepseekV41ForCausalLM
from deepinfer_plugins.models.deepseek_v41.checkpoint import write_random_checkpoint
from integration_tests.host_reads import HOST_READS, PACKAGE
from integration_tests.vllm.paged_caches import PagedCaches

PROMPT_TOKENS = 30


class CallCount(TorchFunctionMode):
    """Torch calls by where they come from: inside the op kernels (ops/) or from the model and adapter code."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame and not frame.f_code.co_filename.startswith(str(PACKAGE)):
            frame = frame.f_back
        if frame is not None:
            inside = Path(frame.f_code.co_filename).relative_to(PACKAGE).as_posix().startswith("ops/")
            self.calls["kernels" if inside else "outside"] += 1
            if not inside and getattr(func, "__name__", "") in HOST_READS:
                self.calls["host reads"] += 1
        return func(*args, **(kwargs or {}))


def measure(model, requests: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(requests)
    caches = PagedCaches(model.args, requests, PROMPT_TOKENS + repeats + 2, g, one_window_table=True)
    caches.step(model, {r: (0, torch.randint(0, 1000, (PROMPT_TOKENS,), generator=g)) for r in range(requests)})
    times = []
    for i in range(repeats):
        work = {r: (PROMPT_TOKENS + i, torch.randint(0, 1000, (1,), generator=g)) for r in range(requests)}
        start = time.perf_counter()
        caches.step(model, work)
        times.append(time.perf_counter() - start)
    count = CallCount()
    with count:
        caches.step(model, {r: (PROMPT_TOKENS + repeats, torch.randint(0, 1000, (1,), generator=g))
                            for r in range(requests)})
    return {"requests": requests, "outside": count.calls["outside"], "host_reads": count.calls["host reads"],
            "kernels": count.calls["kernels"], "step_ms": round(statistics.median(times) * 1e3, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/paged_step.md")
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        model = DeepseekV41ForCausalLM.from_pretrained(write_random_checkpoint(tmp, "tiny", seed=0))
        rows = [measure(model, requests, options.repeats) for requests in (1, 4, 16, 32)]
    anchor = rows[0]["outside"]
    lines = ["| decoding requests | torch calls outside the op kernels | per request | ratio vs 1 request | "
             "host reads | calls inside the op kernels (CPU reference) | decode step (ms, CPU) |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        per_request = row["outside"] / row["requests"]
        row["ratio"] = round(per_request / anchor, 3)
        print(json.dumps(row))
        lines.append(f"| {row['requests']} | {row['outside']} | {per_request:.0f} | {row['ratio']} | "
                     f"{row['host_reads']} | {row['kernels']} | {row['step_ms']} |")
    lines.append("")
    lines.append("tiny preset (8 layers), fp32, in-process on the vLLM adapter's paged caches; one decode step "
                 f"after a {PROMPT_TOKENS}-token prefill per request.")
    table = "\n".join(lines) + "\n"
    Path(options.out).write_text(table)
    print(table)


if __name__ == "__main__":
    main()
