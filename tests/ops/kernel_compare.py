"""Helpers for kernel-vs-reference tests: the Triton interpreter switch, the test device, fresh seeds, poisoned
outputs and a comparator that points at the worst element (FlashMLA ``compare.py`` style).

``DEEPINFER_TEST_DEVICE`` (default ``cpu``) picks where kernels run. On ``cpu``, importing this module turns the
Triton interpreter on (before any kernel is decorated), so it must be imported before
``deepinfer_plugins.ops.backends.triton_kernels``. On ``cuda`` (upstream triton) or ``npu`` (torch_npu with
triton-ascend; never run so far) the same tests run the compiled kernels: tests build inputs and references on the
CPU and call kernels through ``on_test_device``.
"""

from __future__ import annotations

import os
import types

TEST_DEVICE = os.environ.get("DEEPINFER_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
if TEST_DEVICE == "npu":
    pytest.importorskip("torch_npu")  # registers torch.npu
ACCELERATOR = getattr(torch, TEST_DEVICE) if TEST_DEVICE != "cpu" else None  # torch.cuda / torch.npu
if ACCELERATOR is not None and not ACCELERATOR.is_available():
    pytest.skip(f"DEEPINFER_TEST_DEVICE={TEST_DEVICE} but torch sees no such device", allow_module_level=True)


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple of tensors (ops.ExpertWeights)
        return type(value)(*(_to(v, device) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value


def to_test_device(value):
    """A tensor, or a tuple / NamedTuple / list of them, on TEST_DEVICE: for tests that call a launcher directly
    (to watch what it does) instead of through ``on_test_device``."""
    return _to(value, TEST_DEVICE)


class on_test_device(types.SimpleNamespace):
    """A kernel module whose launchers run on TEST_DEVICE: tensor arguments are copied there, results come back
    to the CPU, and arguments a kernel wrote in place are copied back, so one test reads the same on any device."""

    def __init__(self, module: types.ModuleType):
        super().__init__(module=module)

    def __getattr__(self, name):
        fn = getattr(self.module, name)
        if TEST_DEVICE == "cpu" or not callable(fn):
            return fn

        def call(*args, **kwargs):
            moved = [_to(a, TEST_DEVICE) for a in args]
            result = fn(*moved, **{k: _to(v, TEST_DEVICE) for k, v in kwargs.items()})
            ACCELERATOR.synchronize()
            for original, copy in zip(args, moved):
                if isinstance(original, torch.Tensor):
                    original.copy_(copy.cpu())
            return _to(result, "cpu")

        return call


def fresh_generator(request) -> torch.Generator:
    """A new random seed per test run, printed so that a failure can be replayed (DEEPINFER_TEST_SEED=...)."""
    seed = int(os.environ.get("DEEPINFER_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"{request.node.nodeid}: seed {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def gen(request):
    return fresh_generator(request)


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    from deepinfer_plugins.ops.backends.triton_kernels import common

    monkeypatch.setattr(common, "POISON", True)


def describe(actual: torch.Tensor, expected: torch.Tensor) -> str:
    a, e = actual.double().flatten(), expected.double().flatten()
    diff = (a - e).abs().nan_to_num(float("inf"))
    worst = int(diff.argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), actual.shape))
    cos = 1 - torch.nn.functional.cosine_similarity(a.nan_to_num(0)[None], e.nan_to_num(0)[None]).item()
    rel = diff[worst] / max(abs(e[worst].item()), 1e-30)
    return (f"worst at {index}: got {a[worst].item()!r}, want {e[worst].item()!r} (abs {diff[worst].item():.3e}, "
            f"rel {rel:.3e}); cosine diff {cos:.3e}; nan got/want {int(a.isnan().sum())}/{int(e.isnan().sum())}, "
            f"inf got/want {int(a.isinf().sum())}/{int(e.isinf().sum())}")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, cos: float = 1e-5) -> None:
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.double(), expected.double()
    same_nonfinite = (a.isnan() == e.isnan()).all() and (a.isinf() == e.isinf()).all() and \
        (a[a.isinf()] == e[e.isinf()]).all()
    finite = a.isfinite() & e.isfinite()
    ok = bool(same_nonfinite) and bool(((a - e).abs()[finite] <= atol + rtol * e.abs()[finite]).all())
    if a.numel() > 1 and finite.all():
        cd = 1 - torch.nn.functional.cosine_similarity(a.flatten()[None], e.flatten()[None]).item()
        ok = ok and (cd <= cos or e.abs().max() == 0)
    assert ok, describe(actual, expected)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-exact, except that +0 and -0 are equal (the quantisers' zero sign is not part of the contract)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, \
        f"{actual.dtype} {tuple(actual.shape)} != {expected.dtype} {tuple(expected.shape)}"
    if actual.dtype.is_floating_point and actual.dtype.itemsize > 1:
        a, e = actual.float(), expected.float()
        bad = ~((a == e) | (a.isnan() & e.isnan()))
    else:
        bad = actual.view(torch.uint8) != expected.view(torch.uint8) if actual.dtype.itemsize == 1 else actual != expected
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} differ; " + describe(actual.float(), expected.float())


def triton_kernels() -> dict[str, object]:
    """name -> every kernel the Triton backend launches: the ``*_kernel`` jit functions of each module of
    ``deepinfer_plugins.ops.backends.triton_kernels`` (the jit helpers they call are not launched)."""
    import importlib
    import pkgutil

    from deepinfer_plugins.ops.backends import triton_kernels as package
    from deepinfer_plugins.ops.backends.triton_kernels import common

    jit_type = type(common.pow2_ceil)  # JITFunction, or the interpreter's stand-in
    modules = [importlib.import_module(f"{package.__name__}.{info.name}")
               for info in pkgutil.iter_modules(package.__path__)]
    return {name: obj for module in modules for name, obj in vars(module).items()
            if isinstance(obj, jit_type) and name.endswith("_kernel")}
