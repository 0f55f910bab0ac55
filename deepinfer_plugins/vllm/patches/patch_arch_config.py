"""Keep vLLM's architecture heuristics away from the configs DeepInfer serves (see the ledger in __init__.py)."""

from __future__ import annotations

from ... import envs

_PATCHED_FLAG = "_deepinfer_patched"


def served_by_deepinfer(hf_config) -> bool:
    architectures = getattr(hf_config, "architectures", None) or []
    ours = {"DeepInferDeepseekV41ForCausalLM"}
    if not envs.keep_upstream_v41():
        ours.add("DeepseekV41ForCausalLM")
    return bool(ours.intersection(architectures))


def _guard(cls, method_name: str, ours_result) -> None:
    original = getattr(cls, method_name)
    if getattr(original, _PATCHED_FLAG, False):
        return

    def guarded(self):
        if served_by_deepinfer(self.hf_config):
            return ours_result
        return original(self)

    setattr(guarded, _PATCHED_FLAG, True)
    guarded.__name__ = method_name
    setattr(cls, method_name, guarded)


def apply() -> bool:
    from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

    _guard(ModelArchConfigConvertorBase, "is_deepseek_mla", False)
    _guard(ModelArchConfigConvertorBase, "get_quantization_config", None)
    return True
