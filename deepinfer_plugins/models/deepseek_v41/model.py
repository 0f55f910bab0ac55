"""DeepSeek-V4.1-Flash text model: embedding, 4-stream single-pass mHC blocks, final collapse, fp32 head.

Read top to bottom it is spec §4: every block collapses the residual streams with the pre-mix computed one site
earlier, runs its sublayer, and mixes the result back into the streams. Module and parameter names mirror the
official checkpoint, so ``load_state_dict(strict=True)`` takes it as is.

The forward runs a flattened batch of chunks (one per sequence, each with its own ``SequenceState``): per-token
work (projections, MoE, mHC) sees every row at once, per-sequence work (windows, compressed KV, indexer) loops.
"""

from __future__ import annotations

import torch
from torch import nn

from ... import ops
from .args import ModelArgs
from .attention import Attention
from .engram import Engram, EngramHasher
from .kv_cache import SequenceCache, SequenceChunk
from .moe import MoE
from .norm import RMSNorm


class ImageInputError(ValueError):
    """Image token ids reached the text model; the vision tower is not implemented yet."""


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, dtype: torch.dtype, n_experts: int | None = None,
                 top_k: int | None = None):
        super().__init__()
        self.args, self.layer_id = args, layer_id
        mix_rows, width = (2 + args.hc_mult) * args.hc_mult, args.hc_mult * args.hidden_size
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros(mix_rows, width), requires_grad=False))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(mix_rows), requires_grad=False))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3), requires_grad=False))
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.attn = Attention(args, layer_id, dtype)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.ffn = MoE(args, dtype, n_experts, top_k)
        if layer_id in args.engram_layer_ids:
            self.engram = Engram(args, args.engram_layer_ids.index(layer_id), dtype)

    def coefficients(self, site: str, streams: torch.Tensor):
        return ops.hc_coefficients(
            streams, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
            getattr(self, f"hc_{site}_scale"), self.args.hc_sinkhorn_iters, self.args.hc_eps, self.args.rms_norm_eps)

    def forward(self, streams, pre_mix, engram_ids, chunks: list[SequenceChunk], query_rows: torch.Tensor):
        """streams [rows, S, d], pre_mix [rows, S] -> (streams, pre_mix) of the query rows.

        ``query_rows`` indexes the rows whose outputs the next layer needs (all rows unless bounded replay);
        the other rows only provide this layer's window keys and compressor inputs.
        """
        if hasattr(self, "engram"):
            streams = self.engram(streams, engram_ids[:, self.engram.table])
        attn_in = self.attn_norm(ops.hc_collapse(streams, pre_mix))
        streams = streams[query_rows]
        pre_attn, post_attn, comb_attn = self.coefficients("attn", streams)
        streams = ops.hc_expand(streams, self.attn(attn_in, chunks), post_attn, comb_attn)
        pre_ffn, post_ffn, comb_ffn = self.coefficients("ffn", streams)
        ffn_in = self.ffn_norm(ops.hc_collapse(streams, pre_attn))
        streams = ops.hc_expand(streams, self.ffn(ffn_in), post_ffn, comb_ffn)
        return streams, pre_ffn


class DeepseekV41Model(nn.Module):
    """The V4.1 text model. ``dtype`` is the activation dtype (bf16 in production, fp32 for exact tests)."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.float32, param_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.args, self.dtype = args, dtype
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size,
                                  _weight=torch.empty(args.vocab_size, args.hidden_size, dtype=param_dtype),
                                  _freeze=True)
        self.layers = nn.ModuleList(Block(args, i, param_dtype) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, param_dtype)
        self.head = nn.Module()
        self.head.weight = nn.Parameter(torch.empty(args.vocab_size, args.hidden_size, dtype=param_dtype),
                                        requires_grad=False)
        self.hasher = EngramHasher(args)

    def new_cache(self) -> SequenceCache:
        return SequenceCache(self.args, self.dtype, self.embed.weight.device)

    def query_rows_per_layer(self, num_rows: int, bounded_replay: bool) -> list[int]:
        """Rows whose outputs each layer must produce. Bounded replay needs only the last row's logits, so from
        the last KV-source layer on, layer L must produce 1 + (n_layers - 1 - L) * (window - 1) rows: every
        query row then still finds its whole window among the rows computed by the layer before (exact)."""
        n, w = self.args.num_hidden_layers, self.args.sliding_window
        if not bounded_replay:
            return [num_rows] * n
        return [num_rows if layer < self.args.last_kv_source else min(num_rows, 1 + (n - 1 - layer) * (w - 1))
                for layer in range(n)]

    def check_tokens(self, token_ids: torch.Tensor) -> None:
        if token_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"input_ids must be an integer tensor, got {token_ids.dtype}")
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= self.args.vocab_size):
            raise ValueError(f"input_ids must lie in [0, {self.args.vocab_size}), got "
                             f"[{int(token_ids.min())}, {int(token_ids.max())}]")
        if bool((token_ids == self.args.image_token_id).any()):
            raise ImageInputError(f"input contains image token id {self.args.image_token_id}: image inputs need the "
                                  "vision tower, which DeepInfer does not implement yet")

    def forward_chunks(self, token_ids: torch.Tensor, chunks: list[SequenceChunk],
                       bounded_replay: bool = False) -> torch.Tensor:
        """Run new tokens of several sequences.

        token_ids [rows] is the concatenation of each chunk's tokens (chunk i at rows row_start..). Returns fp32
        logits for every row, or, with ``bounded_replay``, for the last row of each chunk only.
        """
        self.check_tokens(token_ids)
        engram_ids = torch.cat([self.hasher(token_ids[c.row_start: c.row_start + c.num_rows], c.state.ngram_history())
                                for c in chunks]) if self.args.engram_layer_ids else None
        plans = [self.query_rows_per_layer(c.num_rows, bounded_replay) for c in chunks]
        x = self.embed(token_ids).to(self.dtype)
        streams = x[:, None, :].expand(-1, self.args.hc_mult, -1).contiguous()  # [rows, S, d]
        pre_mix = torch.zeros(x.shape[0], self.args.hc_mult, dtype=torch.float32, device=x.device)
        pre_mix[:, 0] = 1.0  # all streams hold the embedding: collapse reads stream 0
        for layer_id, layer in enumerate(self.layers):
            for chunk, plan in zip(chunks, plans):
                chunk.num_query_rows = plan[layer_id]
            query_rows = torch.cat([torch.arange(c.row_start + c.num_rows - c.num_query_rows, c.row_start + c.num_rows)
                                    for c in chunks]).to(x.device)
            streams, pre_mix = layer(streams, pre_mix, engram_ids, chunks, query_rows)
            if engram_ids is not None:
                engram_ids = engram_ids[query_rows]
            row = 0
            for chunk in chunks:
                chunk.start_pos = chunk.first_query_pos
                chunk.row_start, chunk.num_rows = row, chunk.num_query_rows
                row += chunk.num_rows
        h = self.norm(ops.hc_collapse(streams, pre_mix))
        return torch.nn.functional.linear(h.float(), self.head.weight.float())

    def forward(self, input_ids: torch.Tensor, cache: SequenceCache | None = None,
                bounded_replay: bool = False) -> torch.Tensor:
        """One sequence: input_ids [T] or [1, T] -> fp32 logits [T, vocab] ([1, vocab] with bounded replay).

        Without ``cache`` the tokens are a fresh sequence; with one they continue it and it is updated.
        """
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(f"forward takes one sequence; got a batch of {input_ids.shape[0]} "
                                 "(use forward_chunks for several)")
            input_ids = input_ids[0]
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty [T] or [1, T] tensor, got shape {tuple(input_ids.shape)}")
        cache = cache if cache is not None else self.new_cache()
        chunk = SequenceChunk(0, input_ids.numel(), cache.num_tokens, cache)
        logits = self.forward_chunks(input_ids, [chunk], bounded_replay)
        cache.advance(input_ids)
        return logits


class DeepseekV41ForCausalLM(DeepseekV41Model):
    """Entry point users and engines name: the text model plus checkpoint I/O (loader.py)."""

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        **overrides) -> "DeepseekV41ForCausalLM":
        from .loader import load_model

        return load_model(cls, path, dtype=dtype, device=device, **overrides)
