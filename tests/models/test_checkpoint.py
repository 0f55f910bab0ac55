"""Checkpoint I/O: the writer's official format round-trips exactly, and every broken checkpoint raises a
``CheckpointError`` that names the tensor and the shard (nothing half-loads)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deepinfer_plugins.models.deepseek_v41 import CheckpointError, DeepseekV41ForCausalLM
from deepinfer_plugins.models.deepseek_v41.loader import INDEX_FILE

TENSOR = "layers.3.attn.wq_b.weight"


@pytest.fixture
def ckpt(tiny256_dir, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(tiny256_dir, target)
    return target


def index(path):
    return json.loads((path / INDEX_FILE).read_text())


def shard_of(path, name):
    return path / index(path)["weight_map"][name]


def rewrite(path, name, change):
    """Apply ``change(tensors) -> tensors`` to the shard holding ``name`` and keep the index in step."""
    file = shard_of(path, name)
    tensors = change(load_file(str(file)))
    save_file(tensors, str(file), metadata={"format": "pt"})
    data = index(path)
    data["weight_map"] = {n: f for n, f in data["weight_map"].items() if f != file.name}
    data["weight_map"].update({n: file.name for n in tensors})
    (path / INDEX_FILE).write_text(json.dumps(data))
    return file.name


def test_round_trip_is_exact(tiny256_dir):
    model = DeepseekV41ForCausalLM.from_pretrained(tiny256_dir)
    state = model.state_dict()
    for name, file in index(tiny256_dir)["weight_map"].items():
        with safe_open(str(tiny256_dir / file), framework="pt") as f:
            stored = f.get_tensor(name)
        assert stored.dtype == state[name].dtype, name
        assert torch.equal(stored.view(torch.uint8), state[name].view(torch.uint8)), name


def test_official_formats_are_used(tiny256_dir):
    with safe_open(str(shard_of(tiny256_dir, TENSOR)), framework="pt") as f:
        assert f.get_tensor(TENSOR).dtype == torch.float8_e4m3fn
    expert = "layers.2.ffn.experts.0.w1.weight"
    with safe_open(str(shard_of(tiny256_dir, expert)), framework="pt") as f:
        assert f.get_tensor(expert).dtype == torch.int8 and f.get_tensor(expert).shape == (32, 32)
    with safe_open(str(shard_of(tiny256_dir, expert)), framework="pt") as f:
        assert f.get_tensor(expert.replace("weight", "scale")).dtype == torch.float8_e8m0fnu
    config = json.loads((tiny256_dir / "config.json").read_text())
    assert config["text_config"]["model_type"] == "deepseek_v41_text" and "vision_config" in config
    assert len(set(index(tiny256_dir)["weight_map"].values())) == 2


def test_missing_tensor(ckpt):
    rewrite(ckpt, TENSOR, lambda t: {n: v for n, v in t.items() if n != TENSOR})
    with pytest.raises(CheckpointError, match=f"missing tensor '{TENSOR}'"):
        DeepseekV41ForCausalLM.from_pretrained(ckpt)


def test_tensor_listed_in_index_but_absent_from_its_shard(ckpt):
    file = shard_of(ckpt, TENSOR)
    tensors = {n: v for n, v in load_file(str(file)).items() if n != TENSOR}
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"missing tensor '{TENSOR}'.*{file.name}"):
        DeepseekV41ForCausalLM.from_pretrained(ckpt)


def test_unexpected_tensor(ckpt):
    extra = "layers.0.attn.bogus.weight"
    file = rewrite(ckpt, TENSOR, lambda t: {**t, extra: torch.zeros(2)})
    with pytest.raises(CheckpointError, match=f"unexpected tensor '{extra}' in {file}"):
        DeepseekV41ForCausalLM.from_pretrained(ckpt)


def test_wrong_shape(ckpt):
    file = rewrite(ckpt, TENSOR, lambda t: {**t, TENSOR: t[TENSOR][:64]})
    with pytest.raises(CheckpointError, match=rf"'{TENSOR}' in {file}: shape \(64, 16\).*\(128, 16\)"):
        DeepseekV41ForCausalLM.from_pretrained(ckpt)


def test_wrong_dtype(ckpt):
    file = rewrite(ckpt, TENSOR, lambda t: {**t, TENSOR: t[TENSOR].to(torch.bfloat16)})
    with pytest.raises(CheckpointError, match=f"'{TENSOR}' in {file}: dtype torch.bfloat16"):
        DeepseekV41ForCausalLM.from_pretrained(ckpt)


def test_truncated_shard(ckpt):
    file = shard_of(ckpt, TENSOR)
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{file.name}.*truncated"):
        DeepseekV41ForCausalLM.from_pretrained(ckpt)


def test_index_points_at_a_missing_file(ckpt):
    file = shard_of(ckpt, TENSOR)
    file.unlink()
    with pytest.raises(CheckpointError, match=f"missing shard file '{file.name}'"):
        DeepseekV41ForCausalLM.from_pretrained(ckpt)


def test_config_does_not_match_the_weights(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["q_lora_rank"] = 32
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="shape .* but the config implies"):
        DeepseekV41ForCausalLM.from_pretrained(ckpt)


def test_inconsistent_config_is_reported_with_the_file(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["kv_source_layer_ids"] = [2, 5]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="config.json.*kv_source_layer_ids"):
        DeepseekV41ForCausalLM.from_pretrained(ckpt)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        DeepseekV41ForCausalLM.from_pretrained(tmp_path / "nope")
    tmp_path.joinpath("config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="text_config"):
        DeepseekV41ForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("name", ["vision.blocks.1.attn.wqkv.weight", "aligner.w1.bias", "image_newline"])
def test_missing_or_misshapen_vision_tensor_is_named(ckpt, name):
    file = rewrite(ckpt, name, lambda t: {**t, name: torch.zeros(3, dtype=torch.bfloat16)})
    with pytest.raises(CheckpointError, match=rf"'{name}' in {file}: shape \(3,\)"):
        DeepseekV41ForCausalLM.from_pretrained(ckpt)
    rewrite(ckpt, name, lambda t: {n: v for n, v in t.items() if n != name})
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        DeepseekV41ForCausalLM.from_pretrained(ckpt)


def test_text_only_checkpoint_serves_text_and_refuses_images(tiny256, tmp_path):
    """The writer draws the vision tensors last, so the text-only checkpoint holds the same text weights: its
    text logits must equal the multimodal model's."""
    from deepinfer_plugins.models.deepseek_v41 import ImageInputError
    from deepinfer_plugins.models.deepseek_v41.checkpoint import write_random_checkpoint

    path = write_random_checkpoint(tmp_path / "text_only", "tiny-vocab256", seed=0, text_only=True)
    assert not any(n.startswith(("vision.", "aligner.", "image_")) for n in index(path)["weight_map"])
    model = DeepseekV41ForCausalLM.from_pretrained(path)
    assert not model.has_vision and tiny256.has_vision
    ids = torch.arange(3, 40)
    torch.testing.assert_close(model(ids), tiny256(ids), atol=0, rtol=0)
    with pytest.raises(ImageInputError, match="no vision tower"):
        model(torch.tensor([3, 255, 4]))
    with pytest.raises(ImageInputError, match="no vision tower"):
        model.embed_image(torch.zeros(9, 3, 14, 14), 3, 3)
