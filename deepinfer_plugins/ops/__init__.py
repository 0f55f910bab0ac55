"""Op registry: every op the model calls, with its PyTorch reference and any registered backends.

Call ops through this module (``ops.sparse_attention(...)``) so the registry picks the backend.
"""

from .quant import (
    dequant_fp4_weight,
    dequant_fp8_rows,
    dequant_fp8_weight,
    fp8_block_quant,
    fp8_fake_quant,
    mxfp4_fake_quant,
    nvfp4_fake_quant,
    quantize_fp4_weight,
    quantize_fp8_rows,
    quantize_fp8_weight,
)
from .reference import (
    bidirectional_attention,
    candidate_mask,
    dense_linear,
    engram_hash,
    hc_coefficients,
    hc_collapse,
    hc_expand,
    indexer_scores,
    rms_norm,
    rope,
    sinkhorn,
    sparse_attention,
    sqrtsoftplus_route,
    swiglu,
    topk_indices,
)
from .registry import OpBackendError, hookimpl, registry

__all__ = [
    "OpBackendError", "bidirectional_attention", "candidate_mask", "dense_linear", "dequant_fp4_weight", "dequant_fp8_rows", "dequant_fp8_weight",
    "engram_hash", "fp8_block_quant", "fp8_fake_quant", "hc_coefficients", "hc_collapse", "hc_expand", "hookimpl",
    "indexer_scores", "mxfp4_fake_quant", "nvfp4_fake_quant", "quantize_fp4_weight", "quantize_fp8_rows",
    "quantize_fp8_weight", "registry", "rms_norm", "rope", "sinkhorn", "sparse_attention", "sqrtsoftplus_route",
    "swiglu", "topk_indices",
]

# Kernel-facing ops: quantised cache records and fused Engram / CSA2 / mHC-collapse + norm steps.
from .cache import CACHE_FORMATS, cache_gather, cache_write, pack_cache_records, record_bytes, unpack_cache_records
from .fused import csa2_compress, engram_gate, engram_gather, hc_collapse_norm, sparse_attention_records

__all__ += [
    "CACHE_FORMATS", "cache_gather", "cache_write", "csa2_compress", "engram_gate", "engram_gather",
    "hc_collapse_norm", "pack_cache_records", "record_bytes", "sparse_attention_records", "unpack_cache_records",
]

# Fused indexer selection (scores + masks + top-k), the op the Ascend lightning indexer maps onto, and both indexer
# ops over the keys' mxfp4 cache records.
from .indexer import indexer_scores_records, indexer_topk, indexer_topk_records

__all__ += ["indexer_scores_records", "indexer_topk", "indexer_topk_records"]

# GEMMs against weights as stored: quantised (DeepGEMM / FlashInfer backends on CUDA) and the fp32-output float
# GEMM of the router and the head.
from .gemm import linear_fp4, linear_fp8, linear_fp8_grouped, linear_to_fp32

__all__ += ["linear_fp4", "linear_fp8", "linear_fp8_grouped", "linear_to_fp32"]

# The routed experts of an MoE layer as one grouped op over stacked expert weights.
from .moe import ExpertWeights, grouped_fp4_weight_layout, moe_experts

__all__ += ["ExpertWeights", "grouped_fp4_weight_layout", "moe_experts"]

# Ops a compiler must not trace into, as torch.library custom ops with fake implementations (opaque.py).
from .opaque import routed_experts

__all__ += ["routed_experts"]
