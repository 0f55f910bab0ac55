"""DeepInfer: DeepSeek-V4.1-Flash model code, kernels and DSpark for vLLM and SGLang.

The functions here are the engines' entry points. They only register names (dotted strings) and import
nothing heavy, so ``import deepinfer_plugins`` works on a machine without any engine installed.
"""

from __future__ import annotations

__version__ = "0.1.0"


def register_vllm() -> None:
    """``vllm.general_plugins`` entry point ``deepinfer``: registers the model and the request layer."""
    from .vllm.register import register

    register()


def register_sglang() -> None:
    """``sglang.srt.plugins`` entry point ``deepinfer``: registers the model and the DSpark algorithm."""
    from .sglang.register import register

    register()
