"""Ascend 950 backend: registry ops mapped onto torch_npu fused ops (names and arguments from kernels.md §4).

``torch_npu`` is imported inside each call, never at import or discovery, so this module loads on any machine.
It registers only where ``torch.npu`` exists (torch_npu installed and its backend auto-loaded); elsewhere the
registry logs one INFO line. Ops without a fused NPU op run the reference, which is plain torch and runs on
NPU tensors as is.

Mappings (none has run on Ascend hardware; kernels/ascend/tests check the calls with a fake torch_npu):
  * sparse_attention -> npu_sparse_flash_attention, layout TND, key = value = the latent pool, sparse_block_size 1,
    with the softmax LSE returned; the sink (not an NPU argument) is folded in afterwards:
    o = o_nosink * sigmoid(lse - sink), exact for a sink whose value vector is zero.
  * sinkhorn -> npu_mhc_sinkhorn on the softmax of the logits (fp32 [T, n, n], n in {4, 6, 8}), num_iters = iters.
  * fp8_fake_quant / mxfp4_fake_quant -> npu_dynamic_mx_quant (block 32, round mode "rint"), opt-in with
    DEEPINFER_ASCEND_MX_QUANT=1 because whether its UE8M0 rule is DeepGEMM's ceil (ours) or OCP's floor is not
    documented; the result is dequantised with the returned scales.
"""

from __future__ import annotations

import os

import torch

from ..registry import hookimpl


def _npu():
    import torch_npu  # noqa: F401  (lazy: needs CANN)

    return torch_npu


def sparse_attention(q, kv_pool, indices, sink, softmax_scale):
    """q [T, H, D]; kv_pool [P, D]; indices [T, K] (-1 unused); sink [H] -> [T, H, D]."""
    npu = _npu()
    t, h, d = q.shape
    kv = kv_pool.to(q.dtype).unsqueeze(1).contiguous()  # [P, 1, D]: TND with one KV head
    sparse = indices.to(torch.int32).unsqueeze(1).contiguous()  # [T, 1, K]: per query, per KV head
    out, lse = npu.npu_sparse_flash_attention(
        q.contiguous(), kv, kv, sparse_indices=sparse, scale_value=float(softmax_scale), sparse_block_size=1,
        layout_query="TND", layout_kv="TND", return_softmax_lse=True)
    lse = lse.float().reshape(t, h)  # natural-log LSE over the selected keys; -inf when none is valid
    keep = torch.sigmoid(lse - sink.float()[None, :])  # share of the probability mass not taken by the sink
    return (out.float().nan_to_num(0.0) * keep[:, :, None]).to(q.dtype)


def sinkhorn(logits, iters, eps):
    npu = _npu()
    m = logits.float().softmax(dim=-1).contiguous()  # [T, n, n]; the NPU op normalises from here
    return npu.npu_mhc_sinkhorn(m, eps=float(eps), num_iters=int(iters))


def _mx_fake_quant(x, block, dst_type):
    npu = _npu()
    if block != 32 or x.shape[-1] % 32:
        raise ValueError(f"npu_dynamic_mx_quant needs block 32 and a width divisible by 32; got {block}, {x.shape[-1]}")
    q, scale = npu.npu_dynamic_mx_quant(x.contiguous(), axis=-1, round_mode="rint", dst_type=dst_type, block_size=32)
    values = q.float().unflatten(-1, (-1, 32))  # [..., n/32, 32]
    return (values * scale.float().unsqueeze(-1)).flatten(-2).to(x.dtype)


def fp8_fake_quant(x, block=32):
    return _mx_fake_quant(x, block, torch.float8_e4m3fn)


def mxfp4_fake_quant(x, block=32):
    return _mx_fake_quant(x, block, torch.float4_e2m1fn_x2)


@hookimpl
def deepinfer_register_ops(registry) -> None:
    if not hasattr(torch, "npu"):
        registry.mark_unavailable("ascend", "torch_npu is not loaded (no torch.npu)")
        return
    registry.register_backend("sparse_attention", "ascend", sparse_attention)
    registry.register_backend("sinkhorn", "ascend", sinkhorn)
    if os.environ.get("DEEPINFER_ASCEND_MX_QUANT") == "1":
        registry.register_backend("fp8_fake_quant", "ascend", fp8_fake_quant)
        registry.register_backend("mxfp4_fake_quant", "ascend", mxfp4_fake_quant)
