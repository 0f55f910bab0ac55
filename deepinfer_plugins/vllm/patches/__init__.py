"""Patches to vLLM, kept as a ledger: what is patched, why, how, and when it can go.

patch_arch_config (vllm/transformers_utils/model_arch_config_convertor.py, ModelArchConfigConvertorBase)
  * ``is_deepseek_mla`` -> False for configs whose architecture DeepInfer serves.
    why:  vLLM classifies every model_type 'deepseek_v41' config as MLA. On a CPU without AMX it then turns
          off chunked prefill and prefix caching, and everywhere it changes head-size and block-size choices
          meant for its own MLA kernels. Our model owns its caches (vllm/cache.py) and needs none of that.
  * ``get_quantization_config`` -> None for those configs.
    why:  the official config's ``quantization_config`` (fp8, 32x32 blocks, FP4 experts) makes vLLM build its
          own FP8 linear method, which our layers do not use (linear.py dequantises the stored tensors) and
          which refuses float32 activations.
  how:  each method answers for DeepInfer's architectures and defers to the original otherwise.
  remove when: vLLM lets an out-of-tree model declare that it manages its own caches and weight formats.
  tested: integration_tests/vllm (the server starts on the official-format checkpoint; prefix-cache hits are
          observed through /metrics).
"""

from __future__ import annotations


def apply_all() -> list[str]:
    from . import patch_arch_config

    return ["arch_config"] if patch_arch_config.apply() else []
