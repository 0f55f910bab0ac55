"""Every DEEPINFER_* environment variable, read in one place (default and meaning beside each)."""

from __future__ import annotations

import os

ENVIRONMENT = {
    "DEEPINFER_KEEP_UPSTREAM_V41": "0 (default): our model serves the architecture 'DeepseekV41ForCausalLM'; "
                                   "1: leave that name to vLLM's own class (ours stays under "
                                   "'DeepInferDeepseekV41ForCausalLM').",
    "DEEPINFER_DSPARK_COST_TABLE": "unset (default): the vLLM DSpark proposer drafts num_speculative_tokens for "
                                   "every request; a JSON file {\"tokens\": [...], \"ms\": [...]} of verify-step "
                                   "costs (written by `deepinfer measure-step-cost`) switches it to per-request "
                                   "lengths from Algorithm B (StaleBudget).",
    "DEEPINFER_KEEP_DENSE_WEIGHTS": "unset (default): the vLLM adapter dequantises FP8/FP4 weights once after "
                                    "loading on a CPU (fast CPU decode, dense-size memory) and keeps them as stored "
                                    "on a GPU or NPU, whose GEMM backends read them directly; 1: always; 0: never "
                                    "(dequantise per use, checkpoint-size memory).",
    "DEEPINFER_ASCEND_LIGHTNING_INDEXER": "0 (default): indexer top-k stays on the reference on an NPU; 1: map it onto "
                                          "npu_lightning_indexer, whose tie order is undocumented "
                                          "(ops/backends/ascend_backend.py).",
    "DEEPINFER_CUDA_ATTENTION": "unset (default): the CUDA sparse attention kernel is chosen by batch size; a variant "
                                "name (ops/backends/cuda_backend.py FORCED_VARIANTS) forces it for every call it "
                                "fits.",
    "DEEPINFER_OP_BACKEND": "unset (default): pick op backends by device; 'triton' (any backend name) forces it "
                            "for every op; 'op=backend,...' forces per op (ops/registry.py).",
    "DEEPINFER_RESPONSES_STORE_SIZE": "1024 (default): with VLLM_ENABLE_RESPONSES_API_STORE=1 (which `deepinfer "
                                      "serve` sets), the API server keeps the most recent this many stored Responses "
                                      "for previous_response_id; older ones are forgotten (a follow-up naming one "
                                      "gets 404).",
    "DEEPINFER_REQUEST_SAMPLING": "0 (default): served requests sample with the official API's values, which "
                                  "the recipe reports (thinking on: temperature 1.0, and on V4.1 top_p at least "
                                  "0.95; thinking off on V4.1: top_p 1.0); 1: with the request's own temperature "
                                  "and top_p (greedy thinking for evaluations).",
    "DEEPINFER_SGLANG_KEEP_UPSTREAM": "0 (default): our model serves 'DeepseekV41ForCausalLM' in SGLang; 1: keep "
                                      "SGLang's own handling of that name.",
}


def _flag(name: str, default: str = "0") -> bool:
    value = os.environ.get(name, default).strip().lower()
    if value not in ("", "0", "1", "false", "true", "no", "yes"):
        raise ValueError(f"{name}={value!r}: expected 0 or 1")
    return value in ("1", "true", "yes")


def keep_upstream_v41() -> bool:
    return _flag("DEEPINFER_KEEP_UPSTREAM_V41")


def op_backend() -> str:
    return os.environ.get("DEEPINFER_OP_BACKEND", "").strip()


def cuda_attention() -> str:
    return os.environ.get("DEEPINFER_CUDA_ATTENTION", "").strip().lower()


def ascend_lightning_indexer() -> bool:
    return _flag("DEEPINFER_ASCEND_LIGHTNING_INDEXER")


def request_sampling() -> bool:
    return _flag("DEEPINFER_REQUEST_SAMPLING")


def keep_upstream_sglang() -> bool:
    return _flag("DEEPINFER_SGLANG_KEEP_UPSTREAM")


def keep_dense_weights(on_cpu: bool) -> bool:
    """Dense copies speed up a CPU; on an accelerator they would bypass the block-scaled GEMMs and need the dense
    size of every weight (~1.1 TB for V4.1's FP4 experts)."""
    if not os.environ.get("DEEPINFER_KEEP_DENSE_WEIGHTS", "").strip():
        return on_cpu
    return _flag("DEEPINFER_KEEP_DENSE_WEIGHTS")


def dspark_cost_table_path() -> str | None:
    return os.environ.get("DEEPINFER_DSPARK_COST_TABLE") or None


def responses_store_size() -> int:
    value = os.environ.get("DEEPINFER_RESPONSES_STORE_SIZE", "1024").strip()
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"DEEPINFER_RESPONSES_STORE_SIZE={value!r}: expected a positive integer")
    return int(value)
