"""Answer ``--speculative-algorithm DEEPINFER_DSPARK`` with what works instead (ledger: patches/__init__.py)."""

from __future__ import annotations

UNAVAILABLE = "DEEPINFER_DSPARK"
TARGET = "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.from_string"


class UnavailableAlgorithmError(ValueError):
    """A speculative algorithm DeepInfer does not provide on SGLang (a ValueError, as SGLang's own refusal)."""


def refuse_unavailable(*args, **kwargs):
    """BEFORE hook on ``from_string(name)``: SGLang would reject the name as unknown; this says why."""
    name = kwargs.get("name", args[-1] if args else None)
    if isinstance(name, str) and name.upper() == UNAVAILABLE:
        raise UnavailableAlgorithmError(
            f"--speculative-algorithm {name}: DeepInfer provides no speculative algorithm on SGLang (its DSpark "
            "worker for SGLang's scheduler is not written). Serve without --speculative-algorithm; for DSpark use "
            "DeepInfer's vLLM plugin (docs/dspark.md), or upstream SGLang's --speculative-algorithm DSPARK with "
            "DEEPINFER_SGLANG_KEEP_UPSTREAM=1.")
    return None


def register_hook() -> None:
    """Queue the hook; SGLang's load_plugins() applies it (HookRegistry.apply_hooks) after every plugin ran."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, refuse_unavailable, HookType.BEFORE)
