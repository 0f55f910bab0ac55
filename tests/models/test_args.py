"""ModelArgs: derived facts of the released config, and inconsistent configs rejected by key name."""

import copy

import pytest

from deepinfer_plugins.models.deepseek_v41.args import ConfigError, ModelArgs, preset_config


def test_full_config_kv_budget_is_890_bytes_per_token():
    assert ModelArgs.preset("full").kv_bytes_per_token() == 890


def test_full_config_yarn_range():
    assert ModelArgs.preset("full").yarn_range() == (15, 25)
    assert ModelArgs.preset("tiny-vocab256").yarn_range() == (0, 1)


def test_full_config_engram_primes_and_multipliers():
    args = ModelArgs.preset("full")
    assert [sum(p) for p in args.engram_primes] == [384006168, 384016682]
    assert args.engram_primes[0][:3] == [16000057, 16000079, 16000081]
    assert args.engram_primes[1][-2:] == [16000879, 16000889]
    assert args.engram_multipliers == [
        [76632096046245, 4839876093313, 35959672319349, 73987337458391],
        [67716810739261, 51510806800915, 30921347202721, 82619226485591],
    ]


def test_tiny_layer_roles():
    args = ModelArgs.preset("tiny-vocab256")
    assert args.role_names == ["swa", "swa", "full", "reuse", "full", "reuse", "reindex", "reuse"]
    assert args.engram_primes == [[53, 59, 61, 67, 71, 73], [79, 83, 89, 97, 101, 103]]
    assert [args.uses_candidates(i) for i in range(8)] == [False] * 6 + [True, False]


def test_full_layer_roles_follow_the_release():
    roles = ModelArgs.preset("full").role_names
    assert [i for i, r in enumerate(roles) if r == "full"] == [2, 8, 14, 20]
    assert [i for i, r in enumerate(roles) if r == "reindex"] == [24, 28, 32, 36]


def _broken(**text_changes):
    config = copy.deepcopy(preset_config("tiny-vocab256"))
    config["text_config"].update(text_changes)
    return config


@pytest.mark.parametrize("changes, key", [
    ({"kv_source_layer_ids": [2, 5]}, "kv_source_layer_ids"),
    ({"kv_source_layer_ids": [3, 4]}, "kv_source_layer_ids"),
    ({"engram_layer_ids": [1, 9]}, "engram_layer_ids"),
    ({"engram_num_embeddings": [384, 553]}, "engram_num_embeddings"),
    ({"engram_num_embeddings": [384]}, "engram_num_embeddings"),
    ({"compress_ratios": [0, 0, 2]}, "compress_ratios"),
    ({"compress_ratios": [0, 0, 4, 4, 1, 1, 1, 1]}, "compress_ratios"),
    ({"index_source_layer_ids": [2, 6]}, "index_source_layer_ids"),
    ({"candidate_source_layer_id": 6}, "candidate_source_layer_id"),
    ({"scoring_func": "sigmoid"}, "scoring_func"),
    ({"num_attention_heads": 5}, "num_attention_heads"),
])
def test_inconsistent_config_is_rejected_naming_the_key(changes, key):
    with pytest.raises(ConfigError, match=key):
        ModelArgs.from_hf_config(_broken(**changes))


def test_flat_config_is_rejected():
    with pytest.raises(ConfigError, match="text_config"):
        ModelArgs.from_hf_config({"model_type": "deepseek_v41", "hidden_size": 64})


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset"):
        ModelArgs.preset("huge")


def test_vision_config_is_parsed_and_checked():
    vision = ModelArgs.preset("full").vision
    assert (vision.num_hidden_layers, vision.head_dim, vision.patch_dim, vision.min_pixels) == (32, 64, 588, 544 ** 2)
    config = preset_config("tiny")
    config["vision_config"]["num_hidden_layers"] = 0
    assert ModelArgs.from_hf_config(config).vision is None  # a text-only config builds no tower
    for change, key in (({"num_attention_heads": 5}, "num_attention_heads"), ({"hidden_size": 24}, "head_dim"),
                        ({"max_image_tokens": 3}, "max_image_tokens")):
        config = preset_config("tiny")
        config["vision_config"].update(change)
        with pytest.raises(ConfigError, match=f"vision_config: .*{key}"):
            ModelArgs.from_hf_config(config)
