"""One registry entry per op: the PyTorch reference is the truth, accelerator backends register against it.

Backends are discovered through pluggy: every module named in the ``deepinfer.op_backends`` entry-point group
(ours: see pyproject.toml; third parties may add more) implements the ``deepinfer_register_ops`` hook and calls
``registry.register_backend``. Discovery is lazy (first dispatch) so that importing the package never imports
Triton, a compiled extension or ``torch_npu``. A backend that cannot load is skipped with one INFO line.

Selection, per call, by the device of the first tensor argument: ``cuda`` tries the upstream wrappers (deepgemm,
flashinfer), then our cuda kernels, then triton; ``npu`` tries ascend (torch_npu), then triton (where triton-ascend
is installed); ``cpu`` tries vLLM's CPU kernels (where a vLLM CPU build is installed), then PyTorch's own grouped
GEMM (``torch``); everything falls back to ``reference``.
A backend declines a call outside its kernel's shapes or formats by returning ``NotImplemented``, and the next
choice takes it, so no backend needs to know which one follows it. ``DEEPINFER_OP_BACKEND`` forces a choice
(then only that backend and the reference are tried): either one backend name for every op (``triton``) or a
comma list of ``op=backend`` pairs (``fp8_quant=triton,sinkhorn=reference``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import pluggy
import torch

from .. import envs

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "deepinfer.op_backends"
hookspec = pluggy.HookspecMarker("deepinfer")
hookimpl = pluggy.HookimplMarker("deepinfer")

DEVICE_PREFERENCE = {"cuda": ("deepgemm", "flashinfer", "cuda", "triton"), "npu": ("ascend", "triton"),
                     "cpu": ("vllm", "torch")}


class OpBackendError(RuntimeError):
    """A forced backend does not exist or cannot run the call."""


class BackendSpec:
    @hookspec
    def deepinfer_register_ops(self, registry: "OpRegistry") -> None:
        """Register this backend's implementations with ``registry.register_backend``."""


@dataclass
class Op:
    name: str
    reference: Callable
    backends: dict[str, Callable] = field(default_factory=dict)
    forced_only: set[str] = field(default_factory=set)  # backends used only when DEEPINFER_OP_BACKEND names them


class OpRegistry:
    def __init__(self) -> None:
        self.ops: dict[str, Op] = {}
        self._discovered = False
        self._unavailable: dict[str, str] = {}

    def reference(self, name: str) -> Callable[[Callable], Callable]:
        """Decorator: declare ``fn`` as op ``name``'s reference and return a dispatching callable."""

        def wrap(fn: Callable) -> Callable:
            if name in self.ops:
                raise ValueError(f"op {name!r} is already registered")
            self.ops[name] = Op(name, fn)

            def dispatch(*args, **kwargs):
                *backends, reference = self.candidates(name, _first_device(args))
                for backend in backends:
                    result = backend(*args, **kwargs)
                    if result is not NotImplemented:
                        return result
                return reference(*args, **kwargs)

            dispatch.__name__ = fn.__name__
            dispatch.__doc__ = fn.__doc__
            dispatch.reference = fn
            dispatch.op_name = name
            return dispatch

        return wrap

    def register_backend(self, op_name: str, backend: str, fn: Callable, automatic: bool = True) -> None:
        """``automatic=False``: a kernel that measured slower than the next choice; kept for forced runs and
        benchmarks, skipped by the per-device preference."""
        if op_name not in self.ops:
            raise KeyError(f"backend {backend!r} registers unknown op {op_name!r}; known: {sorted(self.ops)}")
        self.ops[op_name].backends[backend] = fn
        if not automatic:
            self.ops[op_name].forced_only.add(backend)

    def mark_unavailable(self, backend: str, reason: str) -> None:
        if backend not in self._unavailable:
            self._unavailable[backend] = reason
            logger.info("deepinfer op backend %r unavailable (%s); using the reference", backend, reason)

    def cuda_major(self, backend: str) -> int | None:
        """The CUDA device's major compute capability (9 = Hopper, 10 = Blackwell), or None after marking
        ``backend`` unavailable when torch has no CUDA device: the first check of every CUDA backend."""
        if torch.version.cuda and torch.cuda.is_available():
            return torch.cuda.get_device_capability()[0]
        self.mark_unavailable(backend, "torch has no CUDA device")
        return None

    def discover(self) -> None:
        if self._discovered:
            return
        self._discovered = True
        manager = pluggy.PluginManager("deepinfer")
        manager.add_hookspecs(BackendSpec)
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                manager.register(ep.load(), name=ep.name)
            except Exception as exc:  # a backend's import failing must never break the package
                self.mark_unavailable(ep.name, f"{type(exc).__name__}: {exc}")
        manager.hook.deepinfer_register_ops(registry=self)

    def forced(self, name: str) -> str | None:
        value = envs.op_backend()
        if not value:
            return None
        if "=" not in value:
            return value
        for pair in value.split(","):
            op_name, _, backend = pair.partition("=")
            if op_name.strip() == name:
                return backend.strip()
        return None

    def candidates(self, name: str, device_type: str) -> list[Callable]:
        """Implementations to try, in order, ending with the reference. A backend declines a call it cannot take
        exactly (a shape, dtype or format outside its kernel) by returning ``NotImplemented``; the next one runs."""
        self.discover()
        op = self.ops[name]
        forced = self.forced(name)
        if forced is not None and forced != "reference":
            if forced in op.backends:
                return [op.backends[forced], op.reference]
            if forced in self._unavailable:
                return [op.reference]
            known = sorted(op.backends) + ["reference"]
            raise OpBackendError(f"DEEPINFER_OP_BACKEND asks for {forced!r} for op {name!r}; available: {known}")
        if forced == "reference":
            return [op.reference]
        preferred = [op.backends[backend] for backend in DEVICE_PREFERENCE.get(device_type, ())
                     if backend in op.backends and backend not in op.forced_only]
        return [*preferred, op.reference]

    def select(self, name: str, device_type: str) -> Callable:
        """The first implementation a call on ``device_type`` tries."""
        return self.candidates(name, device_type)[0]

    def backends_of(self, name: str) -> list[str]:
        self.discover()
        return ["reference", *sorted(self.ops[name].backends)]


def _first_device(args) -> str:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device.type
    return "cpu"


registry = OpRegistry()
