"""One layer of the V4.1 text model: single-pass mHC around attention and MoE.

Its own module because the target model and the drafter's stages (drafter.py) both build on it, and the target
model also builds the drafter: kept in model.py, the two would import each other.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ... import ops
from .args import ModelArgs
from .attention import Attention
from .engram import Engram
from .kv_cache import SequenceChunk
from .moe import MoE
from .norm import RMSNorm


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
        self.reduce_partial = None  # tensor parallelism: sums each rank's partial sublayer output (sharding.py)
        if layer_id in args.engram_layer_ids:
            self.engram = Engram(args, args.engram_layer_ids.index(layer_id), dtype)

    def sublayer_output(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.reduce_partial is None else self.reduce_partial(out)

    def coefficients(self, site: str, streams: torch.Tensor):
        return ops.hc_coefficients(
            streams, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
            getattr(self, f"hc_{site}_scale"), self.args.hc_sinkhorn_iters, self.args.hc_eps, self.args.rms_norm_eps)

    def forward(self, streams, pre_mix, engram_ids, chunks: list[SequenceChunk], query_rows: torch.Tensor | slice,
                image_rows: torch.Tensor | None = None):
        """streams [rows, S, d], pre_mix [rows, S] -> (streams, pre_mix) of the query rows.

        ``query_rows`` indexes the rows whose outputs the next layer needs (all rows unless bounded replay);
        the other rows only provide this layer's window keys and compressor inputs. ``image_rows`` [rows] bool
        marks image-span positions (None: there are none).
        """
        return self.mix(streams, pre_mix, engram_ids, lambda attn_in: self.attn(attn_in, chunks), query_rows,
                        image_rows)

    def mix(self, streams, pre_mix, engram_ids, attend: Callable[[torch.Tensor], torch.Tensor],
            query_rows: torch.Tensor | slice, image_rows: torch.Tensor | None = None):
        """``forward`` with the attention given as ``attend`` (normed input of every row -> output of the query
        rows): an engine that compiles the model passes an opaque op there that does every cache read and write,
        so the rest of the block (mHC, norms, MoE) holds no per-sequence Python and traces into one graph."""
        if hasattr(self, "engram"):
            streams = self.engram(streams, engram_ids[:, self.engram.table], image_rows)
        attn_in = self.attn_norm.of_streams(streams, pre_mix)
        streams = streams[query_rows]
        pre_attn, post_attn, comb_attn = self.coefficients("attn", streams)
        streams = ops.hc_expand(streams, self.sublayer_output(attend(attn_in)), post_attn, comb_attn)
        pre_ffn, post_ffn, comb_ffn = self.coefficients("ffn", streams)
        ffn_in = self.ffn_norm.of_streams(streams, pre_attn)
        ffn_out = self.ffn(ffn_in, None if image_rows is None else image_rows[query_rows])
        streams = ops.hc_expand(streams, self.sublayer_output(ffn_out), post_ffn, comb_ffn)
        return streams, pre_ffn
