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

patch_api_codecs (vllm/entrypoints/openai/chat_completion/serving.py, OpenAIServingChat.create_chat_completion;
                  vllm/entrypoints/openai/responses/serving.py, OpenAIServingResponses.create_responses;
                  vllm/entrypoints/anthropic/serving.py, AnthropicServingMessages.create_messages, count_tokens and
                  to_chat_completion_request; vllm/entrypoints/scale_out/render/serving.py, ServingRender's
                  render_chat_request and render_messages_request; vllm/entrypoints/scale_out/render/
                  api_router.py, the /v1/responses/render route; vllm/renderers/online_renderer.py,
                  OnlineRenderer.render_responses and preprocess_chat)
  * a Chat, Responses or Messages prompt -> deepinfer_recipe's codec of that API over the body the client sent,
    not the chat messages vLLM's request models and conversions leave, rendered as a Chat request.
    why:  those lose what each API's codec renders. Chat: DeepSeek's ``thinking`` field, which vLLM's request
          model drops. Responses: developer messages (refused as a Chat role), several reasoning items of one
          turn (joined with a newline), namespace and custom tools, the order of tool results, items vLLM does not
          convert (``item_reference``, tool search). Messages: system messages inside ``messages`` (vLLM merges
          them into the leading system prompt), thinking blocks, a ``tool_use`` answered by ``tool_result``
          blocks, documents (stubbed in place). On the recipe's generated requests that both accepted, a fifth of
          the Chat prompts, half of the Responses prompts and a quarter of the Messages prompts differed from the
          official package's, and more were refused (docs/vllm_internals.md §4.4).
  * a Responses follow-up through ``previous_response_id`` -> the previous input and output items ahead of the new
    input.
    why:  vLLM keeps the previous turn's output messages only, so a follow-up lost its reasoning and function
          calls; OpenAI's API treats ``previous_response_id`` as the previous input and output items.
  * the claimed request's ``temperature`` and ``top_p`` -> the values the recipe reports for it (thinking on:
    temperature 1.0 and, on V4.1, top_p at least 0.95; thinking off on V4.1: top_p 1.0), unless
    DEEPINFER_REQUEST_SAMPLING=1.
    why:  the official API ignores both in thinking mode; vLLM built the sampling parameters from the values
          sent, so a greedy thinking request was greedy here and sampled there.
  how:  each endpoint handler reads the JSON body it was given (FastAPI keeps the bytes it parsed) and claims
        the request object vLLM renders for the codec of its API, in a context variable of the request's task:
        Chat claims its own request; Responses claims it in ``render_responses``, with the stored history ahead
        of the input; Messages claims the chat request vLLM converts it into. The render endpoints
        (``--enable-scale-out``), whose token ids a cache-aware router matches prefixes on, claim theirs the same
        way; the Responses one, whose handler is not given the HTTP request, through its route
        (vllm/entrypoints/scale_out/render/api_router.py: the route's endpoint, wrapped, replaces it in the
        router before the app copies its routes). ``preprocess_chat`` renders a
        claimed request with the claimed codec, hands the prompt to the renderer vLLM calls next (``PRERENDERED``
        in vllm/tokenizer.py), sets the request's sampling values vLLM reads next, and gives vLLM the prompt's
        images as one chat message to fetch and decode. The Responses render's messages, which vLLM's store
        keeps for a follow-up, are the input items. Other renderers, and requests vLLM builds itself (its
        built-in tool loop, its thinking probe, offline ``LLM.chat``), take vLLM's path unchanged.
  remove when: vLLM lets a renderer render a request of each API from its body.
  * a Messages request's ``thinking.budget_tokens`` -> not vLLM's thinking-token budget.
    why:  the official API reads the budget nowhere; vLLM would end the reasoning there, or, with no reasoning
          config, refuse the request.
  limits: vLLM's request models run before any of this: a body they refuse never reaches a codec.
          patch_request_models lets through each such body the official package accepts that we know of (its
          entries below), and patch_validation_errors gives a refused body the codec's refusal where the codec
          refuses it too; another body the official package accepts would be vLLM's 400.
  tested: integration_tests/vllm/test_api_codecs.py (served prompts equal the recipe's for generated requests of
          the three APIs, images included; refusals carry the recipe's message); integration_tests/vllm/
          test_routing.py (the render endpoints' ids are the codecs', in all three APIs);
          tests/vllm/test_api_codecs.py
          (the codec requests, the history, the thinking switches); integration_tests/vllm/test_api.py (a
          follow-up's prompt and answer equal those of the same history sent explicitly; a greedy thinking
          request samples, reproducibly under a seed, and a greedy non-thinking one stays greedy).

patch_request_models (vllm/entrypoints/generate/base/protocol.py, ResponseFormat; vllm/entrypoints/anthropic/
                      protocol.py, AnthropicContentBlock and AnthropicOutputConfig; the chat and completion
                      protocols' ``structured_outputs_from_response_format``; the chat and responses protocols'
                      request models; vllm/entrypoints/anthropic/protocol.py, AnthropicThinkingConfigEnabled and
                      AnthropicMessagesRequest; vllm/entrypoints/anthropic/serving.py, AnthropicServingMessages.
                      create_messages and count_tokens)
  * ``ResponseFormat.type`` -> also ``regex`` (its ``regex`` kept as an extra field), which constrains the output
    to that regex through vLLM's own ``structured_outputs.regex``.
  * ``AnthropicContentBlock.type`` -> also ``document``, ``server_tool_use`` and ``web_search_tool_result``;
    ``AnthropicOutputConfig.effort`` -> also ``none``, ``minimal`` and ``ultra``.
    why:  the official API accepts these (a regex format renders the prompt of plain text; a document block is
          stubbed in place as unsupported; the efforts map to thinking on or off) and vLLM's request models
          refused them with a 400 before the codec (patch_api_codecs) could render them. The official package
          refuses server-tool blocks with its own message, which the codec gives once the body reaches it.
  * ``AnthropicThinkingConfigEnabled.budget_tokens`` -> optional, any non-negative integer;
    ``AnthropicMessagesRequest`` -> without its check that the budget is below ``max_tokens``.
    why:  the official API accepts an enabled thinking config without a budget, or with any budget (it reads none;
          Anthropic's SDK clients send one); vLLM required one of at least 1024, below ``max_tokens``.
  * ``ChatCompletionRequest.check_tool_usage``, ``ResponsesRequest.check_tool_usage`` -> a body without tools
    (absent, null or ``[]``) whose tool choice is ``auto``, ``required`` or a named tool (a function, or in
    Responses a custom tool) validates, its
    choice read as ``auto`` and an empty tool list dropped; their refusal of a named tool_choice that names no
    declared tool (or an empty name) carries the official message ("Invalid value for 'tool_call': no function
    named ...").
    why:  Chat and Responses bodies meet these validators before any codec runs (a Messages body reaches its
          codec); the official package renders a tool choice without tools as ``auto`` (the prompt of no tools),
          where vLLM refused it, and refuses an undeclared name with its own message.
  * ``ResponsesRequest.check_tool_usage`` -> first drops the input items and tools the codec skips (any type
    outside deepinfer_recipe's ``RENDERED_ITEM_TYPES`` / ``RENDERED_TOOL_TYPES``) that OpenAI's types cannot
    read: a hosted tool's call with only its ids, a bare ``file_search`` tool; a message mixing an
    ``input_file`` or ``input_image`` part with ``output_text`` parts has those given as ``input_text``; a
    penalty or seed its model cannot hold is dropped; a namespace tool without a description gets an empty one.
    why:  the official package skips such entries (they cannot change the prompt), stubs a file in place and
          refuses an image in an assistant message with its own message, reading both text kinds alike; it reads
          no penalty or seed of a Responses request and needs no namespace description; vLLM refused the whole
          body (or, for an output message, whose content it validates lazily, lost the parts).
  how:  each Literal is widened, the validator is swapped in the model's pydantic decorators, and the models
        that contain them are rebuilt (pydantic copies a model's schema into the models that contain it). vLLM's
        routers are imported when the app is built, after the plugin has loaded, so their validators see the
        rebuilt models. The format conversion answers ``regex`` and defers to vLLM's otherwise. Where another
        model's renderer serves a Messages request (its conversion would drop a document block), the Messages
        handlers refuse the added values with a 400, as before.
  remove when: vLLM's request models accept these values and let a plugin word their refusals.
  tested: integration_tests/vllm/test_api_codecs.py (a regex format constrains the answer and renders the
          recipe's prompt, a missing regex is the recipe's 400; a document block and the added efforts render the
          recipe's prompt; server-tool blocks are the official 400; an undeclared tool choice is the official
          400 in all three APIs; a tool choice without tools renders the recipe's prompt in all three; hosted
          entries vLLM cannot read and an assistant file beside its text render the recipe's prompt);
          integration_tests/vllm/test_request_models.py (the widened models; unlisted values still refused, and
          refused still for another model's renderer; a tool choice without tools is ``auto``; unreadable
          skipped entries dropped, readable ones kept, malformed rendered ones refused; the tool-choice
          message, vLLM's other refusals unchanged);
          tests/vllm/test_request_models.py (widening a Literal).

patch_validation_errors (vllm/entrypoints/serve/exception_handling/register.py, validation_exception_handler)
  * the refusal of a body vLLM's request models refuse, on a Chat Completions, Responses or Messages route of a
    server whose handler of that API renders with ours -> the codec's refusal (its message, a 400; Anthropic's
    error shape on the Messages routes) where the codec refuses the body too; vLLM's own refusal otherwise, and
    for a Responses follow-up (``previous_response_id``: the earlier items are in the server's store).
    why:  the official package refuses such bodies with its own message naming the field; vLLM's validation
          message listed pydantic's errors for every branch of its union types ("229 validation errors ...").
  how:  vLLM registers the handler when the app is built, after the plugin has loaded; the wrapper renders the
        body FastAPI parsed (the error's ``body``) with the route's codec.
  remove when: vLLM lets a renderer validate the requests it renders.
  tested: integration_tests/vllm/test_api_codecs.py (bodies both refuse get the recipe's message in all three
          APIs; generated requests the recipe refuses are refused with its message).

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
    from . import (patch_api_codecs, patch_arch_config, patch_request_models, patch_responses_store, patch_usage,
                   patch_validation_errors)

    # request_models before api_codecs: api_codecs imports the render router, which reads the request models
    applied = {"arch_config": patch_arch_config.apply(), "responses_store": patch_responses_store.apply(),
               "request_models": patch_request_models.apply(), "api_codecs": patch_api_codecs.apply(),
               "validation_errors": patch_validation_errors.apply(), "usage": patch_usage.apply()}
    return [name for name, done in applied.items() if done]
