"""vLLM's CPU kernels as a backend: ``linear_to_fp32`` (the fp32 LM head and router) as vLLM's oneDNN GEMM.

vLLM's CPU build prepacks every fp32 weight it owns into oneDNN's blocked layout once (``create_onednn_mm``) and
multiplies against that copy (``onednn_mm``), the path of its own models' linear layers and LM heads. On the
decode shapes of a CPU server (a few to a few dozen rows against a vocabulary-wide head) that GEMM is up to 1.7x
faster than ``torch.nn.functional.linear`` on one thread, which is what a vLLM CPU worker gets on a small box
(``docs/architecture.md``). The prepacked copy is made on the first call with a weight and reused while that
tensor lives and is not modified in place (its ``_version`` is checked each call); the copy costs the weight's
size once more in host memory.

Registers where ``vllm._custom_ops`` imports with oneDNN support (a vLLM CPU build); the import happens at
discovery, never at package import. Declines (``NotImplemented``: the reference runs) anything but fp32 activations
against a contiguous fp32 2-D weight on the CPU (a bf16 head multiplied by oneDNN would round its output to bf16,
where the reference keeps fp32), and every call inside a torch.compile trace: there the reference is what gets
traced (the router inside vLLM's compiled body), and the compiler picks its own GEMM.
"""

from __future__ import annotations

import weakref

import torch

from ..registry import hookimpl

PRIMITIVE_CACHE_SIZE = 32  # oneDNN primitives kept per weight, one per distinct row count (vLLM's own setting)


class PrepackedWeights:
    """One oneDNN handler per live weight tensor, rebuilt when the tensor is modified in place."""

    def __init__(self, ops) -> None:
        self.ops = ops
        self.handlers: dict[int, tuple[int, object]] = {}

    def handler(self, weight: torch.Tensor):
        key = id(weight)
        entry = self.handlers.get(key)
        if entry is None or entry[0] != weight._version:
            if entry is None:
                weakref.finalize(weight, self.handlers.pop, key, None)
            entry = (weight._version, self.ops.create_onednn_mm(weight.t(), PRIMITIVE_CACHE_SIZE))
            self.handlers[key] = entry
        return entry[1]

    def linear_to_fp32(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if (torch.compiler.is_compiling() or x.device.type != "cpu" or weight.device.type != "cpu"
                or x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.dim() != 2
                or not weight.is_contiguous() or x.numel() == 0 or x.shape[-1] != weight.shape[1]):
            return NotImplemented
        return self.ops.onednn_mm(self.handler(weight), x.contiguous(), None)


@hookimpl
def deepinfer_register_ops(registry) -> None:
    try:
        import vllm._custom_ops as ops
    except Exception as exc:  # no vLLM, or a build whose extension cannot load: the reference stays
        registry.mark_unavailable("vllm", f"cannot import vllm._custom_ops ({type(exc).__name__}: {exc})")
        return
    if not getattr(ops, "_supports_onednn", False):
        registry.mark_unavailable("vllm", "this vLLM build has no oneDNN GEMM (not a CPU build)")
        return
    registry.register_backend("linear_to_fp32", "vllm", PrepackedWeights(ops).linear_to_fp32)
