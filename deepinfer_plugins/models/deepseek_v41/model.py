"""DeepSeek-V4.1-Flash model: embedding (with image spans), 4-stream single-pass mHC blocks, collapse, fp32 head.

Read top to bottom it is docs/model.md#forward: every block collapses the residual streams with the pre-mix computed
one site earlier, runs its sublayer, and mixes the result back into the streams. Module and parameter names mirror
the official checkpoint, so ``load_state_dict(strict=True)`` takes it as is.

Images enter as span embeddings (``embed_image``) at positions that carry ``image_token_id``; those positions
route with ``bias_vl`` and are dead to Engram (docs/model.md#vision).

The forward runs a flattened batch of chunks (one per sequence, each with its own ``SequenceState``): per-token
work (projections, MoE, mHC) sees every row at once, per-sequence work (windows, compressed KV, indexer) loops.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from ... import ops
from .args import ConfigError, ModelArgs
from .attention import Compressor, store_of
from .block import Block
from .engram import EngramHasher
from .kv_cache import SequenceCache, SequenceChunk
from .linear import Linear
from .moe import RoutedExperts
from .norm import RMSNorm
from .vision import Aligner, VisionTransformer, check_patches, image_span, llm_grid


class ImageInputError(ValueError):
    """Image token ids without their span embeddings, or images for a model built without a vision tower."""


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
        if args.vision is not None:
            self.vision = VisionTransformer(args.vision, param_dtype)
            self.aligner = Aligner(args.vision, args.hidden_size, param_dtype)
            for name in ("image_start", "image_newline", "image_end"):
                self.register_parameter(name, nn.Parameter(torch.empty(args.hidden_size, dtype=param_dtype),
                                                           requires_grad=False))

    @property
    def has_vision(self) -> bool:
        return "vision" in self._modules

    def embed_image(self, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """One preprocessed image (image_processing.py: patches [n_h * n_w, 3, p, p], row-major) -> its whole span
        [rows * (cols + 1) + 2, d] in the activation dtype, delimiters and newlines included: the rows that
        ``input_embeddings`` puts at the image's positions."""
        if not self.has_vision:
            raise ImageInputError("this checkpoint has no vision tower (no vision.* tensors): it serves text only")
        check_patches(patches, n_h, n_w, self.args.vision)
        features = self.vision(patches.to(self.dtype), n_h, n_w)
        rows, cols = llm_grid(n_h, n_w, self.args.vision.downsample_ratio)
        return image_span(self.aligner(features, n_h, n_w), rows, cols, self.image_start, self.image_newline,
                          self.image_end)

    def image_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[rows] bool: the positions inside image spans (every one carries ``image_token_id``)."""
        return token_ids == self.args.image_token_id

    def input_embeddings(self, token_ids: torch.Tensor, image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """token_ids [rows] -> input embeddings [rows, d] in the activation dtype. ``image_embeds`` [n, d] are the
        span rows (``embed_image``) of the n image positions among ``token_ids``, in order: a chunk that starts or
        ends inside a span passes just the rows it covers. Without them the ids are embedded as they are (the
        forward's ``check_tokens`` refuses image ids without embeddings)."""
        x = self.embed(token_ids).to(self.dtype)
        if image_embeds is None:
            return x
        image = self.image_rows(token_ids)
        n_image = int(image.sum())
        if image_embeds.dim() != 2 or image_embeds.shape != (n_image, x.shape[1]):
            raise ImageInputError(f"image_embeds must be [{n_image}, {x.shape[1]}] (one row per image position), "
                                  f"got {tuple(image_embeds.shape)}")
        return x.masked_scatter(image[:, None], image_embeds.to(x.dtype))

    def new_cache(self) -> SequenceCache:
        return SequenceCache(self.args, self.embed.weight.device)

    def query_rows_per_layer(self, num_rows: int, bounded_replay: bool) -> list[int]:
        """Rows whose outputs each layer must produce. Bounded replay needs only the last row's logits, so from
        the last KV-source layer on, layer L must produce 1 + (n_layers - 1 - L) * (window - 1) rows: every
        query row then still finds its whole window among the rows computed by the layer before (exact)."""
        n, w = self.args.num_hidden_layers, self.args.sliding_window
        if not bounded_replay:
            return [num_rows] * n
        return [num_rows if layer < self.args.last_kv_source else min(num_rows, 1 + (n - 1 - layer) * (w - 1))
                for layer in range(n)]

    def check_tokens(self, token_ids: torch.Tensor, with_image_embeds: bool = False) -> None:
        if token_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"input_ids must be an integer tensor, got {token_ids.dtype}")
        if not token_ids.numel():
            return
        # one read on the host for the checks: on a GPU each read waits for the device
        low, high, image = torch.stack((token_ids.min(), token_ids.max(),
                                        (token_ids == self.args.image_token_id).any().to(token_ids.dtype))).tolist()
        if low < 0 or high >= self.args.vocab_size:
            raise ValueError(f"input_ids must lie in [0, {self.args.vocab_size}), got [{low}, {high}]")
        if image and not self.has_vision:
            raise ImageInputError(f"input contains image token id {self.args.image_token_id}, but this checkpoint "
                                  "has no vision tower (no vision.* tensors): it serves text only")
        if image and not with_image_embeds:
            raise ImageInputError(f"input holds image positions (token id {self.args.image_token_id}) but no image "
                                  "embeddings: pass the rows of embed_image for them")

    def forward_chunks(self, token_ids: torch.Tensor, chunks: list[SequenceChunk],
                       bounded_replay: bool = False, capture_layers: tuple[int, ...] = (),
                       image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Run new tokens of several sequences -> fp32 logits (see ``hidden_states``)."""
        return self.compute_logits(self.hidden_states(token_ids, chunks, bounded_replay, capture_layers,
                                                      image_embeds))

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head the logits are computed with: its fp32 copy where ``keep_dense_weights`` made one, else the
        stored weight. The DSpark drafter shares it, so a CPU server does not widen the whole head every draft."""
        dense = getattr(self.head, "dense", None)
        return dense if dense is not None else self.head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [rows, d] -> fp32 logits [rows, vocab] (the head runs in fp32)."""
        return ops.linear_to_fp32(hidden, self.head_weight)

    def finish_loading(self, keep_dense: bool = False) -> "DeepseekV41Model":
        """Every loader calls this once the checkpoint's tensors are in place on their device, and after any
        tensor-parallel split (kept copies are plain attributes, which ``Module.to`` does not move; the routed
        experts take their device's GEMM layout). ``keep_dense``: see ``keep_dense_weights``."""
        for module in self.modules():
            if isinstance(module, Compressor):
                module.round_weight_once(self.dtype)
            elif isinstance(module, RoutedExperts):
                module.lay_out_for_device()
        return self.keep_dense_weights() if keep_dense else self

    def keep_dense_weights(self) -> "DeepseekV41Model":
        """Dequantise every quantised projection once and keep the fp32 head: the CPU decode fast path.
        Costs the dense size of every weight (see linear.py); results are unchanged."""
        for module in self.modules():
            if isinstance(module, (Linear, RoutedExperts)):
                module.keep_dense(self.dtype)
        if self.head.weight.dtype != torch.float32:
            self.head.dense = self.head.weight.float()
        return self

    def hidden_states(self, token_ids: torch.Tensor, chunks: list[SequenceChunk],
                      bounded_replay: bool = False, capture_layers: tuple[int, ...] = (),
                      image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Run new tokens of several sequences -> final normed hidden states.

        token_ids [rows] is the concatenation of each chunk's tokens (chunk i at rows row_start..). Returns
        [rows, d] for every row, or, with ``bounded_replay``, for the last row of each chunk only. For each layer in
        ``capture_layers`` the residual streams entering it are left in ``chunk.published["streams_in"][layer]``
        ([rows of that chunk entering the layer, S, d]; the last rows of the chunk), which is how the DSpark
        drafter receives the target's features without a second forward. ``image_embeds``: the span rows of the
        image positions among ``token_ids``, in order (``input_embeddings``).
        """
        self.check_tokens(token_ids, image_embeds is not None)
        inputs = self.input_embeddings(token_ids, image_embeds)
        image_rows = None if image_embeds is None else self.image_rows(token_ids)
        engram_ids = None
        if self.args.engram_layer_ids:
            histories = store_of(chunks, self.args.sliding_window).ngram_histories(chunks)
            engram_ids = self.hasher(torch.cat([token_ids[c.row_start: c.row_start + c.num_rows] for c in chunks]),
                                     histories, [c.num_rows for c in chunks])
        plans = [self.query_rows_per_layer(c.num_rows, bounded_replay) for c in chunks]
        streams, pre_mix = self.embed_streams(inputs)
        for layer_id, layer in enumerate(self.layers):
            for chunk, plan in zip(chunks, plans):
                chunk.num_query_rows = plan[layer_id]
            query_rows = slice(None) if all(c.num_query_rows == c.num_rows for c in chunks) else torch.cat(
                [torch.arange(c.row_start + c.num_rows - c.num_query_rows, c.row_start + c.num_rows,
                              device=streams.device) for c in chunks])
            if layer_id in capture_layers:
                for c in chunks:
                    c.published.setdefault("streams_in", {})[layer_id] = streams[c.row_start: c.row_start + c.num_rows]
            streams, pre_mix = layer(streams, pre_mix, engram_ids, chunks, query_rows, image_rows)
            if engram_ids is not None:
                engram_ids = engram_ids[query_rows]
            if image_rows is not None:
                image_rows = image_rows[query_rows]
            row = 0
            for chunk in chunks:
                chunk.start_pos = chunk.first_query_pos
                chunk.row_start, chunk.num_rows = row, chunk.num_query_rows
                row += chunk.num_rows
        return self.norm.of_streams(streams, pre_mix)

    def embed_streams(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Input embeddings [rows, d] -> (residual streams [rows, S, d] all holding them, pre-mix [rows, S])."""
        streams = x[:, None, :].expand(-1, self.args.hc_mult, -1).contiguous()  # [rows, S, d]
        pre_mix = torch.zeros(x.shape[0], self.args.hc_mult, dtype=torch.float32, device=x.device)
        pre_mix[:, 0] = 1.0  # all streams hold the embedding: collapse reads stream 0
        return streams, pre_mix

    def opaque_cache_hidden_states(self, token_ids: torch.Tensor, engram_ids: torch.Tensor | None,
                                   attend: Callable[[int, torch.Tensor], torch.Tensor],
                                   inputs_embeds: torch.Tensor | None = None, capture_layers: tuple[int, ...] = ()
                                   ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """``hidden_states`` for engines that compile the model: every row is a query row of every layer (no
        bounded replay), the Engram row ids come precomputed, and ``attend(layer_id, x)`` does a layer's
        attention with all of its cache work behind one opaque op. The body holds no chunk list and no host
        read, so it traces into one graph between those ops; the math is ``Block.mix``. ``inputs_embeds``
        [rows, d]: ``input_embeddings`` of a step with images (computed before the graph, as engines do for
        multimodal inputs); its image positions then route and gate as image tokens.
        -> (final normed hidden states [rows, d], {layer: the residual streams [rows, S, d] entering it} for each
        of ``capture_layers``, as ``hidden_states`` publishes them): the DSpark drafter's features come out of
        the graph as outputs."""
        if inputs_embeds is None:
            inputs_embeds, image_rows = self.embed(token_ids).to(self.dtype), None
        else:
            image_rows = self.image_rows(token_ids)
        streams, pre_mix = self.embed_streams(inputs_embeds)
        captured = {}
        for layer_id, layer in enumerate(self.layers):
            if layer_id in capture_layers:
                captured[layer_id] = streams
            streams, pre_mix = layer.mix(streams, pre_mix, engram_ids, functools.partial(attend, layer_id),
                                         slice(None), image_rows)
        if len(captured) != len(capture_layers):  # e.g. dynamo made the layer ids of a closure symbolic
            raise ValueError(f"captured the streams of {len(captured)} layers, asked for {capture_layers}: pass "
                             "capture_layers as constant ints (a module attribute, as vllm/compiled.py does)")
        return self.norm.of_streams(streams, pre_mix), captured

    def forward(self, input_ids: torch.Tensor, cache: SequenceCache | None = None,
                bounded_replay: bool = False, image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """One sequence: input_ids [T] or [1, T] -> fp32 logits [T, vocab] ([1, vocab] with bounded replay).

        Without ``cache`` the tokens are a fresh sequence; with one they continue it and it is updated.
        ``image_embeds``: span rows of the image positions among ``input_ids`` (see ``input_embeddings``).
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
        logits = self.forward_chunks(input_ids, [chunk], bounded_replay, image_embeds=image_embeds)
        cache.advance(input_ids)
        return logits


class DeepseekV41ForCausalLM(DeepseekV41Model):
    """Entry point users and engines name: the text model plus checkpoint I/O (loader.py), and optionally the
    DSpark drafter stored with it as ``mtp.*`` (drafter.py), built with
    ``with_drafter=True``. It shares ``embed`` and ``head`` with the target."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.float32, param_dtype: torch.dtype = torch.bfloat16,
                 with_drafter: bool = False):
        super().__init__(args, dtype, param_dtype)
        if with_drafter:
            if args.num_nextn_predict_layers < 1:
                raise ConfigError("with_drafter=True but num_nextn_predict_layers is 0: the config describes no "
                                  "DSpark draft stages")
            from .drafter import DSparkDrafter

            self.mtp = DSparkDrafter(args, dtype, param_dtype)

    @property
    def drafter(self):
        """The DSpark drafter (``mtp``), or None when the model was built without it."""
        return self._modules.get("mtp")

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        with_drafter: bool | None = None, tensor_parallel=None,
                        **overrides) -> "DeepseekV41ForCausalLM":
        """Load a checkpoint directory. ``with_drafter``: True builds and loads ``mtp.*`` (every draft tensor
        must be there), False skips them, None (default) builds the drafter iff the checkpoint holds all of it.
        ``tensor_parallel`` (sharding.TensorParallel): build and read only that rank's shard."""
        from .loader import load_model

        return load_model(cls, path, dtype=dtype, device=device, with_drafter=with_drafter,
                          tensor_parallel=tensor_parallel, **overrides)
