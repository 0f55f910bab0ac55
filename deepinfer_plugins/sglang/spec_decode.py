"""``--speculative-algorithm DEEPINFER_DSPARK``: DeepInfer's DSpark on SGLang (registered by register.py).

What is wired:
  * the algorithm object (``DeepInferDSparkAlgo``, a ``CustomSpecAlgo``) and its server-args validation
    (``validate_server_args``): γ from ``--speculative-dspark-block-size`` (default: the checkpoint's
    ``dspark_block_size``), verify window ``--speculative-num-draft-tokens`` = γ + 1, overlap scheduling off;
    EAGLE-style knobs (``--speculative-num-steps``, ``--speculative-eagle-topk`` > 1), an external draft
    model and a non-DeepInfer target are rejected with the flag to change;
  * the verification step as a translation of SGLang's TARGET_VERIFY logits onto
    ``deepinfer_plugins.dspark`` (``verify_from_target_logits``: processed_probs + verify) and the length
    plan (``plan_lengths``: plan_verify_lengths). Both are pure functions, tested on CPU with the real
    TARGET_VERIFY forward of model.py.

What is NOT wired: the scheduler-side worker. SGLang 0.5.23 drives a speculative worker through its V2
schema (``forward_batch_generation`` returning a ``GenerationBatchResult`` with accepted lengths, draft
KV bookkeeping, CUDA graphs, overlap); ``DeepInferDSparkWorker`` does not implement it and refuses to start
with a message naming the working alternatives, so a server never runs half an algorithm. The drafter
(``deepinfer_plugins.dspark.engine_api.DSparkEngineDrafter``) is not called from SGLang yet.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from .names import SPEC_ALGORITHM, V41_ARCH

logger = logging.getLogger(__name__)

ALGORITHM = SPEC_ALGORITHM


class DSparkArgsError(ValueError):
    """A server-args combination DEEPINFER_DSPARK cannot run; the message names the flag to change."""


# ---- algorithm object --------------------------------------------------------------------------------------
def _custom_spec_algo():
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    return CustomSpecAlgo


class DeepInferDSparkAlgo(_custom_spec_algo()):
    """Duck-typed ``SpeculativeAlgorithm`` member. Every upstream ``is_*()`` stays False (notably ``is_dspark``:
    upstream's DSPARK code paths must not run for ours); the draft state lives in DeepInfer's drafter, not in
    SGLang's draft KV pool."""

    def has_draft_kv(self) -> bool:
        return False


# ---- server args -------------------------------------------------------------------------------------------
def _checkpoint_block_size(model_path: str | None) -> int | None:
    config = Path(model_path or "") / "config.json"
    if not model_path or not config.exists():
        return None
    values = json.loads(config.read_text())
    return values.get("text_config", values).get("dspark_block_size")


def validate_server_args(server_args) -> None:
    """SGLang calls this while resolving ServerArgs (speculative_hook.py); writes are recorded as ours."""
    name = ALGORITHM
    if server_args.speculative_draft_model_path is not None:
        raise DSparkArgsError(f"{name}: --speculative-draft-model-path is not used; the V4.1 drafter (mtp.*) is read "
                              "from the target checkpoint. Remove the flag.")
    if server_args.speculative_num_steps is not None:
        raise DSparkArgsError(f"{name}: --speculative-num-steps does not apply (DSpark drafts a whole block in one "
                              "pass); set the block size with --speculative-dspark-block-size instead.")
    if server_args.speculative_eagle_topk not in (None, 1):
        raise DSparkArgsError(f"{name}: --speculative-eagle-topk {server_args.speculative_eagle_topk} is not "
                              "supported (DSpark drafts one chain); remove the flag.")
    gamma = server_args.speculative_dspark_block_size
    if gamma is None:
        gamma = _checkpoint_block_size(server_args.model_path)
    if gamma is None:
        raise DSparkArgsError(f"{name}: no block size: pass --speculative-dspark-block-size N (the checkpoint "
                              f"{server_args.model_path!r} has no text_config.dspark_block_size)")
    if int(gamma) < 1:
        raise DSparkArgsError(f"{name}: --speculative-dspark-block-size must be >= 1, got {gamma}")
    window = int(gamma) + 1
    given = server_args.speculative_num_draft_tokens
    if given is not None and given != window:
        raise DSparkArgsError(f"{name}: --speculative-num-draft-tokens {given} contradicts block size {gamma} "
                              f"(the verify window is anchor + block = {window}); drop one of the two flags.")
    override = getattr(server_args, "json_model_override_args", None) or "{}"
    archs = json.loads(override).get("architectures") if isinstance(override, str) else None
    if archs and archs[0] not in (V41_ARCH, "DeepInferDeepseekV41ForCausalLM"):
        raise DSparkArgsError(f"{name} needs DeepInfer's V4.1 model as the target, but --json-model-override-args "
                              f"selects {archs[0]!r}")
    server_args.speculative_dspark_block_size = int(gamma)
    server_args.speculative_num_draft_tokens = window
    server_args.speculative_eagle_topk = 1
    server_args.speculative_num_steps = int(gamma)
    if not server_args.disable_overlap_schedule:
        logger.info("%s: turning overlap scheduling off (the algorithm runs synchronously)", name)
        server_args.disable_overlap_schedule = True


# ---- verification: SGLang TARGET_VERIFY logits -> deepinfer_plugins.dspark -----------------------------------
def plan_lengths(confidences: list[list[float]], step_cost, max_batch_tokens: int | None = None) -> list[int]:
    """ℓ_r per request from the drafter's conditional confidences (Algorithm A, dspark/length_policy.py)."""
    from ..dspark import plan_verify_lengths

    return plan_verify_lengths(confidences, step_cost, max_batch_tokens)


def verify_from_target_logits(verify_logits: torch.Tensor, draft_tokens: torch.Tensor, num_verify: torch.Tensor,
                              draft_probs: torch.Tensor | None = None, temperature=0.0, top_k=0, top_p=1.0,
                              eos_token_id: int | None = None, generator: torch.Generator | None = None):
    """SGLang's TARGET_VERIFY output -> ``dspark.verify`` -> VerifyResult.

    verify_logits [R * (k + 1), vocab]: ``next_token_logits`` of a TARGET_VERIFY forward whose rows per request
    are anchor, x_1..x_k (SGLang's layout: requests one after another); draft_tokens int [R, k];
    num_verify int [R] (ℓ_r ≤ k). Rows past anchor + ℓ_r are computed by SGLang's fixed-width window and ignored.
    """
    from ..dspark import processed_probs, verify

    rows, k = draft_tokens.shape
    if verify_logits.shape[0] != rows * (k + 1):
        raise ValueError(f"verify_logits has {verify_logits.shape[0]} rows; {rows} requests x (anchor + {k} drafts) "
                         f"= {rows * (k + 1)} expected")
    target_probs = processed_probs(verify_logits.float().view(rows, k + 1, -1), temperature, top_k, top_p)
    return verify(draft_tokens, num_verify, target_probs, draft_probs, eos_token_id=eos_token_id,
                  generator=generator)


# ---- the worker SGLang would build -------------------------------------------------------------------------
class DeepInferDSparkWorker:
    """Constructed by SGLang's scheduler as ``Worker(server_args=, gpu_id=, nccl_port=, target_worker=)``.

    Not implemented: see the module docstring. It refuses to start rather than serve without speculation.
    """

    def __init__(self, server_args=None, gpu_id=None, nccl_port=None, target_worker=None, **kwargs):
        raise NotImplementedError(
            f"{ALGORITHM}: the SGLang scheduler-side worker is not implemented in this DeepInfer version "
            "(registration, argument validation, the TARGET_VERIFY forward and the verify/length-policy "
            "translation are). Serve without --speculative-algorithm, use upstream SGLang's "
            "--speculative-algorithm DSPARK with DEEPINFER_SGLANG_KEEP_UPSTREAM=1, or DeepInfer's vLLM path.")
