"""vLLM model class for DeepSeek-V4.1: maps vLLM's flattened batch and paged caches onto the core model.

Nothing here computes model math: the forward builds one ``SequenceChunk`` per request (rows, start position,
a ``PagedSequenceState`` over vLLM's caches), once per step and eagerly, then runs ``CompiledBody``
(compiled.py), which vLLM compiles: the core model's layers with each layer's cache work in an opaque op that
runs the core's attention over those chunks. Weight names are the official checkpoint names under ``model.``;
quantised tensors are loaded as stored (see models/.../linear.py).

Tensor parallelism: every rank builds its shard of each block (attention heads by output group, every expert's
width; models/deepseek_v41/sharding.py) before loading, the core loader keeps only the rank's part of each split
tensor vLLM streams, and vLLM's all-reduce sums the partial sublayer outputs. The caches are replicated (one latent
KV head).

DSpark speculation (spec_decode.py): when the speculative config names ``DeepInferDSparkProposer`` (or a subclass),
the model also builds the drafter (``mtp.*`` weights), owns one more paged cache (the draft context) and, after
the compiled body (which returns the residual streams entering ``dspark_target_layer_ids``), turns those streams
into every draft stage's context keys and writes them at each token's slot. ``last_step`` keeps the per-row block
table of that cache, so the proposer (which vLLM gives no request ids and no hidden states) finds each row's
context. The drafter's block backbone is a second compiled module, ``CompiledDrafter``, under its own compile tag.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from torch import nn
from vllm.compilation.backends import set_model_tag
from vllm.model_executor.models.interfaces import SupportsMultiModal
from vllm.multimodal import MULTIMODAL_REGISTRY

from .. import envs
from ..models.deepseek_v41.args import ModelArgs
from ..models.deepseek_v41.kv_cache import SequenceChunk, key_positions, ranges_rows
from ..models.deepseek_v41.loader import attach_engram_token_map, load_weights, new_model
from ..models.deepseek_v41.model import DeepseekV41ForCausalLM
from ..models.deepseek_v41.sharding import ShardPlan, TensorParallel, shard_model
from ..ops.cache import to_device
from .cache import (PagedSequenceState, PagedStep, StoredPositions, make_cache_owners,
                    make_dspark_feature_owner, write_dspark_context)
from .compiled import (ATTENTION_OP, DRAFT_ATTENTION_OP, ENGRAM_OP, CompiledBody, CompiledDrafter, Drafting,
                       PagedForward, attach_steps, step_metadata)
from .spec_decode import dspark_tokens
from .vision import (DeepInferDummyInputsBuilder, DeepInferMultiModalProcessor, DeepInferProcessingInfo,
                     serving_args)

logger = logging.getLogger("deepinfer")
server_log = logging.getLogger("vllm.deepinfer")  # under vLLM's configured logger: lines the server log must show


def paged_chunks(args: ModelArgs, input_ids: torch.Tensor, positions: torch.Tensor, metadata: dict,
                 windows: nn.ModuleList, compressed: nn.ModuleDict, inputs: nn.ModuleDict,
                 audit: StoredPositions) -> tuple[list[SequenceChunk], list[tuple[int, int, int]]]:
    """One ``SequenceChunk`` per request with rows in this step, its state over the paged caches.
    -> (chunks, (request, start position, rows) of each). Start positions come from the metadata's host copies;
    ``positions`` (on the device) is only checked against them, through ``audit``."""
    first_meta = metadata[windows[0].layer_name]
    batch_store = PagedStep(args, windows, compressed, inputs, metadata, audit)
    chunks, rows = [], []
    for request, (first, last) in enumerate(zip(first_meta.query_start_loc, first_meta.query_start_loc[1:])):
        if last == first:
            continue
        start_pos = first_meta.seq_lens[request] - (last - first)
        state = PagedSequenceState(args, request, start_pos, input_ids[first:last], batch_store)
        chunks.append(SequenceChunk(first, last - first, start_pos, state))
        rows.append((request, start_pos, last - first))
    if chunks:
        expected = key_positions(chunks, "cpu")
        audit.expect(positions[: expected.numel()], expected, "vLLM's positions")
    return chunks, rows


def paged_forward(args: ModelArgs, input_ids: torch.Tensor, positions: torch.Tensor, metadata: dict,
                  windows: nn.ModuleList, compressed: nn.ModuleDict, inputs: nn.ModuleDict) -> PagedForward:
    """A step's chunks over the paged caches (``paged_chunks``), with its audit of stored positions."""
    audit = StoredPositions()
    chunks, rows = paged_chunks(args, input_ids, positions, metadata, windows, compressed, inputs, audit)
    return PagedForward(chunks, rows, metadata[windows[0].layer_name].num_actual_tokens, audit)


@dataclass
class LastStep:
    """What the proposer needs from the forward it follows (rows in the runner's batch order)."""

    context_blocks: torch.Tensor  # [requests, blocks] block table of the DSpark context cache
    seq_lens: list[int]  # tokens per request including this step's


@MULTIMODAL_REGISTRY.register_processor(DeepInferMultiModalProcessor, info=DeepInferProcessingInfo,
                                        dummy_inputs=DeepInferDummyInputsBuilder)
class DeepInferDeepseekV41ForCausalLM(nn.Module, SupportsMultiModal):
    requires_raw_input_tokens = True  # Engram and the image routing read the token ids beside the embeddings

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        model_config = vllm_config.model_config
        self.args = serving_args(str(model_config.model))
        dtype = model_config.dtype
        self.num_speculative_tokens = dspark_tokens(vllm_config)
        with_drafter = self.num_speculative_tokens > 0
        self.model = new_model(DeepseekV41ForCausalLM, self.args, dtype, with_drafter)
        self.shard_plan = self._shard(vllm_config.parallel_config.tensor_parallel_size)
        attach_engram_token_map(self.model, Path(model_config.tokenizer))
        self.window_caches, self.compressed_caches, self.input_caches = make_cache_owners(self.args, vllm_config,
                                                                                          prefix)
        self.context_cache = (make_dspark_feature_owner(self.args, vllm_config, prefix, self.num_speculative_tokens)
                              if with_drafter else None)
        self.capture_layers = tuple(self.args.dspark_target_layer_ids) if with_drafter else ()
        self.last_step: LastStep | None = None
        self.steps = attach_steps(self.model, self.window_caches)
        self.body = CompiledBody(vllm_config=vllm_config, prefix=f"{prefix}body", core=self.model,
                                 layer_names=[owner.layer_name for owner in self.window_caches],
                                 capture_layers=self.capture_layers)
        self.compiled_drafter = None
        if with_drafter:
            self.context_cache.drafting = Drafting(self.model.drafter)
            with set_model_tag("dspark_head"):  # its own compile cache, apart from the body's
                self.compiled_drafter = CompiledDrafter(vllm_config=vllm_config, prefix=f"{prefix}drafter",
                                                        core=self.model, context_layer=self.context_cache.layer_name)
        mode = vllm_config.compilation_config.mode
        speculation = ", DSpark speculation" if with_drafter else ""
        if self.body.do_not_compile:
            server_log.info("deepinfer: the model body runs eagerly (compilation mode %s%s)", mode.name, speculation)
        else:
            opaque = (ATTENTION_OP, ENGRAM_OP) + ((DRAFT_ATTENTION_OP,) if with_drafter else ())
            server_log.info("deepinfer: vLLM compiles the model body%s (compilation mode %s%s); paged-cache work "
                            "runs in the opaque ops %s", " and the DSpark drafter" if with_drafter else "",
                            mode.name, speculation, ", ".join(opaque))
        logger.info("deepinfer: DeepSeek-V4.1 core model (%d layers, activations %s) on vLLM paged caches",
                    self.args.num_hidden_layers, dtype)

    def _shard(self, world: int) -> ShardPlan | None:
        """This rank's shard shape, before any weight is read (vLLM has set up its tensor-parallel group)."""
        if world == 1:
            return None
        from vllm.distributed import get_tensor_model_parallel_rank, tensor_model_parallel_all_reduce

        return shard_model(self.model, TensorParallel(get_tensor_model_parallel_rank(), world,
                                                      tensor_model_parallel_all_reduce))

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        return None  # the recipe renders the placeholders (token ids), never vLLM's chat template

    def embed_multimodal(self, **kwargs: object) -> list[torch.Tensor]:
        """Each image's whole span [span_length, d] (the core's ``embed_image``), in prompt order: what vLLM's
        encoder cache keeps and slices into the steps that hold the span."""
        patches, grids = kwargs.get("patches"), kwargs.get("patch_grid")
        if patches is None:
            return []
        return [self.model.embed_image(image_patches, *grid.tolist()) for image_patches, grid in zip(patches, grids)]

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings=None, *,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings with the image rows vLLM gathered for this step's span positions; the core places them
        at the positions holding ``image_token_id``, which are the positions of ``is_multimodal``."""
        if not multimodal_embeddings:
            return self.model.input_embeddings(input_ids)
        return self.model.input_embeddings(input_ids, torch.cat(list(multimodal_embeddings)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds=None, **kwargs) -> torch.Tensor:
        """The step's chunks are built here, eagerly, once; the body (compiled by vLLM) finds them through the
        forward context. Stored positions are compared once the step is done."""
        step = self.steps.begin(lambda metadata: paged_forward(self.args, input_ids, positions, metadata,
                                                               self.window_caches, self.compressed_caches,
                                                               self.input_caches))
        if step is not None:
            self.model.check_tokens(input_ids[: step.num_tokens], with_image_embeds=inputs_embeds is not None)
        hidden, captured = self.body(input_ids, positions, inputs_embeds)
        if step is not None:
            if self.context_cache is not None:
                metadata = step_metadata()
                self._write_draft_context(step, {layer: streams[: step.num_tokens]
                                                 for layer, streams in captured.items()},
                                          metadata[self.window_caches[0].layer_name],
                                          metadata[self.context_cache.layer_name])
            step.audit.verify()
        return hidden

    @torch.inference_mode()
    def _write_draft_context(self, step: PagedForward, streams: dict[int, torch.Tensor], first_meta,
                             context_meta) -> None:
        """Every row's draft context keys (all stages) into the paged context cache, in one batched pass: a later
        prefix-cache hit or chunk boundary may need any position's keys. ``streams``: {target layer: the residual
        streams entering it, [rows of the step, S, d]}."""
        self.last_step = LastStep(context_meta.block_table.clone(), list(first_meta.seq_lens))
        if not step.chunks:
            return
        drafter = self.model.drafter
        rows = ranges_rows([(request, start, start + n) for request, start, n in step.rows])
        requests, positions = to_device(rows, context_meta.block_table.device)
        context = drafter.context(streams).to(drafter.dtype)  # [rows, d]
        keys = torch.stack([stage.attn.window_latents(context, positions) for stage in drafter], dim=1)  # [rows, S, d]
        write_dspark_context(self.args, self.context_cache, context_meta.block_table, requests, positions, keys)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Official checkpoint names -> ``model.<name>``, through the core's ``load_weights`` (which skips the
        vision/image tensors, and the drafter's ``mtp.*`` unless DSpark speculation is configured)."""
        load_weights(self.model, weights, "the checkpoint vLLM loaded", plan=self.shard_plan)
        self.model.finish_loading(keep_dense=envs.keep_dense_weights(on_cpu=self.model.embed.weight.is_cpu))
        return {f"model.{name}" for name, _ in self.model.named_parameters()}  # vLLM checks parameter names
