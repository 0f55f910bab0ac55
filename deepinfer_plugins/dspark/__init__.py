"""DSpark dynamic-length speculative decoding: the framework-neutral parts.

drafter -> DSparkProposal (confidences) -> plan_verify_lengths (ℓ_r)
        -> target forward over anchor + ℓ_r rows -> verify (commit, KV rows to keep).
See docs/dspark.md. Names are resolved lazily so importing this package costs nothing
(no numpy, no torch) until a name is used.
"""

from importlib import import_module

_EXPORTS = {
    "plan_verify_lengths": "length_policy",
    "algorithm_a": "length_policy",
    "cumulative_survival": "length_policy",
    "verify": "verify",
    "processed_probs": ".models.deepseek_v41.sampling",  # relative to deepinfer_plugins.dspark: its parent
    "DSparkProposal": "proposal",
    "VerifyResult": "proposal",
    "CostTable": "cost_model",
    "fit_sts": "calibration",
    "apply_sts": "calibration",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
