"""CUDA backend: our compiled kernels (kernels/cuda) for the ops where Triton cannot reach the roofline.

Registers only when torch is a CUDA build with a visible GPU; the extension is JIT-built on first use from the
repository's kernels/cuda/build.py (nvcc required). On any other machine it registers nothing and the registry
logs one INFO line. CUDA kernels here: cache_write (fused quantise + pack + scatter, all three formats) and
sparse_attention (bf16, head dim <= 512; CUDA-core baseline). Other ops use Triton on CUDA tensors.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch

from ..cache import CACHE_FORMATS, record_bytes
from ..registry import hookimpl

logger = logging.getLogger(__name__)
_FMT_ID = {"fp8_window": 0, "nvfp4": 1, "mxfp4": 2}
_ext = None


def _extension():
    global _ext
    if _ext is None:
        build = Path(__file__).resolve().parents[3] / "kernels" / "cuda" / "build.py"
        spec = importlib.util.spec_from_file_location("deepinfer_cuda_build", build)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _ext = module.load()
    return _ext


def cache_write(cache, slots, x, fmt):
    if fmt not in CACHE_FORMATS or x.shape[-1] % 32:
        from ..cache import cache_write as ref

        return ref.reference(cache, slots, x, fmt)
    return _extension().cache_write(cache, slots.long(), x, _FMT_ID[fmt], record_bytes(fmt, x.shape[-1]))


def sparse_attention(q, kv_pool, indices, sink, softmax_scale):
    if q.dtype != torch.bfloat16 or q.shape[-1] > 512:
        from .triton_kernels.attention import sparse_attention as triton_attention

        return triton_attention(q, kv_pool, indices, sink, softmax_scale)
    return _extension().sparse_attention(q, kv_pool.to(q.dtype), indices, sink, float(softmax_scale))


@hookimpl
def deepinfer_register_ops(registry) -> None:
    if not (torch.version.cuda and torch.cuda.is_available()):
        registry.mark_unavailable("cuda", "torch has no CUDA device")
        return
    registry.register_backend("cache_write", "cuda", cache_write)
    registry.register_backend("sparse_attention", "cuda", sparse_attention)
