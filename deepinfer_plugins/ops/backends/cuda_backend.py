"""CUDA backend: our compiled kernels (kernels/cuda) for the ops where Triton cannot reach the roofline.

Registers only when torch is a CUDA build with a visible GPU; the extension is JIT-built on first use from
kernels/cuda/build.py (shipped in the wheel, ``cuda_sources``), which needs nvcc. Without a GPU it registers nothing,
without the sources or nvcc only the cuBLAS op, and the registry logs one INFO line; a failed build logs a warning
and the kernels decline. CUDA kernels here: cache_write (fused quantise + pack + scatter, all three formats, into
row-strided tables) and sparse_attention (bf16, head dim <= 512) in four variants, all callable directly for
benchmarks:
  * ``sparse_attention_mma``     tensor cores (mma.sync m16n8k16), head dim a multiple of 16; the default.
  * ``sparse_attention_simt``    CUDA-core baseline, any head dim <= 512.
  * ``sparse_attention_wgmma``   Hopper warpgroup MMA, sm_90 only, head dim a multiple of 64.
  * ``sparse_attention_tcgen05`` SM100 / SM103 tcgen05 (accumulators in tensor memory) + TMA, head dim a
    multiple of 64.
The last two compile for their targets but have not run on hardware yet, so they are opt-in: only a forced
``DEEPINFER_CUDA_ATTENTION`` selects them until a device run (benchmarks/device_check.sh) verifies them.
Env ``DEEPINFER_CUDA_ATTENTION`` (read per call) forces one variant: ``mma``, ``simt``, ``wgmma`` or
``tcgen05``; unset / empty declines decode batches under ``MMA_FROM_ROWS`` rows (Triton's split-K kernel, the
registry's next choice, is faster there on the H200), else picks mma where its shape rule holds, else simt.
Shapes or devices a variant does not take (non-bf16 q, head dim > 512, a forced variant's rule or arch failing)
are declined too and go to the Triton kernel. ``sparse_attention_records`` (the model's attention over its cache
records) decodes the distinct keys of a batch once into a bf16 pool and runs the same kernels, under the same
rules, when the batch's rows share their keys (see ``sparse_attention_records``). ``linear_to_fp32`` (the router
and the LM head) is cuBLAS with an fp32 output from bf16 / fp16 operands (``torch.mm``'s ``out_dtype``), which reads
the weight as stored, as Triton's kernel does, from a library that has run at these shapes. Other ops use Triton on
CUDA tensors.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch

from ... import envs
from ..cache import CACHE_FORMATS, cache_gather, record_bytes
from ..fused import key_references, records_pool
from ..registry import hookimpl

logger = logging.getLogger(__name__)
_FMT_ID = {"fp8_window": 0, "nvfp4": 1, "mxfp4": 2}
ATTENTION_ENV = "DEEPINFER_CUDA_ATTENTION"
# H200, H=64, D=512, K=640 (benchmarks/results/kernels_h200.md): Triton's split launch beats mma below this many
# query rows (T=1: 9.3 against 18.8 us, T=8: 16.3 against 19.7 us); from T=64 on mma leads (47 against 61 us).
MMA_FROM_ROWS = 32
# Pooling decodes each distinct key once (writes and re-reads it as bf16) instead of decoding every reference in
# registers: it pays only when keys are read by several rows. A guess until a device run times both.
MIN_READS_PER_KEY = 4
_ext = None
_ext_failure: str | None = None


def cuda_sources() -> Path | None:
    """The kernels/cuda directory (build.py and csrc/): inside the package when installed from a wheel (setup.py
    copies it to ``cuda_sources``), else the source checkout's for an editable install; None if neither exists."""
    package = Path(__file__).resolve().parents[2]
    for directory in (package / "cuda_sources", package.parent / "kernels" / "cuda"):
        if (directory / "build.py").is_file():
            return directory
    return None


def _extension():
    """The compiled kernels, JIT-built on first use (cached by torch across processes); None when the build failed,
    so every kernel declines and Triton runs instead of the server stopping."""
    global _ext, _ext_failure
    if _ext is None and _ext_failure is None:
        try:
            spec = importlib.util.spec_from_file_location("deepinfer_cuda_build", cuda_sources() / "build.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _ext = module.load()
        except Exception as exc:  # no sources, nvcc too old for an arch, a broken toolchain: log it, keep serving
            _ext_failure = f"{type(exc).__name__}: {exc}"
            logger.warning("deepinfer CUDA kernels failed to build (%s); their ops run on Triton", _ext_failure)
    return _ext


def _toolchain_missing() -> str | None:
    """Why the extension cannot be built here (no sources, no nvcc), checked without building it."""
    if cuda_sources() is None:
        return "the kernels/cuda sources are not installed"
    from torch.utils.cpp_extension import CUDA_HOME

    return None if CUDA_HOME else "no CUDA toolkit (nvcc) found for the JIT build"


def cache_write(cache, slots, x, fmt):
    if fmt not in CACHE_FORMATS or x.shape[-1] % 32:
        return NotImplemented
    ext = _extension()
    if ext is None:
        return NotImplemented
    return ext.cache_write(cache, slots.long(), x, _FMT_ID[fmt], record_bytes(fmt, x.shape[-1]))


def _simt_fits(q) -> bool:
    return q.dtype == torch.bfloat16 and q.shape[-1] <= 512


def _mma_fits(q) -> bool:
    return _simt_fits(q) and q.shape[-1] % 16 == 0


def _wgmma_fits(q) -> bool:
    return _simt_fits(q) and q.shape[-1] % 64 == 0 and torch.cuda.get_device_capability(q.device)[0] == 9


def _tcgen05_fits(q) -> bool:
    return _simt_fits(q) and q.shape[-1] % 64 == 0 and torch.cuda.get_device_capability(q.device)[0] == 10


def _run_attention(kernel, q, kv_pool, indices, sink, softmax_scale):
    ext = _extension()
    if ext is None:
        return NotImplemented
    return getattr(ext, kernel)(q, kv_pool.to(q.dtype), indices, sink, float(softmax_scale))


def sparse_attention_mma(q, kv_pool, indices, sink, softmax_scale):
    """Tensor-core kernel; needs bf16 q and a head dim that is a multiple of 16 and <= 512."""
    return _run_attention("sparse_attention_mma", q, kv_pool, indices, sink, softmax_scale)


def sparse_attention_simt(q, kv_pool, indices, sink, softmax_scale):
    """CUDA-core baseline; needs bf16 q and a head dim <= 512."""
    return _run_attention("sparse_attention_simt", q, kv_pool, indices, sink, softmax_scale)


def sparse_attention_wgmma(q, kv_pool, indices, sink, softmax_scale):
    """Hopper wgmma kernel (sm_90 only); needs bf16 q and a head dim that is a multiple of 64 and <= 512."""
    return _run_attention("sparse_attention_wgmma", q, kv_pool, indices, sink, softmax_scale)


def sparse_attention_tcgen05(q, kv_pool, indices, sink, softmax_scale):
    """SM100 / SM103 tcgen05 kernel; needs bf16 q and a head dim that is a multiple of 64 and <= 512."""
    return _run_attention("sparse_attention_tcgen05", q, kv_pool, indices, sink, softmax_scale)


# forced variant -> (shape / device rule, kernel)
FORCED_VARIANTS = {
    "mma": (_mma_fits, sparse_attention_mma),
    "simt": (_simt_fits, sparse_attention_simt),
    "wgmma": (_wgmma_fits, sparse_attention_wgmma),
    "tcgen05": (_tcgen05_fits, sparse_attention_tcgen05),
}


def sparse_attention(q, kv_pool, indices, sink, softmax_scale):
    forced = envs.cuda_attention()
    if forced:
        if forced not in FORCED_VARIANTS:
            raise ValueError(f"{ATTENTION_ENV}={forced!r}; expected one of {sorted(FORCED_VARIANTS)} or unset")
        fits, kernel = FORCED_VARIANTS[forced]
        return kernel(q, kv_pool, indices, sink, softmax_scale) if fits(q) else NotImplemented
    if q.shape[0] < MMA_FROM_ROWS:
        return NotImplemented
    if _mma_fits(q):
        return sparse_attention_mma(q, kv_pool, indices, sink, softmax_scale)
    if _simt_fits(q):
        return sparse_attention_simt(q, kv_pool, indices, sink, softmax_scale)
    return NotImplemented


def sparse_attention_records(q, window_cache, window_slots, compressed_cache, compressed_slots, sink, softmax_scale):
    """Keys read from the cache records. When the rows share their keys (prefill or DSpark verify of a sequence:
    at least ``MMA_FROM_ROWS`` rows, each distinct key read by ``MIN_READS_PER_KEY`` rows on average), each
    distinct key is decoded once into a bf16 pool (the registry's ``cache_gather``) for the tensor-core kernel,
    which on the H200 beat Triton's pool kernel from 64 rows; whether that also beats Triton's records kernel
    (every row's keys decoded in registers) is not measured yet: benchmarks/kernels.py times both. Rows of
    different sequences (a batch of decodes) read disjoint keys, so a pool would only add a decode pass: they go to
    Triton's records kernel, as do small batches. Counting the distinct keys costs one device sync. A forced
    ``DEEPINFER_CUDA_ATTENTION`` variant applies here too, and pools whatever the sharing."""
    forced = envs.cuda_attention()
    if (not forced and q.shape[0] < MMA_FROM_ROWS) or not _simt_fits(q) or _extension() is None:
        return NotImplemented
    references = key_references(window_cache, window_slots, compressed_slots)
    distinct, _, reads = references
    if not forced and reads < MIN_READS_PER_KEY * distinct.numel():
        return NotImplemented
    pool, indices = records_pool(window_cache, window_slots, compressed_cache, compressed_slots, q.shape[-1], q.dtype,
                                 gather=cache_gather, references=references)
    return sparse_attention(q, pool, indices, sink, softmax_scale)


def linear_to_fp32(x, weight):
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return NotImplemented  # cuBLAS's fp32 output takes 16-bit operands of one dtype only
    rows = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
    return rows.reshape(*x.shape[:-1], weight.shape[0])


@hookimpl
def deepinfer_register_ops(registry) -> None:
    if registry.cuda_major("cuda") is None:
        return
    registry.register_backend("linear_to_fp32", "cuda", linear_to_fp32)
    missing = _toolchain_missing()
    if missing:
        registry.mark_unavailable("cuda", f"{missing}; only linear_to_fp32 (cuBLAS) registered")
        return
    registry.register_backend("cache_write", "cuda", cache_write)
    registry.register_backend("sparse_attention", "cuda", sparse_attention)
    registry.register_backend("sparse_attention_records", "cuda", sparse_attention_records)
