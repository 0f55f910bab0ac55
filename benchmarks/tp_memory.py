"""Peak host memory of loading the ``small`` preset as one rank of TP=1 and as each rank of TP=2.

Each load runs in its own process, so its peak RSS (``ru_maxrss``) is that load's alone (Linux carries the
forking parent's peak into ``ru_maxrss`` across exec, so this script's own process never imports torch and a
child writes the checkpoint too). The process imports torch and the package, notes its peak so far (the import
baseline), builds the rank's model, reads the checkpoint through the core loader (a TP=2 rank reads only its
part of each split tensor, docs/architecture.md#tensor-parallel-loading) and reports its peak again, with the
bytes of the parameters it holds: split (attention heads, expert widths) and replicated (embedding, head, norms,
mHC, compressor, indexer, Engram; the DSpark drafter is not built). The ratio TP=2 / TP=1 is given for the whole
peak and for the load alone (peak minus baseline).

A second table counts, from shapes alone (models built on the meta device), the weight bytes one rank holds at
TP=1 and TP=2 for the ``small`` and ``full`` presets, and names the largest replicated parameter kind: what
bounds the ratio.

    python benchmarks/tp_memory.py [--checkpoint DIR] [--out benchmarks/results/tp_memory.md]

Without ``--checkpoint`` a random ``small`` checkpoint is written to a temporary directory first.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

MIB = 2 ** 20
SPLIT_PARTS = (".attn.wq_b.", ".attn.wo_a.", ".attn.wo_b.", ".attn.attn_sink", ".ffn.shared_experts.",
               ".ffn.experts.")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def load_as_rank(checkpoint: str, rank: int, world: int) -> dict:
    """In this (fresh) process: load ``checkpoint`` as rank ``rank`` of ``world`` -> peak RSS and held bytes."""
    import torch

    from deepinfer_plugins.models.deepseek_v41 import DeepseekV41ForCausalLM
    from deepinfer_plugins.models.deepseek_v41.sharding import TensorParallel

    def not_run(partial: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the memory benchmark only loads the model")

    baseline = peak_rss_bytes()
    tensor_parallel = TensorParallel(rank, world, not_run) if world > 1 else None
    model = DeepseekV41ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, with_drafter=False,
                                                   tensor_parallel=tensor_parallel)
    held = {"split": 0, "replicated": 0}
    for name, parameter in model.named_parameters():
        kind = "split" if name.startswith("layers.") and any(p in name for p in SPLIT_PARTS) else "replicated"
        held[kind] += parameter.nbytes
    return {"rank": rank, "world": world, "baseline": baseline, "peak": peak_rss_bytes(), **held}


def held_from_shapes(preset: str) -> dict:
    """Weight bytes one rank holds at TP=1 and TP=2, from a meta-device build; the largest replicated kind."""
    import torch

    from deepinfer_plugins.models.deepseek_v41 import DeepseekV41ForCausalLM
    from deepinfer_plugins.models.deepseek_v41.args import ModelArgs
    from deepinfer_plugins.models.deepseek_v41.loader import new_model
    from deepinfer_plugins.models.deepseek_v41.sharding import TensorParallel, shard_model

    held, replicated = {}, {}
    for world in (1, 2):
        with torch.device("meta"):
            model = new_model(DeepseekV41ForCausalLM, ModelArgs.preset(preset), torch.bfloat16)
            if world > 1:
                shard_model(model, TensorParallel(0, world, all_reduce=None))
        held[world] = sum(parameter.nbytes for parameter in model.parameters())
    for name, parameter in model.named_parameters():
        if not (name.startswith("layers.") and any(p in name for p in SPLIT_PARTS)):
            kind = re.sub(r"\.\d+\.", ".*.", name)
            kind = re.sub(r"^layers\.\*\.", "", kind)
            replicated[kind] = replicated.get(kind, 0) + parameter.nbytes
    largest = max(replicated, key=replicated.get)
    return {"preset": preset, "tp1": held[1], "tp2": held[2], "replicated": sum(replicated.values()),
            "largest": largest, "largest_bytes": replicated[largest]}


def in_child(call: str, *arguments):
    """``benchmarks.tp_memory.<call>(*arguments)`` in a fresh process -> its JSON result."""
    code = (f"import json, sys; from benchmarks.tp_memory import {call}; "
            f"print('RESULT' + json.dumps({call}(*json.loads(sys.argv[1]))))")
    result = subprocess.run([sys.executable, "-c", code, json.dumps(arguments)], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).resolve().parent.parent)
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def write_checkpoint(out_dir: str) -> str:
    from deepinfer_plugins.models.deepseek_v41.checkpoint import write_random_checkpoint

    return str(write_random_checkpoint(out_dir, "small", seed=0))


def shapes_table(rows: list[dict]) -> str:
    lines = ["| preset | weights per rank, TP=1 (GiB) | TP=2 (GiB) | TP=2 / TP=1 | replicated (GiB) | largest "
             "replicated kind (GiB) |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['preset']} | {row['tp1'] / 2**30:.3f} | {row['tp2'] / 2**30:.3f} | "
                     f"{row['tp2'] / row['tp1']:.2f} | {row['replicated'] / 2**30:.3f} | "
                     f"`{row['largest']}` ({row['largest_bytes'] / 2**30:.3f}) |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    single = rows[0]
    lines = ["| rank / world | peak RSS (MiB) | import baseline (MiB) | load (peak - baseline, MiB) | split weights "
             "held (MiB) | replicated weights held (MiB) | peak / TP=1 | load / TP=1 |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        load = row["peak"] - row["baseline"]
        lines.append(f"| {row['rank']} / {row['world']} | {row['peak'] / MIB:.0f} | {row['baseline'] / MIB:.0f} | "
                     f"{load / MIB:.0f} | {row['split'] / MIB:.1f} | {row['replicated'] / MIB:.1f} | "
                     f"{row['peak'] / single['peak']:.2f} | {load / (single['peak'] - single['baseline']):.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "tp_memory.md")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = str(options.checkpoint or in_child("write_checkpoint", str(Path(scratch) / "small")))
        rows = [in_child("load_as_rank", checkpoint, rank, world) for rank, world in ((0, 1), (0, 2), (1, 2))]
    shapes = [in_child("held_from_shapes", preset) for preset in ("small", "full")]
    text = (table(rows) + "\n\nWeights one rank holds, from shapes (meta device):\n\n" + shapes_table(shapes))
    print(text)
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text("# Peak host memory per tensor-parallel rank, `small` preset\n\n"
                           "Written by `python benchmarks/tp_memory.py`; bf16 activations, no kept dense weights.\n\n"
                           + text + "\n")


if __name__ == "__main__":
    main()
