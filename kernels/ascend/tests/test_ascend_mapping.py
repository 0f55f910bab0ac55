"""The Ascend backend calls torch_npu the documented way, and its post-processing is exact.

A fake ``torch_npu`` in sys.modules records each call (op name, argument layouts, dtypes, keyword arguments)
and computes the op's documented math with the references; the backend's result must equal the reference op.
Nothing here runs an NPU: what this proves is the call contract as we read the docs, and our own glue math
(the sink fold-in, the softmax before Sinkhorn, the MX dequantisation).
"""

import sys
import types

import pytest
import torch

from deepinfer_plugins import ops
from deepinfer_plugins.ops.backends import ascend_backend


class FakeNpu(types.ModuleType):
    def __init__(self):
        super().__init__("torch_npu")
        self.calls = []

    def npu_sparse_flash_attention(self, query, key, value, *, sparse_indices, scale_value, sparse_block_size,
                                   layout_query, layout_kv, return_softmax_lse):
        self.calls.append(("npu_sparse_flash_attention", query.shape, key.shape, sparse_indices.shape,
                           sparse_indices.dtype, layout_query, layout_kv, sparse_block_size))
        assert key.data_ptr() == value.data_ptr(), "K = V: the latent pool is passed as both"
        idx = sparse_indices[:, 0].long()  # [T, K]
        keys = key[:, 0].float()[idx.clamp(min=0)]  # [T, K, D]
        logits = torch.einsum("thd,tkd->thk", query.float(), keys) * scale_value
        logits = logits.masked_fill((idx < 0)[:, None, :], float("-inf"))
        lse = torch.logsumexp(logits, dim=-1)  # [T, H]
        out = torch.einsum("thk,tkd->thd", torch.softmax(logits, dim=-1), keys)  # NaN rows when nothing is valid
        return out.to(query.dtype), lse

    def npu_mhc_sinkhorn(self, x, *, eps, num_iters):
        self.calls.append(("npu_mhc_sinkhorn", x.shape, x.dtype, eps, num_iters))
        m = x + eps
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
        for _ in range(num_iters - 1):
            m = m / (m.sum(dim=-1, keepdim=True) + eps)
            m = m / (m.sum(dim=-2, keepdim=True) + eps)
        return m

    def npu_dynamic_mx_quant(self, x, *, axis, round_mode, dst_type, block_size):
        self.calls.append(("npu_dynamic_mx_quant", x.shape, axis, round_mode, dst_type, block_size))
        xb = x.float().unflatten(-1, (-1, block_size))
        if dst_type == torch.float8_e4m3fn:
            q, scale = ops.fp8_block_quant.reference(x, block_size)
            return q, scale
        fq = ops.mxfp4_fake_quant.reference(x, block_size).float().unflatten(-1, (-1, block_size))
        scale = ops.quant.pow2_ceil(xb.abs().amax(-1).clamp(min=6 * 2.0**-126) / 6)
        return (fq / scale[..., None]).flatten(-2), scale


@pytest.fixture
def npu(monkeypatch):
    fake = FakeNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake


def test_module_imports_without_torch_npu():
    assert "torch_npu" not in sys.modules or isinstance(sys.modules["torch_npu"], FakeNpu)


def test_sparse_attention_call_and_sink_fold_in(npu):
    g = torch.Generator().manual_seed(0)
    q, pool = torch.randn(3, 8, 64, generator=g), torch.randn(40, 64, generator=g)
    idx = torch.randint(-1, 40, (3, 12), generator=g)
    idx[1] = -1  # empty selection -> zeros
    sink = torch.randn(8, generator=g)
    out = ascend_backend.sparse_attention(q, pool, idx, sink, 0.125)
    name, qs, ks, iss, idt, lq, lkv, blk = npu.calls[-1]
    assert (name, qs, ks, iss, idt, lq, lkv, blk) == (
        "npu_sparse_flash_attention", (3, 8, 64), (40, 1, 64), (3, 1, 12), torch.int32, "TND", "TND", 1)
    torch.testing.assert_close(out, ops.sparse_attention.reference(q, pool, idx, sink, 0.125), atol=1e-5, rtol=1e-5)
    assert (out[1] == 0).all()


def test_sinkhorn_call(npu):
    logits = torch.randn(5, 4, 4)
    out = ascend_backend.sinkhorn(logits, 20, 1e-6)
    assert npu.calls[-1] == ("npu_mhc_sinkhorn", (5, 4, 4), torch.float32, 1e-6, 20)
    torch.testing.assert_close(out, ops.sinkhorn.reference(logits, 20, 1e-6), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name,dst", [("fp8_fake_quant", torch.float8_e4m3fn), ("mxfp4_fake_quant", torch.float4_e2m1fn_x2)])
def test_mx_quant_call_and_dequant(npu, name, dst):
    x = torch.randn(4, 64).bfloat16()
    out = getattr(ascend_backend, name)(x)
    assert npu.calls[-1] == ("npu_dynamic_mx_quant", (4, 64), -1, "rint", dst, 32)
    assert torch.equal(out, getattr(ops, name).reference(x))


def test_registers_nothing_without_torch_npu(monkeypatch):
    monkeypatch.delattr(torch, "npu", raising=False)
    registry = ops.registry
    before = {n: dict(op.backends) for n, op in registry.ops.items()}
    ascend_backend.deepinfer_register_ops(registry)
    assert {n: dict(op.backends) for n, op in registry.ops.items()} == before
