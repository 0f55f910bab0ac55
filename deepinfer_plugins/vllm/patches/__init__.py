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
  * ``VllmConfig._uses_breakable_cudagraph_by_default`` (vllm/config/vllm.py) -> False for those configs.
    why:  vLLM 0.32 defaults ``DeepseekV41ForCausalLM`` (the official config's architecture, its own class
          "cannot torch.compile") to breakable CUDA graphs, which sets VLLM_USE_BREAKABLE_CUDAGRAPH=1 and the
          compilation mode to NONE: our class of that name would always run eagerly (vllm/compiled.py is what
          it compiles).
  how:  each method answers for DeepInfer's architectures and defers to the original otherwise.
  remove when: vLLM lets an out-of-tree model declare that it manages its own caches and weight formats (and
        keys the breakable-CUDA-graph default on the model class rather than the architecture name).
  tested: integration_tests/vllm (the server starts on the official-format checkpoint; prefix-cache hits are
          observed through /metrics; test_compile.py: the server logs a compiled mode).

patch_responses_store (vllm/entrypoints/openai/responses/serving.py, OpenAIServingResponses.__init__)
  * ``response_store``, ``msg_store``, ``event_store`` -> stores that keep the most recent
    DEEPINFER_RESPONSES_STORE_SIZE entries (default 1024).
    why:  ``store`` + ``previous_response_id`` need VLLM_ENABLE_RESPONSES_API_STORE=1 (``deepinfer serve`` sets
          it), and vLLM then keeps every response, its input messages and its stream events in plain dicts for the
          life of the server: memory grows without bound.
  how:  after the original __init__, each dict is replaced by a BoundedStore holding its entries; a follow-up
        naming a forgotten response gets vLLM's own 404. Applied only when the store is enabled.
  remove when: vLLM bounds or expires its Responses store.
  tested: integration_tests/vllm/test_api.py (a follow-up through previous_response_id; eviction past the bound).

patch_responses_history (vllm/renderers/online_renderer.py, the module's ``construct_input_messages``)
  * the previous response's output items -> converted like input items, ahead of the new input.
    why:  vLLM turns a stored response's output into chat messages by keeping its output messages only, so a
          follow-up through ``previous_response_id`` loses the previous turn's reasoning and function calls (a
          ``function_call_output`` then answers a call the prompt never shows); OpenAI's API treats
          ``previous_response_id`` as the previous input and output items.
  * an assistant message that holds reasoning only -> content "".
    why:  vLLM converts a reasoning item that nothing follows in its turn into an assistant message without
          content, which the recipe's Chat conversion refuses (400 "content or tool_calls must be set"), so a
          history whose last answer was reasoning alone (a follow-up, or the same history sent explicitly)
          could not be continued; the official Responses codec renders it as a turn with an empty answer.
  how:  the wrapper prepends those items to the request's input and calls the original without them, so they go
        through vLLM's own item conversion, then gives reasoning-only assistant messages empty content.
  remove when: vLLM converts stored output items the way it converts input items, and keeps a reasoning-only
        turn's content.
  tested: integration_tests/vllm/test_api.py (the follow-up's prompt and answer equal those of the same history
          sent explicitly); tests/vllm/test_responses_store.py (the conversion of a reasoning-only turn).

patch_usage (vllm/entrypoints/openai/chat_completion/serving.py, OpenAIServingChat.__init__;
             vllm/entrypoints/serve/engine/protocol.py, UsageInfo.__setattr__)
  * ``enable_prompt_tokens_details`` -> True for Chat Completions and Messages (which subclasses it).
    why:  a cache-hit input token is priced far below a miss, so every response reports the hits: vLLM reports
          ``usage.prompt_tokens_details.cached_tokens`` (Chat) and ``cache_read_input_tokens`` (Messages) only
          when the server was started with ``--enable-prompt-tokens-details``; Responses reports them always.
  * Chat usage -> also ``prompt_cache_hit_tokens`` and ``prompt_cache_miss_tokens``, DeepSeek's own API fields.
  how:  after the original __init__ the flag is set; assigning ``prompt_tokens_details`` to a UsageInfo (which
        vLLM does once the request's cached-token count is known, streamed or not) also writes the two fields
        as the model's extra fields, which vLLM's models serialise.
  remove when: vLLM reports prompt-cache hits by default and lets a plugin add usage fields.
  tested: tests/vllm/test_usage.py (the split); integration_tests/vllm/test_structured_and_cache.py (the
          fields equal the hits vLLM's metrics count, in all three APIs, streamed and not).
"""

from __future__ import annotations


def apply_all() -> list[str]:
    from . import patch_arch_config, patch_responses_history, patch_responses_store, patch_usage

    applied = {"arch_config": patch_arch_config.apply(), "responses_store": patch_responses_store.apply(),
               "responses_history": patch_responses_history.apply(), "usage": patch_usage.apply()}
    return [name for name, done in applied.items() if done]
