"""The serving benchmark's dense twin has the widths issue 25 states, taken from the small preset where they
correspond: hidden_size, num_hidden_layers, num_attention_heads, head_dim, num_key_value_heads, vocab_size and
tie_word_embeddings one to one; the SwiGLU width is the expert width one token activates, moe_intermediate_size
x (num_experts_per_tok + n_shared_experts) = 256 x (2 + 1) = 768."""

import json
from pathlib import Path

from benchmarks.dense_twin import TWIN_MAX_POSITIONS, twin_config

SMALL = Path(__file__).resolve().parents[2] / "deepinfer_plugins/models/deepseek_v41/presets/small.json"


def test_twin_of_small_preset():
    preset = json.loads(SMALL.read_text())
    text = preset["text_config"]
    twin = twin_config(preset)
    assert twin["architectures"] == ["LlamaForCausalLM"]
    assert (twin["hidden_size"], twin["num_hidden_layers"], twin["num_attention_heads"], twin["head_dim"],
            twin["num_key_value_heads"], twin["intermediate_size"], twin["vocab_size"]) == (
        512, 8, 8, 128, 1, 768, 129280)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "num_key_value_heads",
                "vocab_size"):
        assert twin[key] == text[key], key
    assert twin["intermediate_size"] == text["moe_intermediate_size"] * (text["num_experts_per_tok"]
                                                                         + text["n_shared_experts"])
    assert twin["tie_word_embeddings"] is False and twin["torch_dtype"] == "float32"
    assert twin["max_position_embeddings"] == TWIN_MAX_POSITIONS >= 8192
    assert (twin["bos_token_id"], twin["eos_token_id"]) == (preset["bos_token_id"], preset["eos_token_id"])
