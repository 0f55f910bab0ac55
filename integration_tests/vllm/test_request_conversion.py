"""vLLM's parsed request objects reach the recipe under the API's wire names: vLLM keeps a response format's
schema in the field ``json_schema`` (alias ``schema``), and the recipe, as the official codec, refuses a
``json_schema`` format without ``schema``. Responses content parts, which vLLM passes on as they came, reach
the recipe's Chat Completions parser as the Chat parts they stand for."""

import pytest
from vllm.entrypoints.generate.base.protocol import ResponseFormat

from deepinfer_plugins.vllm.tokenizer import recipe_chat_request

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
          "additionalProperties": False}


def test_response_format_schema_keeps_its_wire_name():
    fmt = ResponseFormat.model_validate({"type": "json_schema",
                                         "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    request = recipe_chat_request([{"role": "user", "content": "hi"}], {}, None, fmt)
    assert request["response_format"] == {"type": "json_schema",
                                          "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


def test_responses_parts_become_the_chat_parts_they_stand_for():
    url = "data:image/png;base64,AAAA"
    content = [{"type": "input_text", "text": "look"}, {"type": "input_image", "image_url": url},
               {"type": "input_image", "image_url": url, "detail": "low"}]
    request = recipe_chat_request([{"role": "user", "content": content},
                                   {"role": "assistant", "content": [{"type": "output_text", "text": "a cat"}]}],
                                  {}, None, None)
    assert request["messages"][0]["content"] == [{"type": "text", "text": "look"},
                                                 {"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "image_url", "image_url": {"url": url, "detail": "low"}}]
    assert request["messages"][1]["content"] == [{"type": "text", "text": "a cat"}]


def test_python_side_image_objects_are_refused_with_a_message():
    content = [{"type": "image_embeds", "image_embeds": "…"}]
    with pytest.raises(ValueError, match="image_embeds"):
        recipe_chat_request([{"role": "user", "content": content}], {}, None, None)
