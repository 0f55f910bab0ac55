"""DSpark speculative decoding in vLLM through the ``custom_class`` proposer hook (V1 model runner only).

    vllm serve <checkpoint> --speculative-config \\
        '{"method": "custom_class", "model": "deepinfer_plugins.vllm.spec_decode.DeepInferDSparkProposer",
          "num_speculative_tokens": 3}'

What vLLM 0.32 gives a custom proposer (docs/vllm_internals.md §6): ``load_model(target_model)`` once, then per
step ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)`` with rows in the batch
order of the forward that just ran, and nothing else: no request ids, no hidden states, no sampling parameters.

How the target's features reach the drafter without a second forward: the target model (model.py) captures the
residual streams entering ``dspark_target_layer_ids`` during its own forward, runs the drafter's context combiner
and every stage's key projection on them and writes the keys into a paged cache of its own (cache.py,
``make_dspark_feature_owner``), at the slot of each token. The proposer keeps no per-request state: for row i the
anchor is the last committed token (position n_i - 1), its context is the ``sliding_window`` positions before it,
read through the row's block table of the forward just run (``model.last_step``). Prefix-cache hits, chunked
prefill, preemption and rejected drafts therefore need nothing special: rejected positions are rewritten when
vLLM recomputes them, and a draft never reads a position at or after its anchor.

The drafter's block backbone runs as the model's ``compiled_drafter`` (vllm/compiled.py: traced by vLLM like the
body, its context reads one opaque op), the Markov stage after it eagerly. Drafts are greedy (argmax of the
Markov-corrected draft distribution). vLLM's rejection sampler treats drafts without probabilities as one-hot
proposals, which is lossless for greedy and for sampled requests alike.

Verify lengths: vLLM's V1 runner accepts one draft list per request of any length <= num_speculative_tokens, so
lengths can differ per request. By default every request gets min(num_speculative_tokens, dspark_block_size)
drafts. With ``DEEPINFER_DSPARK_COST_TABLE=<json file>`` holding a ``{"tokens": [...], "ms": [...]}`` step-cost
table (cost_model.CostTable; ``deepinfer measure-step-cost`` writes one), lengths come from Algorithm B
(``StaleBudget``, docs/dspark.md): the number of drafts verified this step is the budget that maximises expected
tokens per ms on the table, from the drafter's confidences two steps old, and they go to the most confident
positions of this step's drafts. Algorithm A stops at the first bucket boundary of a jagged measured table; B
never falls below a fixed length in our simulation.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import torch
from vllm.forward_context import set_forward_context

from .. import envs
from ..dspark.length_policy import StaleBudget, cumulative_survival
from ..models.deepseek_v41.kv_cache import key_positions
from .cache import PagedDraftContexts, StoredPositions

logger = logging.getLogger("deepinfer")

def load_cost_table(path: str):
    from ..dspark.cost_model import CostTable

    with open(path) as f:
        data = json.load(f)
    return CostTable(data["tokens"], data["ms"])


class DeepInferDSparkProposer:
    """vLLM ``custom_class`` proposer running DeepInfer's DSpark drafter on the target's paged draft context."""

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        spec = vllm_config.speculative_config
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.target = None
        path = envs.dspark_cost_table_path()
        self.step_cost = load_cost_table(path) if path else None
        self.lengths = StaleBudget("global", lag=2)

    def load_model(self, target_model) -> None:
        if getattr(target_model, "context_cache", None) is None:
            raise RuntimeError("DeepInferDSparkProposer needs DeepInfer's V4.1 model class with its DSpark drafter "
                               f"(got {type(target_model).__name__}); serve the checkpoint with --plugin deepinfer")
        self.target = target_model
        self.args = target_model.args
        self.num_drafts = min(self.num_speculative_tokens, target_model.model.drafter.block_size)
        if self.num_drafts < self.num_speculative_tokens:
            logger.warning("deepinfer: num_speculative_tokens=%d exceeds the DSpark block size %d; proposing %d",
                           self.num_speculative_tokens, self.num_drafts, self.num_drafts)
        self.trace_drafter(rows=2)
        logger.info("deepinfer: DSpark proposer on %s, up to %d drafts per request, verify lengths %s",
                    type(target_model).__name__, self.num_drafts,
                    "planned (Algorithm B)" if self.step_cost is not None else "fixed")

    @torch.inference_mode()
    def trace_drafter(self, rows: int) -> None:
        """Call the compiled drafter once with no rows to draft for (its context reads give zeros), so that vLLM
        traces it now rather than at the first step. Over two rows or more: traced at one row, the number of rows
        would be a constant of the graph."""
        device = self.target.model.embed.weight.device
        block = self.target.model.drafter.block_size
        with set_forward_context(None, self.vllm_config):
            self.target.compiled_drafter(torch.zeros(rows, dtype=torch.long, device=device),
                                         torch.arange(rows * block, device=device))

    def draft_rows(self, num_tokens_no_spec, token_ids_cpu, rows: list[int]):
        """Draft one block for each batch row in ``rows`` -> (tokens [R, B], confidences [R, B]) numpy."""
        model, step = self.target.model, self.target.last_step
        if step is None:
            raise RuntimeError("propose() before any forward: no draft context")
        audit = StoredPositions()
        lengths = num_tokens_no_spec[rows].astype(np.int64)  # the anchor is each row's last committed token
        device = step.context_blocks.device
        anchors = torch.from_numpy(token_ids_cpu[rows, lengths - 1].astype(np.int64)).to(device)
        context = PagedDraftContexts(self.args, self.target.context_cache, step.context_blocks[rows],
                                     (lengths - 1).tolist(), audit)
        chunks = model.drafter.block_chunks(context.rows)
        with self.target.context_cache.drafting.rows(chunks), set_forward_context(None, self.vllm_config):
            hidden = self.target.compiled_drafter(anchors, key_positions(chunks, device))
        tokens, confidence_logits = model.drafter.greedy_drafts(hidden, model.head_weight, anchors)
        audit.verify()
        return tokens.cpu().numpy(), torch.sigmoid(confidence_logits).float().cpu().numpy()

    @torch.inference_mode()
    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings=None, **kwargs) -> list[list[int]]:
        # Rows that sampled nothing (partial prefill chunks, discarded rows) get no drafts.
        rows = [i for i, sampled in enumerate(sampled_token_ids) if sampled]
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        if not rows or self.num_drafts == 0:
            return drafts
        tokens, confidences = self.draft_rows(num_tokens_no_spec, token_ids_cpu, rows)
        tokens, confidences = tokens[:, : self.num_drafts], confidences[:, : self.num_drafts]
        if self.step_cost is None:
            lengths = [self.num_drafts] * len(rows)
        else:
            num_drafted = np.full(len(rows), tokens.shape[1])
            survival = cumulative_survival(confidences.astype(np.float64).clip(0, 1), num_drafted)
            lengths = self.lengths.plan(survival, num_drafted, self.step_cost).tolist()
        for r, i in enumerate(rows):
            drafts[i] = [int(t) for t in tokens[r, : lengths[r]]]
        return drafts


def dspark_tokens(vllm_config) -> int:
    """num_speculative_tokens if the speculative config selects our DSpark proposer (or a subclass), else 0."""
    spec = vllm_config.speculative_config
    if spec is None or spec.method != "custom_class" or not spec.model:
        return 0
    import importlib

    module, _, name = spec.model.rpartition(".")
    cls = getattr(importlib.import_module(module), name, None)
    return spec.num_speculative_tokens if isinstance(cls, type) and issubclass(cls, DeepInferDSparkProposer) else 0
