"""Ledger of DeepInfer's patches to SGLang. Applied through SGLang's own HookRegistry.

patch_v41_architecture_name.py
    symbol:  sglang.srt.configs.deepseek_v41.normalize_deepseek_v41_config (SGLang 0.5.23)
    why:     SGLang rewrites a checkpoint's ``architectures == ["DeepseekV41ForCausalLM"]`` to
             ``["DeepseekV4ForCausalLM"]`` while flattening the nested config, so no plugin-registered
             ``DeepseekV41ForCausalLM`` class can ever be selected for an official V4.1 checkpoint.
    how:     an AFTER hook that puts the checkpoint's own architecture name back (nothing else changes:
             model_type, the flattened text fields and the vision fields stay as SGLang made them).
    when:    registered by register() unless DEEPINFER_SGLANG_KEEP_UPSTREAM=1.
    upstream: none filed yet; removable if SGLang keeps ``DeepseekV41ForCausalLM`` and resolves it through
             ModelRegistry (upstream then registers its V4 class under that name too).

patch_unavailable_spec_algorithm.py
    symbol:  sglang.srt.speculative.spec_info.SpeculativeAlgorithm.from_string (SGLang 0.5.23)
    why:     DeepInfer registers no speculative algorithm on SGLang (no worker for SGLang's scheduler), so
             ``--speculative-algorithm DEEPINFER_DSPARK`` would fail as "Unknown speculative algorithm name"
             without saying what to use instead.
    how:     a BEFORE hook that raises a ValueError subclass naming the alternatives for that one name; every
             other name reaches SGLang unchanged.
    when:    always registered by register().
    upstream: nothing to file; removable once DeepInfer registers a working DSpark worker under that name.
"""

from .patch_unavailable_spec_algorithm import register_hook as register_unavailable_spec_algorithm_hook
from .patch_v41_architecture_name import register_hook as register_v41_architecture_name_hook

__all__ = ["register_unavailable_spec_algorithm_hook", "register_v41_architecture_name_hook"]
