"""Keep ``DeepseekV41ForCausalLM`` as the architecture of V4.1 checkpoints (ledger: patches/__init__.py)."""

from __future__ import annotations

V41_ARCH = "DeepseekV41ForCausalLM"
TARGET = "sglang.srt.configs.deepseek_v41.normalize_deepseek_v41_config"


def keep_v41_architecture(result: dict, values, *args, **kwargs) -> dict:
    """AFTER hook: ``values`` is what SGLang was asked to normalise, ``result`` what it produced."""
    if dict(values).get("architectures") == [V41_ARCH]:
        result = dict(result)
        result["architectures"] = [V41_ARCH]
    return result


def register_hook() -> None:
    """Queue the hook; SGLang's load_plugins() applies it (HookRegistry.apply_hooks) after every plugin ran."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, keep_v41_architecture, HookType.AFTER)
