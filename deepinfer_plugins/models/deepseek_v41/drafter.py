"""The DSpark drafter of V4.1, as the checkpoint stores it under ``mtp.0..N-1`` (spec dspark §1, V4.1 §10).

Not autoregressive MTP: the N stages are N full blocks run once per round over a block of B slots in parallel.

  features  the residual streams entering target layers ``dspark_target_layer_ids`` (captured by the target's
            forward), each reduced over the 4 streams (``dspark_feature_reduction``, "mean" per vLLM), concat
            -> mtp.0.main_proj [d <- L*d] (FP8) -> mtp.0.main_norm -> context C [n, d], one row per position
  context   every stage keeps its own window of context keys: its wkv / kv_norm / RoPE / FP8 applied to C
            (``DraftState``, grows by the accepted positions of every verify forward)
  block     slot 0 = embed(anchor), slots 1..B-1 = embed(dspark_noise_token_id), at positions p..p+B-1 where p
            is the anchor's position (the context holds positions < p: the anchor itself has not been through
            the target yet); 4 streams, one-hot pre-mix, like the target's input
  stages    Block (single-pass mHC, attn_norm / ffn_norm, MoE with dspark_n_routed_experts, top
            dspark_num_experts_per_tok, same router); attention is SWA-only (ratio 0, main RoPE) with queries
            from the slots over keys = [the ``sliding_window`` context keys before p ; the B slots' own keys],
            non-causal inside the block, sink as usual
  output    h = collapse with the last stage's FFN pre-mix (no hc_head); U = head(mtp.{N-1}.norm(h)) in fp32 with
            the TARGET's head; slot k: logits = U_k + markov.head(markov.embed(x_{k-1})), x_0 = anchor,
            sequential over slots; confidence logit_k = confidence_head.proj([h_k ; markov.embed(x_{k-1})]) fp32

Uncertain facts (docs/dspark.md): the stream reduction (mean), which hidden feeds the confidence head (pre-norm
here, as the spec says for V4.1), and the absence of a confidence bias. Every per-layer computation is the
target model's own module (Block, Attention's projections, MoE, ops); only the key set of the draft attention
differs, which is ``DraftAttention.forward``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ... import ops
from ...ops.cache import record_bytes
from .args import ModelArgs
from .attention import Attention, one_table
from .block import Block
from .kv_cache import COMPRESSED_FORMAT, WINDOW_FORMAT, RollbackError, SequenceChunk, WindowRing, key_positions
from .linear import Linear
from .norm import RMSNorm
from .sampling import processed_probs


class DraftState:
    """One sequence's drafter state: per stage, a ring of context keys by position, for positions < num_tokens,
    stored as fp8_window records like the target's window (each stage has its own FP8 cache:
    docs/model.md#checkpoint-names-and-formats).

    num_tokens is the number of positions whose target features have been appended, so the next block's slot
    0 (the anchor) sits at position num_tokens. ``max_rollback`` extra ring rows let ``rollback`` forget that
    many positions and still hold a full window.
    """

    def __init__(self, args: ModelArgs, num_stages: int, device: torch.device | str = "cpu", max_rollback: int = 0):
        self.window, self.max_rollback = args.sliding_window, max_rollback
        shape = (args.sliding_window + max_rollback, record_bytes(WINDOW_FORMAT, args.head_dim))
        self.rings = [WindowRing(torch.zeros(shape, dtype=torch.uint8, device=device), f"mtp.{s} context",
                                 WINDOW_FORMAT) for s in range(num_stages)]
        self.num_tokens = 0

    def context_records(self, stage: int, end: int) -> torch.Tensor:
        """The stage's context-key records of the ``sliding_window`` positions before ``end`` -> uint8
        [<= window, record bytes]."""
        return self.rings[stage].read(max(0, end - self.window), end)

    def rollback(self, num_tokens: int) -> None:
        """Forget the features of positions >= num_tokens."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise RollbackError(f"draft rollback to {num_tokens} positions: the state holds {self.num_tokens}")
        if self.num_tokens - num_tokens > self.max_rollback:
            raise RollbackError(f"draft rollback of {self.num_tokens - num_tokens} positions exceeds "
                                f"max_rollback={self.max_rollback}")
        for ring in self.rings:
            ring.rollback(num_tokens)
        self.num_tokens = num_tokens


class DraftAttention(Attention):
    """SWA-only attention of a draft stage: slot queries over [context window keys ; all B slot keys]."""

    def forward(self, x: torch.Tensor, chunks: list[SequenceChunk]) -> torch.Tensor:
        """x [rows, d] normed inputs of the slots of every chunk (chunk.state a DraftState, chunk.start_pos the
        anchor position) -> [rows, d]. Projections and the attention run once for every chunk, as in the target."""
        slots = torch.cat([x[chunk.row_start: chunk.row_start + chunk.num_rows] for chunk in chunks])
        return self.forward_all_rows(slots, key_positions(chunks, x.device),
                                     lambda q, q_latent, latents: self.attend_context(q, latents, chunks))

    def attend_context(self, q: torch.Tensor, latents: torch.Tensor, chunks: list[SequenceChunk]) -> torch.Tensor:
        """What ``forward`` does between the projections: the slots' queries q [rows, heads, head_dim] over each
        chunk's context keys and its slots' own keys (``latents`` [rows, head_dim], FP8-packed here) -> o, still
        rotated. Its own method so that a compiling engine makes only this opaque (vllm/compiled.py)."""
        stage = self.layer_id - self.args.num_hidden_layers
        blocks = ops.pack_cache_records(latents, WINDOW_FORMAT)  # the B slots' keys
        batch = getattr(chunks[0].state, "batch_context", None)
        if batch is not None:  # engines: every row's context read at once
            keys, indices = batch.draft_keys(stage, blocks, chunks)
        else:
            keys, indices = self.per_sequence_keys(stage, blocks, chunks)
        no_entries = torch.empty(0, record_bytes(COMPRESSED_FORMAT, self.head_dim), dtype=torch.uint8,
                                 device=q.device)
        return ops.sparse_attention_records(q, keys, indices, no_entries, indices[:, :0], self.attn_sink,
                                            self.softmax_scale)

    @staticmethod
    def per_sequence_keys(stage: int, blocks: torch.Tensor,
                          chunks: list[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's [context window keys ; its block's keys] (``DraftState``s), merged by ``one_table``:
        -> (record table, indices [rows, keys], every query row of a chunk seeing all of its keys)."""
        parts = []
        for chunk, block in zip(chunks, blocks.split([chunk.num_rows for chunk in chunks])):
            context = chunk.state.context_records(stage, chunk.start_pos)  # [<= window, record bytes]
            keys = torch.cat((context.to(block.device), block))
            parts.append((keys, torch.arange(keys.shape[0], device=block.device).expand(chunk.num_rows, -1)))
        return one_table(parts)


class MarkovHead(nn.Module):
    """Low-rank bigram bias: B(prev, ·) = head(embed[prev]), embed [vocab, rank], head [vocab <- rank]."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype):
        super().__init__()
        vocab, rank = args.vocab_size, args.dspark_markov_rank
        self.embed = nn.Embedding(vocab, rank, _weight=torch.empty(vocab, rank, dtype=dtype), _freeze=True)
        self.head = Linear(rank, vocab, dtype=dtype)

    def forward(self, prev_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev_tokens [n] -> (logit bias [n, vocab] fp32, Markov embedding [n, rank] fp32)."""
        e = self.embed(prev_tokens).float()
        return self.head(e), e


class ConfidenceHead(nn.Module):
    """Conditional acceptance logit of slot k from [h_k ; markov.embed(x_{k-1})] (fp32, no bias in the checkpoint)."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype):
        super().__init__()
        self.proj = Linear(args.hidden_size + args.dspark_markov_rank, 1, dtype=dtype)

    def forward(self, hidden: torch.Tensor, markov_embedding: torch.Tensor) -> torch.Tensor:
        """hidden [n, d], markov_embedding [n, rank] -> logits [n]."""
        return self.proj(torch.cat((hidden.float(), markov_embedding.float()), dim=-1)).squeeze(-1)


class DraftStage(Block):
    """A full block at config layer id num_hidden_layers + stage; stage 0 also owns the context combiner, the
    last stage the output heads (names as in the checkpoint)."""

    def __init__(self, args: ModelArgs, stage: int, dtype: torch.dtype):
        layer_id = args.num_hidden_layers + stage
        super().__init__(args, layer_id, dtype, args.dspark_n_routed_experts, args.dspark_num_experts_per_tok)
        self.attn = DraftAttention(args, layer_id, dtype)
        d = args.hidden_size
        if stage == 0:
            self.main_proj = Linear(len(args.dspark_target_layer_ids) * d, d, "fp8")
            self.main_norm = RMSNorm(d, args.rms_norm_eps, dtype)
        if stage == args.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(d, args.rms_norm_eps, dtype)
            self.markov_head = MarkovHead(args, dtype)
            self.confidence_head = ConfidenceHead(args, dtype)


@dataclass
class DraftBlock:
    """One drafted block per sequence.

    tokens            int64 [R, B]      x_1..x_B
    confidence_logits fp32  [R, B]      raw head logits (calibrate with calibration.apply_sts)
    confidences       fp32  [R, B]      sigmoid of the raw logits: conditional c_k
    draft_probs       fp32  [R, B, V]   the distributions x_k were sampled from, None for greedy drafts
    """

    tokens: torch.Tensor
    confidence_logits: torch.Tensor
    confidences: torch.Tensor
    draft_probs: torch.Tensor | None


class DSparkDrafter(nn.ModuleList):
    """``mtp``: the draft stages. Embedding and LM head are the target's (passed in, never copied)."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.float32, param_dtype: torch.dtype = torch.bfloat16):
        if args.num_nextn_predict_layers < 1:
            raise ValueError("num_nextn_predict_layers is 0: this checkpoint has no DSpark draft stages")
        super().__init__(DraftStage(args, s, param_dtype) for s in range(args.num_nextn_predict_layers))
        self.args, self.dtype = args, dtype
        self.block_size = args.dspark_block_size

    def new_state(self, max_rollback: int = 0, device: torch.device | str | None = None) -> DraftState:
        device = device if device is not None else self[0].attn_norm.weight.device
        return DraftState(self.args, len(self), device, max_rollback)

    # ---- context -----------------------------------------------------------------------------------------
    def reduce_streams(self, streams: torch.Tensor) -> torch.Tensor:
        """Residual streams [n, S, d] entering a target layer -> one feature row per position [n, d]."""
        how = self.args.dspark_feature_reduction
        if how == "mean":
            return streams.float().mean(dim=1).to(self.dtype)
        if how == "sum":
            return streams.float().sum(dim=1).to(self.dtype)
        return streams[:, 0].to(self.dtype)  # "stream0"

    def context(self, streams_in: dict[int, torch.Tensor]) -> torch.Tensor:
        """Target streams entering each of ``dspark_target_layer_ids`` ({layer: [n_l, S, d]}, e.g. a chunk's
        ``published["streams_in"]``) -> context C [n, d] for the last n = min n_l positions."""
        layers = self.args.dspark_target_layer_ids
        missing = [layer for layer in layers if layer not in streams_in]
        if missing:
            raise KeyError(f"target features of layers {missing} missing: run the target with "
                           f"capture_layers={tuple(layers)}")
        n = min(streams_in[layer].shape[0] for layer in layers)
        features = torch.cat([self.reduce_streams(streams_in[layer][-n:]) for layer in layers], dim=-1)  # [n, L*d]
        return self[0].main_norm(self[0].main_proj(features))

    def add_context(self, state: DraftState, context: torch.Tensor, start_pos: int) -> None:
        """Append C [n, d] of positions start_pos.. to the state; anything already at or after start_pos is
        replaced (a rollback), and a gap before start_pos is allowed (prefill may capture only its last rows)."""
        if start_pos < state.num_tokens:
            state.rollback(start_pos)
        positions = start_pos + torch.arange(context.shape[0], device=context.device)
        for stage, ring in zip(self, state.rings):
            ring.write(stage.attn.window_latents(context.to(self.dtype), positions), start_pos)
        state.num_tokens = start_pos + context.shape[0]

    # ---- drafting ----------------------------------------------------------------------------------------
    def hidden(self, embed: nn.Embedding, anchors: torch.Tensor, states: list[DraftState]) -> torch.Tensor:
        """Block-parallel backbone: anchors [R] -> pre-norm collapsed hidden [R, B, d] (slot k predicts x_{k+1})."""
        chunks = self.block_chunks(states)
        return self.block_hidden(embed, anchors, lambda stage, attn_in: self[stage].attn(attn_in, chunks))

    def block_chunks(self, states: list[DraftState]) -> list[SequenceChunk]:
        """One chunk per row of a block: row r's B slots at rows r * B.., from its anchor position on."""
        b = self.block_size
        return [SequenceChunk(r * b, b, state.num_tokens, state) for r, state in enumerate(states)]

    def block_hidden(self, embed: nn.Embedding, anchors: torch.Tensor,
                     attend: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``hidden`` with each stage's attention given as ``attend(stage, normed input of every slot)``: an
        engine that compiles the drafter passes one whose context reads are an opaque op, so the rest (mHC,
        norms, MoE) holds no per-sequence Python. The math is ``Block.mix``."""
        rows, b = anchors.shape[0], self.block_size
        tokens = torch.full((rows, b), self.args.dspark_noise_token_id, dtype=torch.long, device=anchors.device)
        tokens[:, 0] = anchors
        x = embed(tokens.flatten()).to(self.dtype)  # [R * B, d]
        streams = x[:, None, :].expand(-1, self.args.hc_mult, -1).contiguous()  # [R * B, S, d]
        pre_mix = torch.zeros(x.shape[0], self.args.hc_mult, dtype=torch.float32, device=x.device)
        pre_mix[:, 0] = 1.0
        for index, stage in enumerate(self):
            streams, pre_mix = stage.mix(streams, pre_mix, None, functools.partial(attend, index), slice(None))
        return ops.hc_collapse(streams, pre_mix).unflatten(0, (rows, b))

    def markov_drafts(self, h: torch.Tensor, head_weight: torch.Tensor, anchors: torch.Tensor,
                      pick: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
                      ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The Markov stage over the backbone's hidden h [R, B, d]: slot k conditions on the token drafted at
        k - 1, ``pick(logits [R, V]) -> (tokens [R], the distribution sampled from or None)``.
        -> (tokens [R, B], confidence logits [R, B], the distributions picked from)."""
        last = self[-1]
        base = ops.linear_to_fp32(last.norm(h), head_weight)  # [R, B, V] fp32
        prev = anchors.long()
        tokens, conf_logits, probs = [], [], []
        for k in range(self.block_size):
            bias, markov_embedding = last.markov_head(prev)
            logits = base[:, k] + bias  # [R, V]
            # The target refuses image placeholder ids in text input, so a draft must never propose one; q below
            # is the masked distribution actually sampled from, which keeps verification lossless.
            logits[:, self.args.image_token_id] = float("-inf")
            conf_logits.append(last.confidence_head(h[:, k], markov_embedding))
            prev, q = pick(logits)
            if q is not None:
                probs.append(q)
            tokens.append(prev)
        return torch.stack(tokens, dim=1), torch.stack(conf_logits, dim=1), probs

    def greedy_drafts(self, h: torch.Tensor, head_weight: torch.Tensor,
                      anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``markov_drafts`` picking the argmax -> (tokens [R, B], confidence logits [R, B])."""
        tokens, conf_logits, _ = self.markov_drafts(h, head_weight, anchors, lambda logits: (logits.argmax(-1), None))
        return tokens, conf_logits

    @torch.inference_mode()
    def propose(self, embed: nn.Embedding, head_weight: torch.Tensor, anchors: torch.Tensor,
                states: list[DraftState], temperature=0.0, top_k=0, top_p=1.0, greedy_draft: bool | None = None,
                generator: torch.Generator | None = None) -> DraftBlock:
        """Draft one block per sequence. anchors [R] (the last committed token of each sequence, at position
        states[r].num_tokens); sampling settings are scalars or [R]. Drafts are sampled from the processed
        (temperature / top-k / top-p) Markov-corrected distribution, or greedy (argmax, draft_probs None) when
        ``greedy_draft`` (default: when every temperature is 0)."""
        if anchors.dim() != 1 or anchors.shape[0] != len(states):
            raise ValueError(f"anchors must be [R] with one DraftState per row; got {list(anchors.shape)} and "
                             f"{len(states)} states")
        if greedy_draft is None:
            greedy_draft = bool((torch.as_tensor(temperature) == 0).all())
        h = self.hidden(embed, anchors, states)  # [R, B, d]
        if greedy_draft:
            tokens, conf = self.greedy_drafts(h, head_weight, anchors)
            probs = None
        else:
            def sample(logits):
                q = processed_probs(logits, temperature, top_k, top_p)
                return torch.multinomial(q, 1, generator=generator).squeeze(-1), q

            tokens, conf, sampled_from = self.markov_drafts(h, head_weight, anchors, sample)
            probs = torch.stack(sampled_from, dim=1)
        return DraftBlock(tokens=tokens, confidence_logits=conf, confidences=torch.sigmoid(conf), draft_probs=probs)
