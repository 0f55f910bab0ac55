"""The Ascend backend calls torch_npu the documented way, and its post-processing is exact.

A fake ``torch_npu`` in sys.modules records each call (op name, argument layouts, dtypes, keyword arguments)
and computes the op's documented formula (written out here, or with a reference where the doc defines the op
as that math); the backend's result must equal the reference op. Nothing here runs an NPU: what this proves is
the call contract as we read the docs, and our own glue (the sink fold-in, the mHC output selection, the
indexer's paging and its order- and fill-independent post-processing, the records decode in front of it, the MX
dequantisation). Where a fact is not documented (the lightning indexer's tie rule, its unused-slot value), the
fake states the assumption and the tests show which results depend on it.
"""

import math
import os
import sys
import types

import pytest
import torch
from torch.overrides import TorchFunctionMode

from deepinfer_plugins import ops
from deepinfer_plugins.ops.backends import ascend_backend
from deepinfer_plugins.ops.quant import quantize_fp8_weight
from integration_tests.host_reads import HOST_READS, PACKAGE, ModuleCalls
from tests.ops.gemm_support import (ACTIVATION_FP8_REL_TOL, MOE_FP8_REL_TOL, OUTPUT_ROUNDING_REL_TOL,
                                    fp8_activation_linear, moe_with_e4m3_activations, rel_err, routing,
                                    stacked_fp4_experts)


ND, FRACTAL_NZ = 2, 29  # torch_npu's format ids


class FakeNpu(types.ModuleType):
    def __init__(self):
        super().__init__("torch_npu")
        self.calls = []
        self.unused_slot = -1  # what the lightning indexer leaves in slots past the visible entries
        self.shuffle_output = False  # whether it returns its ids in some order other than by score
        self.float8_e8m0fnu = object()  # torch_npu's own dtype names: E8M0 bytes, two E2M1 codes per byte
        self.float4_e2m1fn_x2 = object()
        self.formats = {}  # storage -> format id of the tensors npu_format_cast made

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
        m = torch.softmax(x, dim=-1) + eps  # documented first step: the op takes the logits
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
        for _ in range(num_iters - 1):
            m = m / (m.sum(dim=-1, keepdim=True) + eps)
            m = m / (m.sum(dim=-2, keepdim=True) + eps)
        return m, torch.empty(0), torch.empty(0)  # norm_out and sum_out are only filled with out_flag=1

    def npu_mhc_pre(self, x, phi, alpha, bias, *, gamma=None, norm_eps=1e-6, hc_eps=1e-6, out_flag=0):
        self.calls.append(("npu_mhc_pre", x.shape, x.dtype, phi.shape, phi.dtype, alpha.shape, bias.shape, gamma,
                           norm_eps, hc_eps, out_flag))
        assert x.dtype in (torch.bfloat16, torch.float16) and phi.dtype == alpha.dtype == bias.dtype == torch.float32
        t, n, d = x.shape
        flat = x.reshape(t, n * d).float()
        inv_rms = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
        h_mix = torch.nn.functional.linear(flat, phi)
        h_pre, h_post, h_res = (h_mix * inv_rms).split([n, n, n * n], dim=-1)
        h_pre = torch.sigmoid(h_pre * alpha[0] + bias[:n]) + hc_eps
        h_post = 2 * torch.sigmoid(h_post * alpha[1] + bias[n:2 * n])
        h_res = (h_res * alpha[2] + bias[2 * n:]).unflatten(-1, (n, n))
        h_in = (h_pre[:, :, None] * flat.unflatten(-1, (n, d))).sum(1).to(x.dtype)
        if not out_flag:
            return h_in, h_post, h_res, torch.empty(0), torch.empty(0), torch.empty(0)
        return h_in, h_post, h_res, inv_rms[:, 0], h_mix, h_pre

    def npu_mhc_post(self, x, h_res, h_out, h_post):
        self.calls.append(("npu_mhc_post", x.shape, x.dtype, h_res.shape, h_res.dtype, h_out.shape, h_out.dtype,
                           h_post.shape, h_post.dtype))
        assert x.dtype == h_out.dtype and h_res.dtype == h_post.dtype == torch.float32
        mixed = (h_res[..., None] * x.float()[..., None, :]).sum(dim=-3)  # sum_i h_res[i, o] * x[i]
        return (h_post[..., None] * h_out.float()[..., None, :] + mixed).to(x.dtype)

    def npu_lightning_indexer(self, query, key, weights, *, actual_seq_lengths_query, actual_seq_lengths_key,
                              block_table, layout_query, layout_key, sparse_count, sparse_mode):
        self.calls.append(dict(query=(query.shape, query.dtype), key=(key.shape, key.dtype),
                               weights=(weights.shape, weights.dtype),
                               block_table=(block_table.shape, block_table.dtype),
                               actual_seq_lengths_query=actual_seq_lengths_query.tolist(),
                               actual_seq_lengths_key=(actual_seq_lengths_key.tolist(), actual_seq_lengths_key.dtype),
                               layout_query=layout_query, layout_key=layout_key, sparse_count=sparse_count,
                               sparse_mode=sparse_mode))
        batch, s1, heads, dim = query.shape
        out = torch.full((batch, s1, 1, sparse_count), self.unused_slot, dtype=torch.int32)
        for b in range(batch):
            length = int(actual_seq_lengths_key[b])
            rows = key[block_table[b].long()].reshape(-1, dim)[:length].float()  # this batch's pages, in order
            dots = torch.einsum("hd,nd->hn", query[b, 0].float(), rows).relu()
            scores = (weights[b, 0].float()[:, None] * dots).sum(0)
            order = scores.sort(descending=True, stable=True).indices[:sparse_count]  # ties: lower id first
            if self.shuffle_output:
                order = order[torch.randperm(order.numel(), generator=torch.Generator().manual_seed(b))]
            out[b, 0, 0, :order.numel()] = order.to(torch.int32)
        return out, torch.empty(0)

    def npu_dynamic_mx_quant(self, x, *, axis, round_mode, dst_type, block_size, scale_alg=0, dst_type_max=0.0,
                             max_low_bound=0.0):
        """The page's scale_alg 1 (FP8 targets): S = max(amax, max_low_bound) / 448, its exponent rounded up
        unless the mantissa is zero, values cast (rint) after multiplying by 1 / 2^E; scales as exponent bytes
        [..., ceil(blocks / 2), 2], zero-padded."""
        self.calls.append(("npu_dynamic_mx_quant", x.shape, x.dtype, axis, round_mode, dst_type, block_size,
                           scale_alg, max_low_bound))
        assert scale_alg == 1 and dst_type == torch.float8_e4m3fn and round_mode == "rint" and axis == -1
        assert max_low_bound > 0 and x.shape[-1] % block_size == 0
        blocks = x.float().unflatten(-1, (-1, block_size))
        s = blocks.abs().amax(-1).clamp(min=max_low_bound) / 448.0
        mantissa, exponent = torch.frexp(s)  # s = mantissa * 2^exponent, mantissa in [0.5, 1)
        unbiased = exponent - 1 + (mantissa > 0.5).to(exponent.dtype)
        values = (blocks * torch.ldexp(torch.ones_like(s), -unbiased)[..., None]).to(torch.float8_e4m3fn)
        count = s.shape[-1]
        codes = torch.zeros(*s.shape[:-1], count + count % 2, dtype=torch.uint8)
        codes[..., :count] = (unbiased + 127).to(torch.uint8)
        return values.flatten(-2), codes.unflatten(-1, (-1, 2))

    def get_npu_format(self, tensor):
        return self.formats.get(tensor.untyped_storage().data_ptr(), ND)

    def npu_format_cast(self, tensor, acl_format, *, customize_dtype, input_dtype):
        """A copy whose storage the fake remembers as NZ; the values stay as they are."""
        self.calls.append(("npu_format_cast", tensor.shape, tensor.dtype, acl_format, customize_dtype, input_dtype))
        assert acl_format == FRACTAL_NZ and customize_dtype == torch.float8_e4m3fn
        assert input_dtype is self.float4_e2m1fn_x2 and tensor.dtype == torch.int8
        cast = tensor.clone()
        self.formats[cast.untyped_storage().data_ptr()] = FRACTAL_NZ
        return cast

    def npu_grouped_matmul(self, x, weight, *, per_token_scale, group_list, group_list_type, group_type,
                           split_item, output_dtype, per_token_scale_dtype, scale=None, scale_dtype=None,
                           antiquant_scale=None, weight_dtype=None, bias=None):
        """Formula 5 (MX full quantisation, MxA8W8) or 6-2 (MX pseudo-quantisation, MxA8W4) with the page's
        layouts: x [M, K] E4M3, per_token_scale (M, K/64, 2), group sizes per group (group_list_type 1), one
        output [M, N]. MxA8W8: weight [E, K, N] a transposed view of [E, N, K] E4M3, scale (E, K/64, N, 2) a
        transposed view of (E, N, K/64, 2). MxA8W4: weight a transposed view of the NZ-cast [E, N, K/2] FP4
        codes (even element in the low four bits), antiquant_scale (E, K/64, N, 2) a transposed view of
        (E, N, K/64, 2), no scale, a bias (E, N) in the output dtype (required: the dtype table has no None for
        it); MxA8W8 takes no bias. E8M0 scales as bytes."""
        (x,), (weight,), (token_scale,) = x, weight, per_token_scale
        mx_fp4 = weight_dtype is not None
        (weight_scale,) = antiquant_scale if mx_fp4 else scale
        self.calls.append(dict(x=(x.shape, x.dtype), weight=(weight.shape, weight.dtype, weight.stride()),
                               token_scale=token_scale.shape, group_list=group_list.tolist(),
                               output_dtype=output_dtype, mode="MxA8W4" if mx_fp4 else "MxA8W8", bias=bias))
        assert x.dtype == torch.float8_e4m3fn and x.dim() == 2 and x.is_contiguous()
        stored = weight.transpose(1, 2)
        assert stored.is_contiguous()
        if mx_fp4:
            assert weight_dtype is self.float4_e2m1fn_x2 and scale is None and scale_dtype is None
            assert weight.dtype == torch.int8 and self.get_npu_format(weight) == FRACTAL_NZ
            assert output_dtype in (torch.bfloat16, torch.float16) and stored.shape[0] > 1 and len(bias) == 1
            (bias,) = bias
            assert bias.shape == stored.shape[:2] and bias.dtype == output_dtype
            codes = stored.view(torch.uint8)
            codes = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)  # [E, N, K]
            grid = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0), dtype=torch.float64)
            values = grid[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0).double()
        else:
            assert weight.dtype == torch.float8_e4m3fn and scale_dtype is self.float8_e8m0fnu and bias is None
            assert output_dtype in (torch.bfloat16, torch.float16, torch.float32)
            values = stored.double()
        (groups, n, k), m = values.shape, x.shape[0]
        assert k == x.shape[1] and k % 64 == 0
        assert weight_scale.shape == (groups, k // 64, n, 2) and weight_scale.transpose(1, 2).is_contiguous()
        assert token_scale.shape == (m, k // 64, 2) and weight_scale.dtype == token_scale.dtype == torch.uint8
        assert per_token_scale_dtype is self.float8_e8m0fnu
        assert group_list.dtype == torch.int64 and group_list.shape == (groups,) and group_list_type == 1
        assert group_type == 0 and split_item in (2, 3)
        decode = lambda codes: torch.pow(2.0, codes.double() - 127)  # noqa: E731
        x_scale = decode(token_scale.flatten(-2)).repeat_interleave(32, -1)  # [M, K]
        w_scale = decode(weight_scale.transpose(1, 2).flatten(-2)).repeat_interleave(32, -1)  # [E, N, K]
        out, start = torch.empty(m, n, dtype=torch.float64), 0
        for group, size in enumerate(group_list.tolist()):
            rows = slice(start, start + size)
            out[rows] = (x[rows].double() * x_scale[rows]) @ (values[group] * w_scale[group]).t()
            if bias is not None:
                out[rows] += bias[group].double()
            start += size
        assert start == m
        return [out.to(output_dtype)]


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


class PackageHostReads(TorchFunctionMode):
    """Host reads made by any of the package's code, its ops included (not by the fake torch_npu)."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS and sys._getframe(1).f_code.co_filename.startswith(str(PACKAGE)):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("per_reference", [True, False])
def test_records_attention_pools_the_keys_then_calls_the_npu_op(npu, monkeypatch, per_reference):
    """A decode-sized batch pools a row per reference and reads nothing on the host; above the bound (a prefill)
    each distinct key is decoded once, which costs one sync. Both give the reference's attention."""
    g = torch.Generator().manual_seed(5)
    window = ops.pack_cache_records(torch.randn(40, 64, generator=g), "fp8_window")
    compressed = ops.pack_cache_records(torch.randn(90, 64, generator=g), "nvfp4")
    window_slots = (torch.arange(6)[:, None] + torch.arange(16)[None, :]) % 40
    window_slots[:, :3] = -1
    compressed_slots = torch.randint(0, 90, (6, 24), generator=g)
    compressed_slots[::3, -4:] = -1
    q, sink = torch.randn(6, 8, 64, generator=g), torch.randn(8, generator=g)
    args = (q, window, window_slots, compressed, compressed_slots, sink, 0.125)
    if not per_reference:
        monkeypatch.setattr(ascend_backend, "STATIC_POOL_MAX_REFERENCES", 6 * 40 - 1)
    watch = PackageHostReads()
    with watch:
        got = ascend_backend.sparse_attention_records(*args)
    distinct = torch.unique(torch.cat((window_slots, compressed_slots + 40 * (compressed_slots >= 0)), 1))
    pool_rows = 6 * 40 if per_reference else (distinct >= 0).sum()
    assert npu.calls[-1][0] == "npu_sparse_flash_attention" and npu.calls[-1][2][0] == pool_rows
    assert (watch.reads == []) is per_reference, watch.reads
    torch.testing.assert_close(got, ops.sparse_attention_records.reference(*args), atol=1e-5, rtol=1e-5)


def test_sinkhorn_call(npu):
    logits = torch.randn(5, 4, 4)
    out = ascend_backend.sinkhorn(logits, 20, 1e-6)
    assert npu.calls[-1] == ("npu_mhc_sinkhorn", (5, 4, 4), torch.float32, 1e-6, 20)
    torch.testing.assert_close(out, ops.sinkhorn.reference(logits, 20, 1e-6), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("shape,iters", [((5, 5, 5), 20), ((5, 4, 6), 20), ((5, 4, 4), 101)])
def test_sinkhorn_outside_the_op_limits_is_declined(npu, shape, iters):
    logits = torch.randn(shape)
    assert ascend_backend.sinkhorn(logits, iters, 1e-6) is NotImplemented
    assert npu.calls == []


def mhc_site(t=5, n=4, d=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    streams = torch.randn(t, n, d, generator=g).to(dtype)
    fn = torch.randn((2 + n) * n, n * d, generator=g) * 0.05
    base, scale = torch.randn((2 + n) * n, generator=g), torch.rand(3, generator=g) + 0.5
    return streams, fn, base, scale


@pytest.mark.parametrize("n", [4, 8])
def test_hc_coefficients_call_and_result(npu, n):
    streams, fn, base, scale = mhc_site(n=n)
    pre, post, comb = ascend_backend.hc_coefficients(streams, fn, base, scale, 20, 1e-6, 1e-20)
    assert npu.calls[0] == ("npu_mhc_pre", (5, n, 64), torch.bfloat16, ((2 + n) * n, n * 64), torch.float32, (3,),
                            ((2 + n) * n,), None, 1e-20, 1e-6, 1)
    assert npu.calls[1] == ("npu_mhc_sinkhorn", (5, n, n), torch.float32, 1e-6, 20)
    want = ops.hc_coefficients.reference(streams, fn, base, scale, 20, 1e-6, 1e-20)
    for got, ref in zip((pre, post, comb), want, strict=True):
        assert got.dtype == torch.float32 and got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("t,n,d,dtype", [(5, 4, 64, torch.float32), (5, 3, 64, torch.bfloat16),
                                         (5, 4, 40, torch.bfloat16), (2, 4, 16400, torch.bfloat16)])
def test_hc_coefficients_outside_the_op_limits_is_declined(npu, t, n, d, dtype):
    streams, fn, base, scale = mhc_site(t, n, d, dtype)
    assert ascend_backend.hc_coefficients(streams, fn, base, scale, 20, 1e-6, 1e-20) is NotImplemented
    assert npu.calls == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hc_expand_call_and_result(npu, dtype):
    g = torch.Generator().manual_seed(1)
    streams, out = torch.randn(6, 4, 32, generator=g).to(dtype), torch.randn(6, 32, generator=g).to(dtype)
    post = 2 * torch.rand(6, 4, generator=g)
    comb = ops.sinkhorn.reference(torch.randn(6, 4, 4, generator=g), 20, 1e-6)
    got = ascend_backend.hc_expand(streams, out, post, comb)
    assert npu.calls[-1] == ("npu_mhc_post", (6, 4, 32), dtype, (6, 4, 4), torch.float32, (6, 32), dtype,
                             (6, 4), torch.float32)
    want = ops.hc_expand.reference(streams, out, post, comb)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=0)


def test_hc_expand_mixes_streams_by_comb_columns(npu):
    """comb[i, o] weighs input stream i into output stream o: a transposed comb must give another result."""
    streams = torch.arange(4.0).repeat_interleave(16).view(1, 4, 16).bfloat16()  # stream i holds the value i
    comb = torch.zeros(1, 4, 4)
    comb[0, 3, 0] = 1.0  # output 0 takes input 3
    got = ascend_backend.hc_expand(streams, torch.zeros(1, 16).bfloat16(), torch.zeros(1, 4), comb)
    assert (got[0, 0] == 3).all() and (got[0, 3] == 0).all()


@pytest.mark.parametrize("streams_dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_hc_expand_outside_the_op_limits_is_declined(npu, streams_dtype, out_dtype):
    streams, out = torch.randn(3, 4, 16).to(streams_dtype), torch.randn(3, 16).to(out_dtype)
    post, comb = torch.rand(3, 4), torch.rand(3, 4, 4)
    assert ascend_backend.hc_expand(streams, out, post, comb) is NotImplemented
    assert npu.calls == []


def indexer_case(t=6, heads=8, n=300, seed=0):
    """MXFP4 queries and keys (the op's contract) with duplicated keys, so that scores tie exactly."""
    g = torch.Generator().manual_seed(seed)
    q = ops.mxfp4_fake_quant.reference(torch.randn(t, heads, 128, generator=g))
    keys = ops.mxfp4_fake_quant.reference(torch.randn(n, 128, generator=g))
    keys[[9, 40, 200]] = keys[5].clone()  # four entries with one score per query
    keys[250:] = keys[100].clone()
    weights = torch.randn(t, heads, generator=g)
    visible = torch.tensor([0, 3, 60, 299, 300, 350])[:t]  # none, fewer than k, a partial page, all, past the end
    return q, weights, keys, visible


@pytest.mark.parametrize("unused_slot,shuffle", [(-1, False), (10**6, False), (-1, True)])
def test_indexer_topk_call_and_result(npu, unused_slot, shuffle):
    npu.unused_slot, npu.shuffle_output = unused_slot, shuffle
    q, weights, keys, visible = indexer_case()
    got = ascend_backend.indexer_topk(q, weights, keys, visible, 16)
    call = npu.calls[-1]
    assert call["query"] == ((6, 1, 8, 128), torch.bfloat16)
    assert call["key"] == ((3, 128, 1, 128), torch.bfloat16)
    assert call["weights"] == ((6, 1, 8), torch.float32)
    assert call["block_table"] == ((6, 3), torch.int32)
    assert call["actual_seq_lengths_query"] == [1] * 6
    assert call["actual_seq_lengths_key"] == ([0, 3, 60, 299, 300, 300], torch.int32)
    assert (call["layout_query"], call["layout_key"], call["sparse_count"], call["sparse_mode"]) == (
        "BSND", "PA_BSND", 16, 0)
    want = ops.indexer_topk.reference(q, weights, keys, visible, 16)
    assert torch.equal(got, want)
    assert (got[0] == -1).all() and (got[1, 3:] == -1).all() and got[1, :3].tolist() == [0, 1, 2]


def test_indexer_topk_keeps_the_lower_id_of_a_tie(npu):
    q, weights, keys, _ = indexer_case(t=1)
    q, weights = q.abs(), weights.abs()  # positive scores for any key with a positive entry
    keys = keys[0].abs().expand(300, 128).clone()  # one score for every entry ...
    keys[:3] = 0  # ... but entries 0-2, which score 0
    ids = ascend_backend.indexer_topk(q, weights, keys, torch.tensor([300]), 4)
    assert ids.tolist() == [[3, 4, 5, 6]]
    assert torch.equal(ids, ops.indexer_topk.reference(q, weights, keys, torch.tensor([300]), 4))


@pytest.mark.parametrize("heads,dim,k,with_candidates", [(8, 128, 16, True), (72, 128, 16, False),
                                                         (8, 64, 16, False), (8, 128, 3072, False)])
def test_indexer_topk_outside_the_op_limits_is_declined(npu, heads, dim, k, with_candidates):
    g = torch.Generator().manual_seed(3)
    q = ops.mxfp4_fake_quant.reference(torch.randn(4, heads, dim, generator=g))
    keys = ops.mxfp4_fake_quant.reference(torch.randn(40, dim, generator=g))
    weights, visible = torch.randn(4, heads, generator=g), torch.tensor([0, 5, 20, 40])
    candidates = torch.rand(4, 40, generator=g) > 0.5 if with_candidates else None
    assert ascend_backend.indexer_topk(q, weights, keys, visible, k, candidates) is NotImplemented
    assert npu.calls == []


def in_record_rows(keys, seed=0):
    """keys [N, 128] as mxfp4 records at shuffled rows of wider engine rows (a row-strided view) -> (records, slots)."""
    g = torch.Generator().manual_seed(seed)
    records = ops.pack_cache_records.reference(keys, "mxfp4")
    table = torch.randint(0, 256, (keys.shape[0] + 7, 100), generator=g, dtype=torch.uint8)
    slots = torch.randperm(keys.shape[0] + 7, generator=g)[: keys.shape[0]]
    table[slots, :68] = records
    return table[:, :68], slots


def test_indexer_topk_records_decodes_then_calls_the_lightning_indexer(npu):
    """The records op hands the lightning indexer the decoded keys, in entry order, as the float op does."""
    q, weights, keys, visible = indexer_case()
    records, slots = in_record_rows(keys)
    got = ascend_backend.indexer_topk_records(q, weights, records, slots, visible, 16)
    call = npu.calls[-1]
    assert call["key"] == ((3, 128, 1, 128), torch.bfloat16)
    assert call["actual_seq_lengths_key"] == ([0, 3, 60, 299, 300, 300], torch.int32)
    assert len(npu.calls) == 1
    assert torch.equal(got, ops.indexer_topk_records.reference(q, weights, records, slots, visible, 16))
    assert torch.equal(got, ascend_backend.indexer_topk(q, weights, keys, visible, 16))


def test_indexer_topk_records_of_a_batch_gives_each_row_its_sequence_pages(npu):
    """Three sequences in one call (the model's batched indexer): every query row's block table names the pages
    of its own sequence, and the ids equal the reference's on each sequence's own keys."""
    q, weights, keys, _ = indexer_case()
    records, slots = in_record_rows(keys)
    key_slots = torch.full((3, 300), -1)
    key_slots[0, :300], key_slots[1, :40], key_slots[2, :170] = slots, slots[200:240], slots[:170]
    counts, visible = [2, 1, 3], torch.tensor([300, 120, 40, 0, 100, 170])
    got = ascend_backend.indexer_topk_records(q, weights, records, key_slots, visible, 16, None, counts)
    call = npu.calls[-1]
    assert call["key"] == ((9, 128, 1, 128), torch.bfloat16) and call["block_table"] == ((6, 3), torch.int32)
    assert torch.equal(got, ops.indexer_topk_records.reference(q, weights, records, key_slots, visible, 16, None,
                                                               counts))
    assert torch.equal(got[2:3], ops.indexer_topk_records.reference(q[2:3], weights[2:3], records, slots[200:240],
                                                                    visible[2:3], 16))


@pytest.mark.parametrize("heads,n,k,with_candidates", [(8, 40, 16, True), (72, 40, 16, False), (8, 0, 16, False),
                                                       (8, 40, 3072, False)])
def test_indexer_topk_records_outside_the_op_limits_is_declined(npu, heads, n, k, with_candidates):
    g = torch.Generator().manual_seed(4)
    q = ops.mxfp4_fake_quant.reference(torch.randn(4, heads, 128, generator=g))
    records, slots = in_record_rows(torch.randn(n, 128, generator=g))
    weights, visible = torch.randn(4, heads, generator=g), torch.tensor([0, 5, 20, 40])
    candidates = torch.rand(4, n, generator=g) > 0.5 if with_candidates else None
    assert ascend_backend.indexer_topk_records(q, weights, records, slots, visible, k, candidates) is NotImplemented
    assert npu.calls == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("width", [32, 96, 512])
def test_fp8_quant_is_the_reference_bit_for_bit(npu, dtype, width):
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    x = (torch.randn(6, width, generator=g) * torch.logspace(-6, 4, 6)[:, None]).to(dtype)
    x[0, :32] = 0  # an all-zero block takes the floor's scale
    values, scale = ascend_backend.fp8_block_quant(x)
    want_values, want_scale = ops.fp8_block_quant.reference(x)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8)) and torch.equal(scale, want_scale)
    assert torch.equal(ascend_backend.fp8_fake_quant(x), ops.fp8_fake_quant.reference(x))
    assert npu.calls[-1][-2:] == (1, ops.quant.FP8_AMAX_FLOOR)


@pytest.mark.parametrize("x, block", [(torch.randn(4, 64), 16), (torch.randn(4, 48), 32), (torch.randn(4, 0), 32),
                                      (torch.randn(4, 16), 32), (torch.ones(4, 64, dtype=torch.float64), 32)])
def test_fp8_quant_outside_the_op_limits_is_declined(npu, x, block):
    assert ascend_backend.fp8_block_quant(x, block) is NotImplemented
    assert ascend_backend.fp8_fake_quant(x, block) is NotImplemented
    assert npu.calls == []


def _mx_linear_expectations(x, weight, scale):
    """(the reference, the same product with the activation as the NPU quantises it): the weight side is exact,
    so the second differs from the backend only by output rounding."""
    dense = ops.dequant_fp8_weight(weight, scale, torch.float64)
    return ops.linear_fp8.reference(x, weight, scale), ops.fp8_fake_quant.reference(x.double()) @ dense.t()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lead, out_features, in_features", [((3,), 96, 128), ((2, 5), 80, 192), ((1,), 40, 64)])
def test_linear_fp8_is_one_mx_grouped_matmul_on_the_stored_weight(npu, dtype, lead, out_features, in_features):
    g = torch.Generator().manual_seed(7)
    weight, scale = quantize_fp8_weight(torch.randn(out_features, in_features, generator=g))
    x = torch.randn(*lead, in_features, generator=g).to(dtype)
    y = ascend_backend.linear_fp8(x, weight, scale)
    reference, same_quantised = _mx_linear_expectations(x, weight, scale)
    assert y.shape == reference.shape and y.dtype == dtype
    assert rel_err(y, same_quantised) <= OUTPUT_ROUNDING_REL_TOL[dtype]
    assert rel_err(y, reference) <= ACTIVATION_FP8_REL_TOL
    call = npu.calls[-1]
    assert call["weight"][0] == (1, in_features, out_features) and call["group_list"] == [math.prod(lead)]


@pytest.mark.parametrize("tokens, groups, rows, in_features", [(1, 8, 64, 128), (5, 3, 40, 64), (17, 2, 32, 192)])
def test_linear_fp8_grouped_is_the_block_diagonal_product(npu, tokens, groups, rows, in_features):
    g = torch.Generator().manual_seed(tokens)
    weight, scale = quantize_fp8_weight(torch.randn(groups * rows, in_features, generator=g))
    x = torch.randn(tokens, groups, in_features, generator=g).bfloat16()
    y = ascend_backend.linear_fp8_grouped(x, weight, scale)
    reference = ops.linear_fp8_grouped.reference(x, weight, scale)
    dense = ops.dequant_fp8_weight(weight, scale, torch.float64).unflatten(0, (groups, rows))
    same_quantised = torch.einsum("ngi,goi->ngo", ops.fp8_fake_quant.reference(x.double()), dense)
    assert y.shape == reference.shape == (tokens, groups, rows) and y.is_contiguous()
    assert rel_err(y, same_quantised) <= OUTPUT_ROUNDING_REL_TOL[torch.bfloat16]
    assert rel_err(y, reference) <= ACTIVATION_FP8_REL_TOL
    assert npu.calls[-1]["group_list"] == [tokens] * groups


def test_weight_companions_are_built_once_and_follow_the_weight(npu):
    """The MxA8W8 row scales and the MxA8W4 zero biases are kept with their weight: the second call builds neither
    (no torch call left but the activations' own), and a weight changed in place, or given new storage, gets new
    ones."""
    g = torch.Generator().manual_seed(3)
    weight, scale = quantize_fp8_weight(torch.randn(96, 128, generator=g))
    x = torch.randn(4, 128, generator=g).bfloat16()
    calls = []
    for _ in range(2):
        watch = ModuleCalls(ascend_backend)
        with watch:
            first = ascend_backend.linear_fp8(x, weight, scale)
        calls.append(watch.calls)
    assert calls[1] < calls[0]
    doubled = scale.float().mul(2).to(scale.dtype)
    scale.copy_(doubled)  # in place: the kept row scales must follow
    torch.testing.assert_close(ascend_backend.linear_fp8(x, weight, scale).float(), 2 * first.float())
    scale.data = scale.data.float().mul(2).to(scale.dtype)  # new storage
    torch.testing.assert_close(ascend_backend.linear_fp8(x, weight, scale).float(), 4 * first.float())

    experts = _laid_out(npu, stacked_fp4_experts(8, 128, 128))
    route_weights, ids = routing(3, 8, 2)
    ascend_backend.moe_experts(x[:3], route_weights, ids, experts, None)
    biases = [call["bias"][0] for call in npu.calls if isinstance(call, dict) and call.get("mode") == "MxA8W4"]
    ascend_backend.moe_experts(x[:3], route_weights, ids, experts, None)
    again = [call["bias"][0] for call in npu.calls if isinstance(call, dict) and call.get("mode") == "MxA8W4"]
    assert len(biases) == 3 and len(again) == 6 and all(a is b for a, b in zip(biases, again[3:]))
    assert all(torch.count_nonzero(b) == 0 for b in biases)


@pytest.mark.parametrize("x, weight_dtype", [(torch.randn(3, 96), torch.float8_e4m3fn),  # in not a multiple of 64
                                             (torch.randn(0, 128), torch.float8_e4m3fn),  # no tokens
                                             (torch.randn(3, 128), torch.bfloat16)])
def test_linear_fp8_outside_the_op_limits_is_declined(npu, x, weight_dtype):
    weight, scale = torch.zeros(64, x.shape[-1], dtype=weight_dtype), torch.zeros(2, x.shape[-1] // 32)
    assert ascend_backend.linear_fp8(x, weight, scale) is NotImplemented
    assert ascend_backend.linear_fp8_grouped(x.unsqueeze(1).expand(-1, 2, -1), weight, scale) is NotImplemented
    assert ascend_backend.linear_fp8_grouped(x, weight, scale) is NotImplemented  # not [n, G, in]
    assert npu.calls == []


def _laid_out(npu, experts):
    """The experts as the model holds them on an NPU after loading: each FP4 stack cast to NZ."""
    stacks = {kind: ascend_backend.grouped_fp4_weight_layout(getattr(experts, kind)) for kind in ("w1", "w3", "w2")}
    assert all(npu.get_npu_format(stack) == FRACTAL_NZ for stack in stacks.values())
    return experts._replace(**stacks)


@pytest.mark.parametrize("tokens, top_k, only", [(7, 3, None), (1, 6, None), (40, 2, 1)])
def test_moe_experts_are_the_reference_with_e4m3_activations(npu, tokens, top_k, only):
    experts = _laid_out(npu, stacked_fp4_experts(8, 256, 128))
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens)).bfloat16()
    route_weights, ids = routing(tokens, 8, top_k, only=only)
    y = ascend_backend.moe_experts(x, route_weights, ids, experts, 4.0)
    assert [call["mode"] for call in npu.calls if isinstance(call, dict)] == ["MxA8W4"] * 3
    assert y.dtype == torch.float32 and y.shape == (tokens, 256)
    emulated = moe_with_e4m3_activations(x, route_weights, ids, experts, 4.0)
    torch.testing.assert_close(y, emulated, rtol=0, atol=1e-6 * emulated.abs().max().item())
    assert rel_err(y, ops.moe_experts.reference(x, route_weights, ids, experts, 4.0)) < MOE_FP8_REL_TOL


def test_moe_experts_read_nothing_on_the_host_whatever_the_routing(npu):
    """A host read would wait for the router: the torch work queued is the same for 1 token, 40 spread out, or 40
    sharing an expert."""
    experts = _laid_out(npu, stacked_fp4_experts(8, 128, 128))
    ascend_backend.moe_experts(torch.randn(2, 128).bfloat16(), *routing(2, 8, 2), experts, None)  # zero biases kept
    counts = []
    for tokens, only in ((1, None), (40, None), (40, 3)):
        route_weights, ids = routing(tokens, 8, 2, only=only)
        watch = ModuleCalls(ascend_backend)
        with watch:
            ascend_backend.moe_experts(torch.randn(tokens, 128).bfloat16(), route_weights, ids, experts, None)
        assert watch.host_reads == []
        counts.append(watch.calls)
    assert len(set(counts)) == 1, counts


def test_the_layout_is_cast_once(npu):
    stack = torch.zeros(2, 64, 64, dtype=torch.int8)
    cast = ascend_backend.grouped_fp4_weight_layout(stack)
    assert ascend_backend.grouped_fp4_weight_layout(cast) is NotImplemented  # already NZ: the reference keeps it
    assert ascend_backend.grouped_fp4_weight_layout(torch.zeros(64, 64, dtype=torch.int8)) is NotImplemented
    assert [call[0] for call in npu.calls] == ["npu_format_cast"]


@pytest.mark.parametrize("case", ["not laid out", "fp32 activations", "one expert", "width 64", "float experts",
                                  "no tokens"])
def test_moe_experts_outside_the_op_limits_are_declined(npu, case):
    dim = 64 if case == "width 64" else 128
    experts = stacked_fp4_experts(1 if case == "one expert" else 4, dim, 128)
    if case != "not laid out":
        experts = _laid_out(npu, experts)
    if case == "float experts":
        experts = ops.ExpertWeights(torch.zeros(4, 128, dim), None, torch.zeros(4, 128, dim), None,
                                    torch.zeros(4, dim, 128), None)
    x = torch.randn(0 if case == "no tokens" else 3, dim).to(torch.float32 if case == "fp32 activations"
                                                             else torch.bfloat16)
    route_weights, ids = routing(x.shape[0], experts.w1.shape[0], 1)
    calls = len(npu.calls)
    assert ascend_backend.moe_experts(x, route_weights, ids, experts, None) is NotImplemented
    assert len(npu.calls) == calls


def test_the_model_calls_every_npu_mapping_and_its_gemms_are_the_fp8_activation_products(monkeypatch, tmp_path):
    """The tiny model (widened so that its experts fit MxA8W4) runs a prefill and a decode step through every
    Ascend mapping it can use. Its logits equal those of the same run with the three GEMM ops replaced by the
    reference on E4M3-rounded activations: the GEMM mappings get the model's real arguments. (The other mappings
    are checked op by op above: against the reference the random tiny model amplifies any rounding difference
    through its FP8 fake-quant steps; hc_expand's summation order alone moves its logits by 9%.)"""
    from deepinfer_plugins.models.deepseek_v41 import DeepseekV41ForCausalLM
    from deepinfer_plugins.models.deepseek_v41.checkpoint import write_random_checkpoint
    from deepinfer_plugins.ops.registry import DEVICE_PREFERENCE

    npu = FakeNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", npu)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(), raising=False)
    ops.registry.discover()
    for op in ops.registry.ops.values():
        monkeypatch.setattr(op, "backends", dict(op.backends))
    ascend_backend.deepinfer_register_ops(ops.registry)

    def fp8_rows(linear):
        return lambda x, *w: linear.reference(ops.fp8_fake_quant.reference(x), *w) if x.shape[-1] % 64 == 0 \
            else NotImplemented

    emulated = {"linear_fp8": fp8_rows(ops.linear_fp8), "linear_fp8_grouped": fp8_rows(ops.linear_fp8_grouped),
                "moe_experts": lambda x, w, ids, experts, limit: ops.moe.experts_one_by_one(
                    x, w, ids, experts, limit, fp8_activation_linear)}
    for name, fn in emulated.items():
        ops.registry.ops[name].backends["emulated"] = fn
    monkeypatch.setitem(DEVICE_PREFERENCE, "cpu", ("ascend",))  # the CPU tensors stand in for NPU ones
    path = write_random_checkpoint(tmp_path, "tiny-vocab256", seed=0, hidden_size=128, moe_intermediate_size=128)
    model = DeepseekV41ForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ids = torch.randint(3, 250, (12,), generator=torch.Generator().manual_seed(0))

    def prefill_and_decode():
        with torch.inference_mode():
            cache = model.new_cache()
            return model(ids[:11], cache), model(ids[11:], cache)

    on_npu = prefill_and_decode()
    called = {call[0] if isinstance(call, tuple) else call["mode"] for call in npu.calls}
    assert {"npu_sparse_flash_attention", "npu_mhc_pre", "npu_mhc_sinkhorn", "npu_mhc_post", "npu_dynamic_mx_quant",
            "npu_format_cast", "MxA8W8", "MxA8W4"} <= called
    monkeypatch.setitem(DEVICE_PREFERENCE, "cpu", ("emulated", "ascend"))
    for got, want in zip(on_npu, prefill_and_decode(), strict=True):
        assert rel_err(got, want) < 1e-3


class RecordingRegistry:
    def __init__(self):
        self.registered = {}

    def register_backend(self, op_name, backend, fn):
        self.registered[op_name] = (backend, fn)

    def mark_unavailable(self, backend, reason):
        raise AssertionError(f"torch.npu exists, yet {backend} was marked unavailable: {reason}")


@pytest.mark.parametrize("env,opt_in", [
    ({}, set()),
    ({"DEEPINFER_ASCEND_LIGHTNING_INDEXER": "1"}, {"indexer_topk", "indexer_topk_records"}),
])
def test_registers_the_documented_mappings_and_opt_ins(monkeypatch, env, opt_in):
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(), raising=False)
    monkeypatch.delenv("DEEPINFER_ASCEND_LIGHTNING_INDEXER", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    registry = RecordingRegistry()
    ascend_backend.deepinfer_register_ops(registry)
    default = {"sparse_attention", "sparse_attention_records", "sinkhorn", "hc_coefficients", "hc_expand",
               "fp8_block_quant", "fp8_fake_quant", "linear_fp8", "linear_fp8_grouped", "grouped_fp4_weight_layout",
               "moe_experts"}
    assert set(registry.registered) == default | opt_in
    assert all(backend == "ascend" and fn is getattr(ascend_backend, name)
               for name, (backend, fn) in registry.registered.items())
    assert set(registry.registered) <= set(ops.registry.ops)  # every name is a real op


def test_registers_nothing_without_torch_npu(monkeypatch):
    monkeypatch.delattr(torch, "npu", raising=False)
    registry = ops.registry
    before = {n: dict(op.backends) for n, op in registry.ops.items()}
    ascend_backend.deepinfer_register_ops(registry)
    assert {n: dict(op.backends) for n, op in registry.ops.items()} == before
