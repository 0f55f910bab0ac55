"""Triton backend: registers a Triton launcher for every op that has one (triton_kernels/).

Runs CUDA tensors compiled, NPU tensors compiled where the installed triton is triton-ascend (the Ascend
backend's choice for the ops no torch_npu op covers), and CPU tensors under the interpreter
(``TRITON_INTERPRET=1``, which must be set before the first dispatch). A call that Triton cannot run here (a CPU
tensor without the interpreter, an accelerator the installed triton does not target, or a launch larger than
an NPU takes) is declined with one INFO line per op, and the reference runs it. On an NPU a kernel that fails
to compile (triton-ascend's compiler is not run in CI past its first stage) logs one warning, and the reference
runs that op from then on.
"""

from __future__ import annotations

import importlib
import logging

import torch
import triton  # noqa: F401  (ImportError here marks the backend unavailable, with one INFO line)
from triton.compiler.errors import TritonError

from ..registry import hookimpl

logger = logging.getLogger(__name__)

# op name -> triton_kernels module that defines a launcher of the same name
OPS = {
    "fp8_block_quant": "quant", "fp8_fake_quant": "quant", "nvfp4_fake_quant": "quant", "mxfp4_fake_quant": "quant",
    "dequant_fp8_weight": "quant", "dequant_fp4_weight": "quant",
    "pack_cache_records": "quant", "unpack_cache_records": "quant", "cache_write": "quant", "cache_gather": "quant",
    "engram_gather": "quant",
    "sparse_attention": "attention", "sparse_attention_records": "attention",
    "linear_fp8": "gemm", "linear_fp4": "gemm", "linear_fp8_grouped": "gemm", "linear_to_fp32": "gemm",
    "moe_experts": "moe",
    "indexer_scores": "indexer", "topk_indices": "indexer", "candidate_mask": "indexer", "indexer_topk": "indexer",
    "indexer_scores_records": "indexer", "indexer_topk_records": "indexer",
    "sinkhorn": "mhc", "hc_coefficients": "mhc", "hc_collapse": "mhc", "hc_collapse_norm": "mhc", "hc_expand": "mhc",
    "rms_norm": "misc", "rope": "misc", "swiglu": "misc", "sqrtsoftplus_route": "misc", "engram_hash": "misc",
    "engram_gate": "misc", "csa2_compress": "misc",
}

# Kernels that measured slower than the reference on an H200 (benchmarks/results/kernels_h200.md): registered for
# DEEPINFER_OP_BACKEND and benchmarks, not chosen by default. topk_indices: 360 us against torch's sort at 263 us
# (64 rows x 32768 entries; one program per row does 32 radix passes).
FORCED_ONLY = {"topk_indices"}

_declined_logged: set[str] = set()
_failed_to_compile: set[str] = set()


def _first_tensor(args) -> torch.Tensor | None:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg
    return None


def _decline(op_name: str, why: str):
    if op_name not in _declined_logged:
        _declined_logged.add(op_name)
        logger.info("triton declines op %r (%s); using the reference", op_name, why)
    return NotImplemented


def _make(op_name: str, module: str):
    launcher = None

    def run(*args, **kwargs):
        nonlocal launcher
        if launcher is None:  # kernels are decorated (and the interpreter mode read) on first use
            launcher = getattr(importlib.import_module(f"{__package__}.triton_kernels.{module}"), op_name)
        from .triton_kernels import common

        first = _first_tensor(args)
        if first is not None and not common.can_run(first):
            why = ("CPU tensors need TRITON_INTERPRET=1" if first.device.type == "cpu"
                   else f"the installed triton does not target {first.device.type} tensors")
            return _decline(op_name, why)
        if op_name in _failed_to_compile:
            return NotImplemented
        try:
            return launcher(*args, **kwargs)
        except common.GridTooLarge as exc:
            return _decline(op_name, str(exc))
        except TritonError as exc:
            if not common.TRITON_ASCEND or common.INTERPRETED:
                raise
            _failed_to_compile.add(op_name)
            logger.warning("triton-ascend cannot compile op %r; the reference runs it from now on. %s: %s", op_name,
                           type(exc).__name__, exc)
            return NotImplemented

    run.__name__ = f"triton_{op_name}"
    return run


@hookimpl
def deepinfer_register_ops(registry) -> None:
    for op_name, module in OPS.items():
        if op_name in registry.ops:
            registry.register_backend(op_name, "triton", _make(op_name, module),
                                      automatic=op_name not in FORCED_ONLY)
