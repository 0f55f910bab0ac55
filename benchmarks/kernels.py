"""Per-op kernel benchmark at V4.1-Flash shapes: bytes and FLOPs moved, time per backend, roofline fractions.

On CPU only the reference is timed (the Triton interpreter says nothing about speed); on CUDA every registered
backend is timed and, with --check, compared against the reference first. The ceiling for memory-bound ops is a
copy bandwidth measured in the same run; for sparse attention, --matrix-tflops (default: H200 dense BF16, 989).
Writes a markdown table to benchmarks/results/kernels.md and prints one JSON line per case.

  python benchmarks/kernels.py [--device cuda] [--check] [--quick] [--out benchmarks/results/kernels.md]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from deepinfer_plugins import ops


def timeit(fn, device: str, min_time: float = 0.2, max_iters: int = 200) -> float:
    fn()  # warm-up / compile
    if device == "cuda":
        torch.cuda.synchronize()
    iters, start = 0, time.perf_counter()
    while True:
        fn()
        iters += 1
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if elapsed > min_time or iters >= max_iters:
            return elapsed / iters


def copy_bandwidth(device: str, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timeit(lambda: dst.copy_(src), device)
    return 2 * nbytes / seconds  # read + write


def cases(device: str, quick: bool):
    """(op name, args, bytes moved, FLOPs, compute-bound?) at V4.1-Flash shapes (spec: d 5120, 64 x 512 heads)."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    b = 8 if quick else 64  # decode tokens
    out = []
    x = rnd(b * 64, 512)
    n = x.numel()
    out.append(("fp8_fake_quant", (x,), 2 * n * 2, 0, False))
    out.append(("nvfp4_fake_quant", (x,), 2 * n * 2, 0, False))
    out.append(("mxfp4_fake_quant", (rnd(b * 32, 128),), 2 * b * 32 * 128 * 2, 0, False))
    slots = torch.randperm(4 * b, generator=g)[:b].to(device)
    for fmt, dim in (("fp8_window", 512), ("nvfp4", 512), ("mxfp4", 128)):
        cache = torch.zeros(4 * b, ops.record_bytes(fmt, dim), dtype=torch.uint8, device=device)
        out.append((f"cache_write[{fmt}]", (cache, slots, rnd(b, dim), fmt),
                    b * (dim * 2 + ops.record_bytes(fmt, dim)), 0, False))
    topk, window = 512, 128
    pool_rows = 4096
    pool = rnd(pool_rows, 512)
    q = rnd(b, 64, 512)
    idx = torch.randint(0, pool_rows, (b, window + topk), generator=g).to(device)
    sink = rnd(64, dtype=torch.float32)
    flops = b * 2 * 2 * 64 * (window + topk) * 512
    out.append(("sparse_attention", (q, pool, idx, sink, 512 ** -0.5), b * ((window + topk) * 512 * 2 + 2 * 64 * 512 * 2),
                flops, True))
    n_keys = 8192 if quick else 32768
    qi = ops.mxfp4_fake_quant(rnd(b, 32, 128))
    keys = ops.mxfp4_fake_quant(rnd(n_keys, 128))
    out.append(("indexer_scores", (qi, rnd(b, 32, dtype=torch.float32), keys), n_keys * 68 + b * n_keys * 4,
                b * 2 * 32 * 128 * n_keys, False))
    scores = torch.randn(b, n_keys, generator=g).to(device)
    out.append(("topk_indices", (scores, topk), b * n_keys * 4 + b * topk * 8, 0, False))
    streams = rnd(b, 4, 5120)
    out.append(("hc_coefficients", (streams, rnd(24, 4 * 5120, dtype=torch.float32), rnd(24, dtype=torch.float32),
                                    rnd(3, dtype=torch.float32), 20, 1e-6, 1e-20),
                b * 4 * 5120 * 2 + 24 * 4 * 5120 * 4, b * 2 * 24 * 4 * 5120, False))
    out.append(("hc_collapse", (streams, rnd(b, 4, dtype=torch.float32)), b * 5 * 5120 * 2, 0, False))
    out.append(("hc_expand", (streams, rnd(b, 5120), rnd(b, 4, dtype=torch.float32), rnd(b, 4, 4, dtype=torch.float32)),
                b * 9 * 5120 * 2, 0, False))
    out.append(("rms_norm", (rnd(b, 5120), rnd(5120), 1e-20), b * 2 * 5120 * 2, 0, False))
    out.append(("sqrtsoftplus_route", (rnd(b, 384, dtype=torch.float32), rnd(384, dtype=torch.float32), 6, 1.5),
                b * 384 * 4, 0, False))
    table, tscale = ops.quantize_fp8_rows(torch.randn(100_000 if quick else 1_000_000, 256, generator=g))
    ids = torch.randint(0, table.shape[0], (b, 48), generator=g)
    out.append(("engram_gather", (table.to(device), tscale.to(device), ids.to(device), torch.bfloat16),
                b * 48 * (264 + 512), 0, False))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--check", action="store_true", help="compare each backend with the reference first")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--matrix-tflops", type=float, default=989.0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "kernels.md"))
    args = parser.parse_args()
    device = args.device
    bw = copy_bandwidth(device, (1 << 30) if device == "cuda" else (256 << 20))
    rows, failures = [], []
    for name, call_args, nbytes, flops, compute_bound in cases(device, args.quick):
        op_name = name.split("[")[0]
        op = getattr(ops, op_name)
        backends = ops.registry.backends_of(op_name) if device != "cpu" else ["reference"]
        ref_out = None
        for backend in backends:
            fn = op.reference if backend == "reference" else ops.registry.ops[op_name].backends[backend]
            clone_first = op_name == "cache_write"

            def run(fn=fn):
                a = list(call_args)
                if clone_first:
                    a[0] = a[0].clone()
                return fn(*a)

            try:
                result = run()
            except Exception as exc:  # a backend that cannot run this shape is reported, not fatal
                rows.append(dict(op=name, backend=backend, error=f"{type(exc).__name__}: {exc}"[:120]))
                continue
            if backend == "reference":
                ref_out = result
            elif args.check and ref_out is not None:
                got = result if isinstance(result, torch.Tensor) else result[0]
                want = ref_out if isinstance(ref_out, torch.Tensor) else ref_out[0]
                if got.dtype.is_floating_point:
                    ok = torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
                else:
                    ok = torch.equal(got, want)
                if not ok:
                    failures.append(f"{name}/{backend}")
            seconds = timeit(run, device)
            achieved_bw = nbytes / seconds
            frac = (flops / seconds) / (args.matrix_tflops * 1e12) if compute_bound else achieved_bw / bw
            row = dict(op=name, backend=backend, us=round(seconds * 1e6, 2), MB=round(nbytes / 1e6, 3),
                       GFLOP=round(flops / 1e9, 3), GBps=round(achieved_bw / 1e9, 2),
                       ceiling="matrix" if compute_bound else "copy bw", fraction=round(frac, 4))
            rows.append(row)
            print(json.dumps(row), flush=True)
    header = (f"# Kernel benchmark ({device}, {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'})\n\n"
              f"Measured copy bandwidth: {bw / 1e9:.1f} GB/s; matrix ceiling {args.matrix_tflops} TFLOP/s "
              f"(sparse attention only). Generated by benchmarks/kernels.py"
              f"{' --quick' if args.quick else ''}.\n\n"
              "| op | backend | time (us) | MB moved | GFLOP | GB/s | ceiling | fraction |\n|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r['op']} | {r['backend']} | " + (f"error: {r['error']} | | | | | |\n" if "error" in r else
        f"{r['us']} | {r['MB']} | {r['GFLOP']} | {r['GBps']} | {r['ceiling']} | {r['fraction']} |\n") for r in rows)
    if failures:
        body += f"\nMISMATCH vs reference: {', '.join(failures)}\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(header + body)
    print(f"wrote {args.out}")
    if failures:
        raise SystemExit(f"backends disagree with the reference: {failures}")


if __name__ == "__main__":
    main()
