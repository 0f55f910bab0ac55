"""vLLM general plugin: register DeepInfer's model, tokenizer mode, renderer and parsers (names only).

Runs in every vLLM process (API server, engine core, workers), possibly more than once per process, so it is
idempotent. It imports only vLLM's registries; our model module is imported lazily by vLLM in the worker.

Names registered:
  * architectures ``DeepInferDeepseekV41ForCausalLM`` always, and ``DeepseekV41ForCausalLM`` (the name in the
    official config.json) unless ``DEEPINFER_KEEP_UPSTREAM_V41=1`` keeps vLLM's own class for it;
  * tokenizer mode / renderer ``deepinfer`` (prompts rendered by deepinfer_recipe, as token ids);
  * reasoning parser and tool-call parser ``deepinfer``;
  * KV connector ``DeepInferStoreConnector``, the retained prefix cache on shared storage (kv_store.py).
"""

from __future__ import annotations

import logging

from .. import envs

logger = logging.getLogger("deepinfer")

MODEL_CLASS = "deepinfer_plugins.vllm.model:DeepInferDeepseekV41ForCausalLM"
ARCHITECTURES = ("DeepInferDeepseekV41ForCausalLM", "DeepseekV41ForCausalLM")
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.reasoning import ReasoningParserManager
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry
    from vllm.tool_parsers import ToolParserManager

    from .patches import apply_all

    architectures = ARCHITECTURES[:1] if envs.keep_upstream_v41() else ARCHITECTURES
    for arch in architectures:
        ModelRegistry.register_model(arch, MODEL_CLASS)
    TokenizerRegistry.register("deepinfer", "deepinfer_plugins.vllm.tokenizer", "DeepInferTokenizer")
    RENDERER_REGISTRY.register("deepinfer", "deepinfer_plugins.vllm.tokenizer", "DeepInferRenderer")
    ReasoningParserManager.register_lazy_module("deepinfer", "deepinfer_plugins.vllm.parsers",
                                                "DeepInferReasoningParser")
    ToolParserManager.register_lazy_module("deepinfer", "deepinfer_plugins.vllm.parsers", "DeepInferToolParser")
    try:
        KVConnectorFactory.register_connector("DeepInferStoreConnector", "deepinfer_plugins.vllm.kv_store",
                                              "DeepInferStoreConnector")
    except ValueError:  # registered by an earlier call in this process
        pass
    patched = apply_all()
    _registered = True
    logger.info("deepinfer: registered architectures %s, tokenizer mode/renderer 'deepinfer', reasoning and "
                "tool parsers 'deepinfer', KV connector 'DeepInferStoreConnector'; patches: %s",
                ", ".join(architectures), ", ".join(patched) or "none")
