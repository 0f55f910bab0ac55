"""Decode step time of V4.1 against context length, next to a dense-attention twin of the same width (CPU).

The architecture's claim: a decode step attends to a 128-token window plus ``index_topk`` selected compressed
entries, so its cost barely grows with context, while dense attention grows linearly. Both models use the
``small`` preset (hidden 512, 8 layers, real vocabulary); the dense twin has every layer attend to the whole
context (compress ratios 0, window = longest context). Weights are dequantised once (``keep_dense_weights``)
so that the step time is the model's, not the per-step FP8/FP4 dequantisation. Caches are filled with random values of the right
sizes (the cost of a step does not depend on the values), then single-token steps are timed; the median of
``--repeats`` steps is reported with the process's peak RSS.

    python benchmarks/model_cpu.py [--contexts 256 1024 4096 16384] [--repeats 7] [--out benchmarks/results/model_cpu.md]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch

from deepinfer_plugins.models.deepseek_v41.args import ModelArgs, preset_config
from deepinfer_plugins.models.deepseek_v41.checkpoint import random_state_dict
from deepinfer_plugins.models.deepseek_v41.model import DeepseekV41Model


def build(args: ModelArgs) -> DeepseekV41Model:
    model = DeepseekV41Model(args, dtype=torch.float32, param_dtype=torch.bfloat16)
    state = {name: t for name, t in random_state_dict(args, seed=0).items() if not name.startswith("mtp.")}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().keep_dense_weights()


def dense_twin(config: dict, window: int) -> ModelArgs:
    text = dict(config["text_config"])
    layers = text["num_hidden_layers"]
    text.update(compress_ratios=[0] * (layers + text["num_nextn_predict_layers"]), kv_source_layer_ids=[],
                index_source_layer_ids=[], candidate_source_layer_id=None, sliding_window=window)
    return ModelArgs.from_hf_config({**config, "text_config": text})


def fill_cache(model: DeepseekV41Model, context: int, generator: torch.Generator):
    """A cache that has seen ``context`` tokens, with random contents of the right sizes."""
    args = model.args
    cache = model.new_cache()
    span = min(context, args.sliding_window)
    for layer in range(args.num_hidden_layers):
        cache.window_records(layer, torch.randn(span, args.head_dim, generator=generator), context - span,
                             context - span)
    for source in args.kv_source_layer_ids:
        state, ratio = cache.compressed(source), args.layer_ratios[source]
        state.latents.append(torch.randn(context // ratio, args.head_dim, generator=generator))
        state.index_keys.append(torch.randn(context // ratio, args.index_head_dim, generator=generator))
        state.pending_values = torch.zeros(context % ratio, args.head_dim)
        state.pending_gates = torch.zeros(context % ratio, args.head_dim)
    cache.advance(torch.randint(3, 1000, (context,), generator=generator))
    return cache


@torch.inference_mode()
def decode_step_ms(model: DeepseekV41Model, context: int, repeats: int) -> float:
    generator = torch.Generator().manual_seed(context)
    cache = fill_cache(model, context, generator)
    token = torch.tensor([1000])
    model(token, cache)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(token, cache)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/model_cpu.md")
    options = parser.parse_args()
    torch.manual_seed(0)
    config = preset_config("small")
    models = {"V4.1 (CSA2 sparse)": build(ModelArgs.from_hf_config(config)),
              "dense MQA twin": build(dense_twin(config, max(options.contexts) + options.repeats + 2))}
    rows = []
    for name, model in models.items():
        for context in options.contexts:
            ms = decode_step_ms(model, context, options.repeats)
            rows.append({"model": name, "context": context, "decode_ms": round(ms, 2)})
            print(json.dumps(rows[-1]), flush=True)
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    lo, hi = min(options.contexts), max(options.contexts)
    ratio = {name: next(r["decode_ms"] for r in rows if r["model"] == name and r["context"] == hi)
             / next(r["decode_ms"] for r in rows if r["model"] == name and r["context"] == lo) for name in models}
    lines = ["| model | " + " | ".join(f"{c} ctx (ms)" for c in options.contexts) + f" | ratio {hi}/{lo} |",
             "|---|" + "---|" * (len(options.contexts) + 1)]
    for name in models:
        cells = [f"{r['decode_ms']:.2f}" for r in rows if r["model"] == name]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {ratio[name]:.2f} |")
    lines += ["", f"small preset (hidden 512, 8 layers, vocab 129280), fp32 activations, median of {options.repeats} "
              f"single-token decode steps, 2-core CPU; peak RSS {rss_gib:.2f} GiB. Goal: V4.1 ratio <= 1.5."]
    table = "\n".join(lines)
    print(table)
    out = Path(options.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table + "\n")
    print(json.dumps({"ratio_v41": round(ratio["V4.1 (CSA2 sparse)"], 3),
                      "ratio_dense": round(ratio["dense MQA twin"], 3), "peak_rss_gib": round(rss_gib, 2)}))


if __name__ == "__main__":
    main()
