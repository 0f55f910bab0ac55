"""vLLM's parsed request objects reach the recipe under the API's wire names: vLLM keeps a response format's
schema in the field ``json_schema`` (alias ``schema``), and the recipe, as the official codec, refuses a
``json_schema`` format without ``schema``."""

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
