"""Ascend 950 backend: registry ops mapped onto torch_npu fused ops (names and arguments from kernels.md §4).

``torch_npu`` is imported inside each call, never at import or discovery, so this module loads on any machine.
It registers only where ``torch.npu`` exists (torch_npu installed and its backend auto-loaded); elsewhere the
registry logs one INFO line. An op without a fused NPU op is not mapped here ("left to the next backend"
below), and neither is a call outside the NPU op's documented limits (dtype, n, D, k), which declines
(``NotImplemented``): the Triton backend runs it where triton-ascend is the installed triton, else the reference
(plain torch, which runs on NPU tensors as is).

Mappings (none has run on Ascend hardware; kernels/ascend/tests check the calls with a fake torch_npu that
computes each op's documented formula). "Documented" = the torch_npu API page (prototype, formula, shapes);
where the op-plugin's own CPU golden was the only source, the line says so.
  * sparse_attention -> npu_sparse_flash_attention, layout TND, key = value = the latent pool, sparse_block_size 1,
    with the softmax LSE returned; the sink (not an NPU argument) is folded in afterwards:
    o = o_nosink * sigmoid(lse - sink), exact for a sink whose value vector is zero.
  * sparse_attention_records (the model's attention over its cache records) -> the keys decoded into a bf16 pool,
    then the sparse_attention mapping. Up to STATIC_POOL_MAX_REFERENCES references (a decode batch) a pool row
    per reference (``records_pool_per_reference``: no host read); above (a prefill, where rows share their keys
    and a row per reference would not fit) each distinct key once (``records_pool``, as the reference does above
    its own row bound; counting them is one device sync).
  * sinkhorn -> npu_mhc_sinkhorn(logits fp32 [T, n, n], eps, num_iters), n in {4, 6, 8}. Documented: the op starts
    with softmax(x, dim=-1) + eps, so it takes the logits, and returns (y, norm_out, sum_out).
  * hc_coefficients -> npu_mhc_pre(x, phi=fn, alpha=scale, bias=base, norm_eps, hc_eps, out_flag=1) then
    npu_mhc_sinkhorn on its h_res. Documented: h_mix = x @ phi^T before the RMS factor (our order),
    h_pre = sigmoid(.) + hc_eps and h_post = 2 sigmoid(.) (our pre/post), h_res = the comb logits without
    Sinkhorn, fn rows ordered pre, post, res; h_pre only exists with out_flag=1; x only bf16/fp16, n in {4, 6, 8},
    D a multiple of 16 up to 16384. Its h_in (the collapse) is dropped: the model collapses each site's streams
    with the pre weights of the previous site (model.py), so hc_collapse is left to the next backend.
  * hc_expand -> npu_mhc_post(x=streams, h_res=comb, h_out=out, h_post=post), documented as
    x' = H_res^T x + h_out (x) h_post (the op-plugin golden sums h_res[i, o] * x[i] over i, our comb[i, o]);
    x and h_out bf16/fp16 of one dtype, result in x's dtype.
  * sqrtsoftplus_route is left to the next backend. npu_moe_gating_top_k scores with softmax (norm_type 0) or
    sigmoid (norm_type 1) only, and no mode takes scores as they are. softmax(log s) = s / sum(s) would need the bias
    divided by a per-token sum, but the op's bias is one [E] vector; sigmoid(logit(s / c)) = s / c holds only up
    to fp32 rounding, which can swap two experts whose biased scores are that close. The router is [T, 256] with
    k = 6: a few torch ops, not worth an inexact selection.
  * indexer_topk -> npu_lightning_indexer, opt-in with DEEPINFER_ASCEND_LIGHTNING_INDEXER=1. Each query is its own
    batch (BSND, S1 = 1) over one paged copy of the key pool (PA_BSND, every block table row naming the pages of
    its own sequence's keys: the same pages for one sequence, a page set per sequence for a batch),
    actual_seq_lengths_key = visible, sparse_mode 0, sparse_count = k; the ids come back [T, 1, 1, k] int32.
    Documented: the formula (our indexer_scores), N1 <= 64, D = 128, key block size a multiple of 16 up to 1024,
    sparse_count <= 2048, per-batch (not cumulative) key lengths for PA_BSND. Not documented, hence opt-in: how a
    tie at the k-th score is broken (we take the lower id) and that the NPU's summation order never moves a
    near-tie; the order of the returned ids and the value of unused slots (third-party goldens say descending
    and -1) are not relied on: ids outside [0, visible) become -1 and the row is sorted ascending. Layers with a
    candidate mask, which the op cannot take, are declined. q and keys are cast to bf16, exact for the
    MXFP4-quantised values the op contract promises (2 mantissa bits).
  * indexer_topk_records -> the keys decoded from their mxfp4 records (``cache_gather``), then the indexer_topk
    mapping above, under the same opt-in: the op takes float keys only (a batch of sequences decodes key_slots
    [B, N], -1 to zero keys that lie past every row's visible entries). A call the mapping would decline is
    declined before the decode.
  * fp8_block_quant / fp8_fake_quant -> npu_dynamic_mx_quant(dst_type E4M3, block 32, round mode "rint",
    scale_alg 1, max_low_bound = our amax floor). Documented: scale_alg 1 takes amax (raised to max_low_bound) /
    448 and rounds its exponent up unless the mantissa is zero, i.e. our power-of-two ceiling, and divides by that
    power of two before a round-to-nearest-even cast: the reference bit for bit. The scales come back as E8M0
    exponent bytes [..., ceil(n/32 / 2), 2], zero-padded to an even count. mxfp4_fake_quant is left to the next
    backend: the FP4 rules (scale_alg 0 and 2) take floor(log2 amax) - 2 or a mantissa-dependent ceiling, not ours.
  * linear_fp8 / linear_fp8_grouped -> npu_grouped_matmul, MX full quantisation (MxA8W8, formula 5 of its page):
    activations by the fp8_block_quant mapping above (E4M3 per token per 32 columns, as DeepGEMM's SM100 path),
    the weight as stored ([G, out/G, in] E4M3 passed transposed, as the page's MXFP8 example), its 32x32 block
    scales repeated to one per row and 32 columns ((G, N, K/64, 2) E8M0 bytes, transposed with the weight),
    group_type 0 (M split) with equal group sizes (group_list_type 1), split_item 2, output in x's dtype. linear_fp8
    is the one-group case, wo_a's grouped projection G groups of its tokens. in_features must be a multiple of 64
    (the scale pairs). The row scales (1/32 of the weight's bytes) are built on the first call and kept on the
    scale tensor until it changes.
  * grouped_fp4_weight_layout -> npu_format_cast(w, 29 (FRACTAL_NZ), customize_dtype=E4M3,
    input_dtype=float4_e2m1fn_x2), the cast every MxA8W4 example of npu_grouped_matmul's page applies to its
    [E, N, K/2] packed weight; the model runs it once after loading and keeps the result as the parameter's data.
  * moe_experts -> three npu_grouped_matmul calls in its MX pseudo-quantisation mode with E4M3 activations
    (MxA8W4, formula 6-2): the (token, slot) assignments sorted by expert on the device, sizes per expert
    (group_list_type 1) with no host read; x rows as E4M3 per 32 columns (the fp8_block_quant mapping); each NZ
    weight passed transposed with its E8M0 row scales (E, N, K/64, 2) transposed (-3, -2), weight_dtype
    float4_e2m1fn_x2, a zero bias (E, N) in x's dtype (the page's dtype table lists no "None" for this mode),
    output in x's dtype; SwiGLU, the router weight and the fp32 combine in ascending expert id as the reference.
    Limits from the page: E > 1, K a multiple of 64 other than 64, bf16 / fp16 x. Assumed, not stated on the
    page: the packed weight's nibble order (an aclnn example puts the even element in the low four bits, as the
    checkpoint does).
  * linear_fp4 is left to the next backend (the model's FP4 weights are the routed experts), and so is
    linear_to_fp32: torch_npu registers no ``mm`` with an ``out_dtype``.
"""

from __future__ import annotations

import torch

from ... import envs
from ..cache import cache_gather
from ..fused import records_pool, records_pool_per_reference
from ..moe import combine_in_expert_order, sort_by_expert
from ..quant import FP8_AMAX_FLOOR
from ..reference import swiglu
from ..registry import hookimpl

HALF_DTYPES = (torch.bfloat16, torch.float16)
MX_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MX_BLOCK = 32
FRACTAL_NZ = 29  # torch_npu's format id for the tiled layout its GEMMs read
MHC_STREAMS = (4, 6, 8)
PAGE_ROWS = 128  # key rows per PA_BSND block: a multiple of 16, at most 1024
STATIC_POOL_MAX_REFERENCES = 65536  # a 64 MiB bf16 pool at D = 512: a decode batch of ~100 rows of 640 keys


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


def sparse_attention_records(q, window_cache, window_slots, compressed_cache, compressed_slots, sink, softmax_scale):
    """The model's attention: the keys decoded into a pool (per reference for a decode batch, per distinct key
    above STATIC_POOL_MAX_REFERENCES), then the npu_sparse_flash_attention mapping above."""
    per_reference = window_slots.numel() + compressed_slots.numel() <= STATIC_POOL_MAX_REFERENCES
    pooling = records_pool_per_reference if per_reference else records_pool
    pool, indices = pooling(window_cache, window_slots, compressed_cache, compressed_slots, q.shape[-1], q.dtype,
                            gather=cache_gather)
    return sparse_attention(q, pool, indices, sink, softmax_scale)


def sinkhorn(logits, iters, eps):
    n = logits.shape[-1]
    if n not in MHC_STREAMS or logits.shape[-2] != n or not 1 <= iters <= 100:
        return NotImplemented
    mixing, _, _ = _npu().npu_mhc_sinkhorn(logits.float().contiguous(), eps=float(eps), num_iters=int(iters))
    return mixing


def hc_coefficients(streams, fn, base, scale, iters, hc_eps, norm_eps):
    _, n_streams, width = streams.shape
    if streams.dtype not in HALF_DTYPES or n_streams not in MHC_STREAMS or width % 16 or width > 16384:
        return NotImplemented
    _, post, comb_logits, _, _, pre = _npu().npu_mhc_pre(
        streams, fn.float(), scale.float(), base.float(), norm_eps=float(norm_eps), hc_eps=float(hc_eps), out_flag=1)
    return pre, post, sinkhorn(comb_logits, iters, hc_eps)


def hc_expand(streams, out, post, comb):
    if streams.dtype not in HALF_DTYPES or out.dtype != streams.dtype:
        return NotImplemented
    return _npu().npu_mhc_post(streams, comb.float(), out, post.float())


def _lightning_indexer_takes(q, n_entries, k, candidates) -> bool:
    """Whether npu_lightning_indexer's documented limits cover the call (and it has something to select)."""
    t, heads, dim = q.shape
    return candidates is None and heads <= 64 and dim == 128 and 1 <= k <= 2048 and t > 0 and n_entries > 0


def indexer_topk(q, head_weights, keys, visible, k, candidates=None):
    if not _lightning_indexer_takes(q, keys.shape[0], k, candidates):
        return NotImplemented
    return _lightning_select(q, head_weights, keys[None], visible, k, [q.shape[0]])


def _lightning_select(q, head_weights, keys, visible, k, query_counts):
    """keys [B, N, dim] of B sequences, the rows of sequence b the next query_counts[b] of q: each sequence's keys
    on pages of their own, each query row's block table naming its sequence's pages."""
    t, _, dim = q.shape
    n_seqs, n_entries = keys.shape[:2]
    n_pages = -(-n_entries // PAGE_ROWS)
    pages = keys.new_zeros(n_seqs, n_pages * PAGE_ROWS, dim, dtype=torch.bfloat16)
    pages[:, :n_entries] = keys
    first_page = torch.repeat_interleave(torch.arange(n_seqs) * n_pages, torch.tensor(query_counts))
    block_table = (first_page[:, None] + torch.arange(n_pages)).to(torch.int32).to(q.device)
    key_lengths = visible.clamp(0, n_entries).to(torch.int32)
    ids, _ = _npu().npu_lightning_indexer(
        q.to(torch.bfloat16).unsqueeze(1).contiguous(), pages.view(n_seqs * n_pages, PAGE_ROWS, 1, dim),
        head_weights.float().unsqueeze(1).contiguous(),
        actual_seq_lengths_query=torch.ones(t, dtype=torch.int32, device=q.device),
        actual_seq_lengths_key=key_lengths, block_table=block_table, layout_query="BSND", layout_key="PA_BSND",
        sparse_count=int(k), sparse_mode=0)
    ids = ids.reshape(t, k).long()
    chosen = (ids >= 0) & (ids < key_lengths[:, None])
    ids = torch.where(chosen, ids, n_entries).sort(dim=-1).values  # unused slots last, whatever the NPU put there
    return torch.where(ids == n_entries, -1, ids)


def indexer_topk_records(q, head_weights, key_records, key_slots, visible, k, candidates=None, query_counts=None):
    if not _lightning_indexer_takes(q, key_slots.shape[-1], k, candidates):
        return NotImplemented
    batch = key_slots if query_counts is not None else key_slots[None]  # [sequences, N]
    keys = cache_gather(key_records, batch, "mxfp4", q.shape[-1], q.dtype)  # slot -1: a zero key
    return _lightning_select(q, head_weights, keys, visible, k, query_counts or [q.shape[0]])


def _e8m0_values(mxscale: torch.Tensor, blocks: int) -> torch.Tensor:
    """MX scales as the NPU ops carry them (E8M0 exponent bytes [..., ceil(blocks / 2), 2], zero-padded to an even
    count) -> fp32 powers of two [..., blocks]."""
    return mxscale.view(torch.uint8).flatten(-2)[..., :blocks].view(torch.float8_e8m0fnu).float()


def _mx_quant_fits(x: torch.Tensor, block: int, multiple: int = MX_BLOCK) -> bool:
    width = x.shape[-1]
    return block == MX_BLOCK and x.dtype in MX_INPUT_DTYPES and width > 0 and width % multiple == 0


def _fp8_mx_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values and their scales in the NPU's MX layout, by our rule: scale_alg 1 takes the scale as
    amax / 448 rounded up to a power of two, after raising amax to max_low_bound (the reference's floor)."""
    return _npu().npu_dynamic_mx_quant(x, axis=-1, round_mode="rint", dst_type=torch.float8_e4m3fn,
                                       block_size=MX_BLOCK, scale_alg=1, max_low_bound=FP8_AMAX_FLOOR)


def fp8_block_quant(x, block=32):
    if not _mx_quant_fits(x, block):
        return NotImplemented
    values, mxscale = _fp8_mx_quant(x)
    return values, _e8m0_values(mxscale, x.shape[-1] // MX_BLOCK)


def fp8_fake_quant(x, block=32):
    quantised = fp8_block_quant(x, block)
    if quantised is NotImplemented:
        return NotImplemented
    values, scale = quantised
    return (values.float().unflatten(-1, (-1, MX_BLOCK)) * scale.unsqueeze(-1)).flatten(-2).to(x.dtype)


def _kept_on(tensor: torch.Tensor, key, build):
    """``build()``, made once per tensor and kept on it until the tensor changes (its version counter moves, or
    its storage: a parameter whose ``.data`` was replaced): a weight's NPU-side companion that every call would
    otherwise rebuild, each step, from the same weight. A copy of the tensor (``.to()``) starts without it."""
    kept = tensor.__dict__.setdefault("_deepinfer_ascend", {})
    state = (tensor._version, tensor.data_ptr())
    built_for, value = kept.get(key, (None, None))
    if built_for != state:
        value = build()
        kept[key] = (state, value)
    return value


def _row_scales(scale: torch.Tensor, out_features: int) -> torch.Tensor:
    """The checkpoint's 32x32 block scales [ceil(out / 32), in / 32] as one scale per row and 32 columns, the
    MX weight layout (exact: a block's rows share its scale): 1/32 of the weight's bytes, kept with the scales."""
    return _kept_on(scale, ("mx_row_scales", out_features),
                    lambda: scale.view(torch.uint8).repeat_interleave(MX_BLOCK, dim=0)[:out_features])


def _mx_grouped_matmul(rows: torch.Tensor, sizes: torch.Tensor, weight: torch.Tensor, **mode) -> torch.Tensor:
    """rows [M, in] sorted by group (sizes [G] int64 rows each) against group g's weight, as one npu_grouped_matmul
    with M split and one output [M, out] in rows' dtype; the activation goes in as E4M3 per 32 columns. ``mode``:
    the weight side's arguments (MxA8W8 or MxA8W4)."""
    npu = _npu()
    values, token_scale = _fp8_mx_quant(rows)
    (y,) = npu.npu_grouped_matmul(
        [values], [weight], per_token_scale=[token_scale], group_list=sizes, group_list_type=1, group_type=0,
        split_item=2, output_dtype=rows.dtype, per_token_scale_dtype=npu.float8_e8m0fnu, **mode)
    return y


def _mx_grouped_fp8(x_rows: torch.Tensor, groups: int, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x_rows [groups * m, in], rows of group g the g-th m; weight E4M3 [out, in] whose g-th of ``groups`` row
    blocks group g multiplies -> [groups * m, out / groups]: MxA8W8 on the stored weight, transposed."""
    out_features, in_features = weight.shape
    rows = out_features // groups
    weight_scale = _row_scales(scale, out_features).view(groups, rows, in_features // (2 * MX_BLOCK), 2)
    sizes = torch.full((groups,), x_rows.shape[0] // groups, dtype=torch.int64, device=x_rows.device)
    return _mx_grouped_matmul(x_rows, sizes, weight.view(groups, rows, in_features).transpose(1, 2),
                              scale=[weight_scale.transpose(1, 2)], scale_dtype=_npu().float8_e8m0fnu)


def _mx_linear_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float8_e4m3fn and x.numel() > 0 and _mx_quant_fits(x, MX_BLOCK, 2 * MX_BLOCK)


def linear_fp8(x, weight, scale):
    if not _mx_linear_fits(x, weight):
        return NotImplemented
    y = _mx_grouped_fp8(x.reshape(-1, x.shape[-1]), 1, weight, scale)
    return y.view(*x.shape[:-1], weight.shape[0])


def linear_fp8_grouped(x, weight, scale):
    if x.dim() != 3 or weight.shape[0] % x.shape[1] or not _mx_linear_fits(x, weight):
        return NotImplemented
    tokens, groups, width = x.shape
    y = _mx_grouped_fp8(x.transpose(0, 1).reshape(groups * tokens, width), groups, weight, scale)
    return y.view(groups, tokens, -1).transpose(0, 1).contiguous()


def grouped_fp4_weight_layout(weight):
    """FRACTAL_NZ, the layout every MxA8W4 example of npu_grouped_matmul's page casts its weight to first."""
    npu = _npu()
    if weight.dtype != torch.int8 or weight.dim() != 3 or npu.get_npu_format(weight) == FRACTAL_NZ:
        return NotImplemented
    return npu.npu_format_cast(weight, FRACTAL_NZ, customize_dtype=torch.float8_e4m3fn,
                               input_dtype=npu.float4_e2m1fn_x2)


def _mx_grouped_fp4(rows, sizes, weight, scale):
    """rows [M, in] sorted by expert (sizes [E] rows each) @ expert e's FP4 weight [E, out, in/2] -> [M, out]:
    MxA8W4 on the weight as laid out (NZ), transposed, with its E8M0 row scales."""
    experts, out_features, packed = weight.shape
    weight_scale = scale.view(torch.uint8).view(experts, out_features, packed // MX_BLOCK, 2)
    no_bias = _kept_on(weight, ("zero_bias", rows.dtype),  # the mode requires one
                       lambda: torch.zeros(experts, out_features, dtype=rows.dtype, device=rows.device))
    return _mx_grouped_matmul(rows, sizes, weight.transpose(-2, -1), bias=[no_bias],
                              antiquant_scale=[weight_scale.transpose(-3, -2)], weight_dtype=_npu().float4_e2m1fn_x2)


def _mx_experts_fit(x, experts) -> bool:
    """The page's MxA8W4 limits: no single-expert stack, K a multiple of 64 other than 64, bf16 / fp16 output;
    and weights already in NZ (``grouped_fp4_weight_layout`` ran after loading)."""
    if not experts.quantised or x.dtype not in HALF_DTYPES or x.shape[0] == 0 or experts.w1.shape[0] < 2:
        return False
    widths = (x.shape[-1], experts.w2.shape[-1] * 2)
    npu = _npu()
    laid_out = all(npu.get_npu_format(w) == FRACTAL_NZ for w in (experts.w1, experts.w3, experts.w2))
    return laid_out and all(width % (2 * MX_BLOCK) == 0 and width != 2 * MX_BLOCK for width in widths)


def moe_experts(x, route_weights, expert_ids, experts, swiglu_limit):
    """The reference's math with each projection one MxA8W4 grouped matmul over the assignments sorted by expert
    (sizes from the device, no host read); the fp32 combine adds each token's experts in ascending expert id."""
    if not _mx_experts_fit(x, experts):
        return NotImplemented
    _, order, bounds = sort_by_expert(expert_ids, experts.w1.shape[0])
    sizes = bounds.diff()
    rows = x[order // expert_ids.shape[1]]
    gate = _mx_grouped_fp4(rows, sizes, experts.w1, experts.w1_scale)
    up = _mx_grouped_fp4(rows, sizes, experts.w3, experts.w3_scale)
    hidden = (swiglu(gate, up, swiglu_limit).float() * route_weights.reshape(-1)[order][:, None]).to(x.dtype)
    down = _mx_grouped_fp4(hidden, sizes, experts.w2, experts.w2_scale)
    return combine_in_expert_order(down, order, expert_ids)


@hookimpl
def deepinfer_register_ops(registry) -> None:
    if not hasattr(torch, "npu"):
        registry.mark_unavailable("ascend", "torch_npu is not loaded (no torch.npu)")
        return
    registry.register_backend("sparse_attention", "ascend", sparse_attention)
    registry.register_backend("sparse_attention_records", "ascend", sparse_attention_records)
    registry.register_backend("sinkhorn", "ascend", sinkhorn)
    registry.register_backend("hc_coefficients", "ascend", hc_coefficients)
    registry.register_backend("hc_expand", "ascend", hc_expand)
    if envs.ascend_lightning_indexer():
        registry.register_backend("indexer_topk", "ascend", indexer_topk)
        registry.register_backend("indexer_topk_records", "ascend", indexer_topk_records)
    registry.register_backend("fp8_block_quant", "ascend", fp8_block_quant)
    registry.register_backend("fp8_fake_quant", "ascend", fp8_fake_quant)
    registry.register_backend("linear_fp8", "ascend", linear_fp8)
    registry.register_backend("linear_fp8_grouped", "ascend", linear_fp8_grouped)
    registry.register_backend("grouped_fp4_weight_layout", "ascend", grouped_fp4_weight_layout)
    registry.register_backend("moe_experts", "ascend", moe_experts)
