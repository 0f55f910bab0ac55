"""Which op's device backend takes the tiny model away from the CPU reference's logits
(tests/ops/test_triton_model.py::test_tiny_model_on_gpu_matches_cpu_reference: tiny-vocab256, seed 0, prompt
(12, 5), prefill 9 tokens then decode 3, fp32 logits within 2e-3).

Under the Triton interpreter with the GPU's launch choices (``--device cpu --gpu-choices``: tiles, splits, bf16
indexer dots) every Triton op matches the reference (2e-6), so what differs on a GPU is compiled code, the CUDA
backend or the references on the device. Four passes, one process:
  1. every op on its reference, on the device: the model's own torch code and the references there;
  2. shadow: the model runs on the references while every call of an op with a device backend is also run by
     each such backend on a copy of the same inputs, and the outputs are compared call by call (the backend's
     own error at the model's real inputs, before anything downstream amplifies it);
  3. one op at a time on one backend, every other op on its reference, for each (op, backend) the model calls;
  4. the default selection (what the test runs), and if it diverges, the default with one op at a time put back
     on its reference.
Each run prints its largest logit difference and the largest per row (rows 0-8 prefill, 9-11 decode); lines
past the test's 2e-3 end in "<-- off". Exit status 1 when any run or shadow comparison is off, so the device
script's summary shows it.

  python benchmarks/gpu_diagnose.py [--device cuda] [--ops NAME ...]
  python benchmarks/gpu_diagnose.py --device cpu [--gpu-choices] [--ops NAME ...]   # Triton interpreter, slow
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

TOLERANCE = 2e-3  # the test's, on fp32 logits of magnitude ~1
SHADOW_FLOAT = 1e-4  # a backend's own output, relative to the reference output's largest magnitude


def prompt(n: int, seed: int, vocab: int = 250) -> torch.Tensor:
    """tests/conftest.py's prompt: token ids avoiding the special ids 0-2 and the tiny config's image token."""
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(clone(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(clone(v) for v in value)
    return value


def tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors(v)]
    return []


def compare(got, want) -> tuple[float, int, str]:
    """(largest float difference relative to the reference's largest magnitude, integer / byte elements that
    differ, a note): every tensor of the outputs, in order."""
    worst, differ, note = 0.0, 0, ""
    got_t, want_t = tensors(got), tensors(want)
    if len(got_t) != len(want_t):
        return float("inf"), 0, f"{len(got_t)} tensors, reference {len(want_t)}"
    for g, w in zip(got_t, want_t):
        if g.shape != w.shape or g.dtype != w.dtype:
            return float("inf"), 0, f"{g.dtype} {tuple(g.shape)}, reference {w.dtype} {tuple(w.shape)}"
        if w.dtype.is_floating_point and w.dtype.itemsize > 1:
            a, b = g.double(), w.double()
            if (a.isnan() != b.isnan()).any():
                worst, note = float("inf"), "NaN where the reference has none (or the reverse)"
                continue
            ok = ~b.isnan()
            scale = b[ok].abs().max().item() if ok.any() else 0.0
            diff = (a - b)[ok].abs().max().item() if ok.any() else 0.0
            worst = max(worst, diff / scale if scale else (float("inf") if diff else 0.0))
        else:
            a = g.view(torch.uint8) if g.dtype.itemsize == 1 else g
            b = w.view(torch.uint8) if w.dtype.itemsize == 1 else w
            differ += int((a != b).sum())
    return worst, differ, note


class Shadow:
    """Registry candidates for pass 2: every call of a watched op runs the reference (whose output the model
    keeps) and each device backend on copies of the arguments made before the reference runs (cache_write writes
    in place)."""

    def __init__(self, registry, watched: dict[str, list[str]]):
        self.registry, self.watched = registry, watched
        self.original = registry.candidates
        self.phase = ""
        self.calls: dict[tuple[str, str], list] = {}  # (op, backend) -> [(phase, rel, differ, note or declined)]

    def candidates(self, name: str, device_type: str):
        if name not in self.watched:
            return self.original(name, device_type)
        op = self.registry.ops[name]

        def shadowed(*args, **kwargs):
            copies = {backend: (clone(args), clone(kwargs)) for backend in self.watched[name]}
            want = op.reference(*args, **kwargs)
            for backend, (a, k) in copies.items():
                try:
                    got = op.backends[backend](*a, **k)
                except Exception as exc:  # reported as this call's result; the model goes on with the reference
                    record = (self.phase, float("inf"), 0, f"raised {type(exc).__name__}: {exc}"[:200])
                else:
                    record = ((self.phase, 0.0, 0, "declined") if got is NotImplemented
                              else (self.phase, *compare(got, want)))
                self.calls.setdefault((name, backend), []).append(record)
            return want

        return [shadowed, op.reference]


def emulate_gpu_choices() -> None:
    """For --device cpu: the launchers pick tiles, splits and dot types as on a GPU (each kernel module's
    INTERPRETED flag off; common's stays on, so CPU tensors still run), the interpreter's dot takes bf16 operands
    as values (it would multiply their bit patterns as integers) and its fp32 -> bf16 cast rounds to nearest even
    as a GPU's does (it truncates). Hardware behaviour (tensor-core accumulation, fp8 conversion instructions) is
    not emulated."""
    import importlib
    import pkgutil

    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    from deepinfer_plugins.ops.backends import triton_kernels

    for info in pkgutil.iter_modules(triton_kernels.__path__):
        module = importlib.import_module(f"{triton_kernels.__name__}.{info.name}")
        if info.name != "common" and hasattr(module, "INTERPRETED"):
            module.INTERPRETED = False
    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)

        def values(h):
            if h.dtype.scalar == tl.bfloat16:
                return (h.data.astype(np.uint32) << 16).view(np.float32)
            return h.data.astype(np.float32)

        return interpreter.TensorHandle(np.matmul(values(a), values(b), dtype=np.float32) + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot
    original_cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return original_cast(self, src, dst_type)
        values = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
        return interpreter.TensorHandle(values.bfloat16().view(torch.int16).numpy().view(np.uint16), tl.bfloat16)

    interpreter.InterpreterBuilder.cast_impl = cast_impl


def run_model(model, ids: torch.Tensor, shadow: Shadow | None = None) -> torch.Tensor:
    cache = model.new_cache()
    if shadow:
        shadow.phase = "prefill"
    rows = [model(ids[:9], cache)]
    for i in range(9, 12):
        if shadow:
            shadow.phase = f"decode {i}"
        rows.append(model(ids[i:i + 1], cache))
    return torch.cat(rows).float().cpu()


def report(label: str, model, ids: torch.Tensor, want: torch.Tensor) -> bool:
    """One prefill + decode run under the current DEEPINFER_OP_BACKEND, printed; True when off."""
    try:
        got = run_model(model, ids)
    except Exception as exc:
        print(f"{label:44s} raised {type(exc).__name__}: {exc}"[:300] + "  <-- off", flush=True)
        return True
    per_row = (got - want).abs().amax(dim=1)
    worst = per_row.max().item()
    off = not worst <= TOLERANCE
    rows = " ".join(f"{v:.0e}" for v in per_row.tolist())
    print(f"{label:44s} max {worst:.2e}  rows [{rows}]{'  <-- off' if off else ''}", flush=True)
    return off


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ops", nargs="*", default=None, help="only these ops in passes 2 to 4")
    parser.add_argument("--gpu-choices", action="store_true",
                        help="--device cpu: the interpreter runs the kernels with a GPU's tiles, splits and dot types")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if args.gpu_choices:
            emulate_gpu_choices()
    os.environ.pop("DEEPINFER_OP_BACKEND", None)

    from deepinfer_plugins import ops
    from deepinfer_plugins.models.deepseek_v41 import DeepseekV41ForCausalLM
    from deepinfer_plugins.models.deepseek_v41.checkpoint import write_random_checkpoint

    start = time.time()
    registry = ops.registry
    registry.discover()
    names = sorted(registry.ops)
    all_reference = {name: "reference" for name in names}

    def force(choice: dict[str, str] | None) -> None:
        if choice is None:
            os.environ.pop("DEEPINFER_OP_BACKEND", None)
        else:
            os.environ["DEEPINFER_OP_BACKEND"] = ",".join(f"{op}={backend}" for op, backend in choice.items())

    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(tmp, "tiny-vocab256", seed=0)
        ids = prompt(12, 5)
        force(all_reference)
        want = DeepseekV41ForCausalLM.from_pretrained(path)(ids).float()  # the test's CPU reference: one forward
        model = DeepseekV41ForCausalLM.from_pretrained(path, device=args.device)
    ids = ids.to(args.device)
    device_backends = {name: [b for b in registry.backends_of(name)[1:] if args.device != "cpu" or b == "triton"]
                       for name in names}
    device_backends = {name: backends for name, backends in device_backends.items()
                       if backends and (args.ops is None or name in args.ops)}
    off = False
    where = torch.cuda.get_device_name() if args.device == "cuda" else \
        f"interpreter{', GPU launch choices' if args.gpu_choices else ''}"
    print(f"# {args.device} ({where}), "
          f"backends per op: {device_backends}", flush=True)

    print("## 1. every op on the reference, on the device", flush=True)
    force(all_reference)
    off |= report("reference only", model, ids, want)

    print(f"## 2. shadow: each backend on the model's inputs, call by call (float: largest difference / largest "
          f"|reference|, off above {SHADOW_FLOAT:.0e}; ints and bytes: elements that differ)", flush=True)
    shadow = Shadow(registry, device_backends)
    registry.candidates = shadow.candidates
    try:
        run_model(model, ids, shadow)
    finally:
        registry.candidates = shadow.original
    called = []
    for (name, backend), records in sorted(shadow.calls.items()):
        ran = [r for r in records if r[3] != "declined"]
        if ran:
            called.append((name, backend))
        worst = max(ran, key=lambda r: (r[1], r[2]), default=None)
        bad = [r for r in ran if r[1] > SHADOW_FLOAT or r[2] or r[3]]
        off |= bool(bad)
        where = f"first off: {bad[0][0]} ({len(bad)} of {len(ran)} calls)" if bad else ""
        summary = f"worst {worst[1]:.1e} rel, {worst[2]} elements differ {worst[3]}" if worst else ""
        print(f"{name + '=' + backend:44s} calls {len(records)} (declined {len(records) - len(ran)})  {summary}  "
              f"{where}{'  <-- off' if bad else ''}", flush=True)

    print("## 3. one op on one backend, every other op on the reference", flush=True)
    for name, backend in called:
        force({**all_reference, name: backend})
        off |= report(f"{name}={backend}", model, ids, want)

    print("## 4. the default selection (the test)", flush=True)
    force(None)
    default_off = report("default", model, ids, want)
    if default_off:
        for name in sorted({name for name, _ in called}):
            force({name: "reference"})
            report(f"default but {name}=reference", model, ids, want)
    force(None)
    print(f"# {time.time() - start:.0f} s", flush=True)
    return 1 if off or default_off else 0


if __name__ == "__main__":
    sys.exit(main())
