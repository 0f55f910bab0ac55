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


def _guard_breakable_cudagraph() -> None:
    """vLLM lists ``DeepseekV41ForCausalLM`` (its own V4.1 class, which cannot compile) among the architectures
    that default to breakable CUDA graphs, and that default turns the compilation mode to NONE: our class of that
    name would never be compiled. Answer False for the configs DeepInfer serves."""
    from vllm.config import VllmConfig

    original = VllmConfig._uses_breakable_cudagraph_by_default
    if getattr(original, _PATCHED_FLAG, False):
        return

    def guarded(self):
        if self.model_config is not None and served_by_deepinfer(self.model_config.hf_config):
            return False
        return original(self)

    setattr(guarded, _PATCHED_FLAG, True)
    guarded.__name__ = original.__name__
    VllmConfig._uses_breakable_cudagraph_by_default = guarded


def apply() -> bool:
    from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

    _guard(ModelArchConfigConvertorBase, "is_deepseek_mla", False)
    _guard(ModelArchConfigConvertorBase, "get_quantization_config", None)
    _guard_breakable_cudagraph()
    return True
