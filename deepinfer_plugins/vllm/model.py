"""vLLM model class for DeepSeek-V4.1: maps vLLM's flattened batch and paged caches onto the core model.

Nothing here computes model math: the forward builds one ``SequenceChunk`` per request (rows, start position,
a ``PagedSequenceState`` over vLLM's caches) and calls ``DeepseekV41Model.hidden_states``. Weight names are the
official checkpoint names under ``model.``; quantised tensors are loaded as stored (see models/.../linear.py).

Tensor parallelism is not implemented: the class refuses tensor_parallel_size > 1 with a clear error.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable

import torch
from torch import nn
from vllm.forward_context import get_forward_context

from .. import envs
from ..models.deepseek_v41.args import ModelArgs
from ..models.deepseek_v41.kv_cache import SequenceChunk
from ..models.deepseek_v41.loader import SKIPPED_PREFIXES, CheckpointError, check_tensor
from ..models.deepseek_v41.model import DeepseekV41Model
from .cache import PagedSequenceState, make_cache_owners

logger = logging.getLogger("deepinfer")


class DeepInferDeepseekV41ForCausalLM(nn.Module):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        model_config = vllm_config.model_config
        if vllm_config.parallel_config.tensor_parallel_size > 1:
            raise ValueError("DeepInfer's V4.1 vLLM adapter runs with tensor_parallel_size=1 only "
                             f"(got {vllm_config.parallel_config.tensor_parallel_size})")
        self.args = ModelArgs.from_file(Path(model_config.model))
        dtype = model_config.dtype
        param_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
        self.model = DeepseekV41Model(self.args, dtype=dtype, param_dtype=param_dtype)
        self.window_caches, self.compressed_caches = make_cache_owners(self.args, vllm_config, prefix)
        logger.info("deepinfer: DeepSeek-V4.1 core model (%d layers, activations %s) on vLLM paged caches",
                    self.args.num_hidden_layers, dtype)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids).to(self.model.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds=None, **kwargs) -> torch.Tensor:
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):
            metadata = metadata[0]
        hidden = torch.zeros(input_ids.shape[0], self.args.hidden_size, dtype=self.model.dtype,
                             device=input_ids.device)
        if not metadata:
            return hidden  # vLLM's profiling / warm-up run: no caches, nothing to compute
        first_meta = metadata[self.window_caches[0].layer_name]
        n = first_meta.num_actual_tokens
        chunks, starts = [], first_meta.query_start_loc
        for request in range(len(starts) - 1):
            first, last = starts[request], starts[request + 1]
            if last == first:
                continue
            start_pos = int(positions[first])
            state = PagedSequenceState(self.args, request, start_pos, input_ids[first:last].cpu(),
                                       self.window_caches, self.compressed_caches, metadata)
            chunks.append(SequenceChunk(first, last - first, start_pos, state))
        if chunks:
            hidden[:n] = self.model.hidden_states(input_ids[:n], chunks)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Official checkpoint names -> ``model.<name>``; vision/image tensors and the drafter are skipped."""
        params = dict(self.model.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith(SKIPPED_PREFIXES) or name.startswith("mtp."):
                continue
            if name not in params:
                raise CheckpointError(f"unexpected tensor {name!r}: not part of the model the config describes")
            param = params[name]
            check_tensor(name, "the checkpoint", tensor.shape, tensor.dtype, param)
            param.data = tensor.to(param.device) if tensor.dtype == param.dtype else tensor.to(param.dtype)
            loaded.add(f"model.{name}")
        missing = sorted(set(f"model.{n}" for n in params) - loaded)
        if missing:
            raise CheckpointError(f"missing tensor {missing[0][len('model.'):]!r} ({len(missing)} missing in total)")
        if envs.keep_dense_weights():
            self.model.keep_dense_weights()
        return loaded
