#!/usr/bin/env python3
"""Write a tiny, random, official-format DeepSeek-V4.1 checkpoint using NeMo's module tree.

Independent cross-check generator for the differential-test oracle (it does NOT use
deepinfer's checkpoint writer). Run with the oracle interpreter:

    .venv-oracle/bin/python tests/oracle/make_nemo_checkpoint.py --out /tmp/v41_tiny [--seed 0]

What it does:
1. builds NeMo's ``DeepseekV41ForCausalLM`` for the tiny-vocab256 config (vision tower
   included) purely to obtain the exact set of tensor names/shapes, and exports them
   with NeMo's state-dict adapter (``to_hf``, no quantisation) under official names;
2. re-draws every tensor with this script's own seeded RNG (well-conditioned scales,
   non-trivial sinks/biases/mHC parameters so every feature is exercised);
3. quantises with this script's own encoder: FP8 E4M3 + E8M0 32x32 block scales for
   dense projections, FP4 E2M1 (two per int8 byte, even column = low nibble) + E8M0
   [out, in/32] scales for routed experts, FP8 + per-row E8M0 [rows, cols/32] scales for
   Engram tables;
4. adds ``image_pad`` and a few ``mtp.*`` draft tensors (which a V4.1 backbone loader
   must ignore), and writes 3 safetensors shards + ``model.safetensors.index.json`` +
   the nested ``config.json``.

No tokenizer is written: the tiny config has engram_compressed_vocab_size == vocab_size,
so consumers use the identity compressed-token map.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

TINY_CONFIG = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "image_token_id": 255,
    "tie_word_embeddings": False,
    "quantization_config": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0",
        "expert_dtype": "fp4",
    },
    "text_config": {
        "model_type": "deepseek_v41_text",
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "qk_rope_head_dim": 8,
        "q_lora_rank": 16,
        "o_lora_rank": 8,
        "o_groups": 2,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-20,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 64,
        },
        "compress_rope_theta": 160000.0,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "sliding_window": 8,
        "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1, 0, 0],
        "kv_source_layer_ids": [2, 4],
        "index_source_layer_ids": [2, 4, 6],
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 4,
        "candidate_source_layer_id": 4,
        "candidate_topk_blocks": 3,
        "candidate_block_size": 2,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "engram_layer_ids": [1, 3],
        "engram_num_embeddings": [384, 552],
        "engram_max_ngram_size": 4,
        "engram_vocab_size": 50,
        "engram_n_heads": 2,
        "engram_head_dim": 8,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 256,
        "num_nextn_predict_layers": 2,
        "dspark_block_size": 3,
        "dspark_noise_token_id": 250,
        "dspark_target_layer_ids": [5, 6, 7],
        "dspark_markov_rank": 8,
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
    },
    "vision_config": {
        "model_type": "deepseek_v41_vision",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "intermediate_size": 16,
        "patch_size": 14,
        "rope_theta": 10000.0,
        "downsample_ratio": 3,
        "max_image_tokens": 16,
        "min_pixels": 3136,
        "max_wh_ratio": None,
    },
}

FP8_DENSE = re.compile(
    r"(?:layers|mtp)\.\d+\.(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]"
    r"|engram\.wkv|main_proj)\.weight"
)
FP4_EXPERT = re.compile(r"(?:layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")
FP8_ROWWISE = re.compile(r"layers\.\d+\.engram\.embed\.weight")
FP32_KEYS = re.compile(
    r".*(?:hc_(?:attn|ffn)_(?:fn|base|scale)|attn\.attn_sink|ffn\.gate\.bias|ffn\.gate\.bias_vl"
    r"|compressor\.(?:wkv|wgate)\.weight|vision\.blocks\.\d+\.norm[12]\.weight|vision\.norm\.weight)$"
)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _pow2_ceil(x):
    import torch

    return torch.exp2(torch.ceil(torch.log2(x)))


def quant_fp8_block(w, block: int = 32):
    """[out, in] -> (e4m3 [out, in], e8m0 [ceil(out/32), ceil(in/32)])."""
    import torch
    import torch.nn.functional as F

    out_f, in_f = w.shape
    pr, pc = -out_f % block, -in_f % block
    wp = F.pad(w.float(), (0, pc, 0, pr))
    blocks = wp.view(wp.shape[0] // block, block, wp.shape[1] // block, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale = _pow2_ceil(amax / 448.0)
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:out_f, :in_f]
    q = (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu)


def quant_fp8_rowwise(w, block: int = 32):
    """[rows, cols] -> (e4m3 [rows, cols], e8m0 [rows, ceil(cols/32)])."""
    import torch
    import torch.nn.functional as F

    rows, cols = w.shape
    wp = F.pad(w.float(), (0, -cols % block))
    amax = wp.view(rows, -1, block).abs().amax(-1).clamp_min(1e-12)
    scale = _pow2_ceil(amax / 448.0)
    full = scale.repeat_interleave(block, 1)[:, :cols]
    q = (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu)


def quant_fp4_rowwise(w, block: int = 32):
    """[out, in] -> (int8 [out, in/2] packed E2M1, e8m0 [out, in/32]). Even column = low nibble."""
    import torch

    rows, cols = w.shape
    if cols % block:
        raise ValueError(f"FP4 expert matrix needs in % 32 == 0, got {w.shape}")
    g = w.float().view(rows, cols // block, block)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(1e-12)
    scale = _pow2_ceil(amax / 6.0)
    x = (g / scale).clamp(-6, 6).view(rows, cols)
    grid = torch.tensor(E2M1)
    mag = x.abs()
    dist = (mag.unsqueeze(-1) - grid).abs()
    best = dist.min(-1, keepdim=True).values
    # round-to-nearest, ties to the even code (even mantissa bit = even index)
    cand = dist == best
    tie = cand.sum(-1) > 1
    even_idx = torch.where(cand & (torch.arange(8) % 2 == 0), torch.arange(8), 99).min(-1).values
    idx = torch.where(tie, even_idx, dist.argmin(-1))
    code = idx | ((x < 0) & (idx > 0)).to(torch.long) << 3
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.view(rows, cols // block).to(torch.float8_e8m0fnu)


def build_official_state(seed: int) -> tuple[dict, dict]:
    import torch

    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41 import engram as nemo_engram
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    cfg = copy.deepcopy(TINY_CONFIG)
    text, vision = cfg.pop("text_config"), cfg.pop("vision_config")
    cfg.pop("model_type")
    text = dict(text, dtype="float32")
    cfg["dtype"] = "float32"
    config = DeepseekV41Config(text_config=text, vision_config=vision, **cfg)
    vocab = config.text_config.vocab_size
    nemo_engram._compressed_token_map = lambda _tok: (tuple(range(vocab)), vocab)
    backend = BackendConfig(
        attn="eager", linear="torch", rms_norm="torch_fp32", rope="torch", rope_fusion=False,
        experts="torch", dispatcher="torch", enable_hf_state_dict_adapter=True,
    )
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(config, backend=backend, tokenizer=object())
    names = model.state_dict_adapter.to_hf(model.state_dict())
    shapes = {k: tuple(v.shape) for k, v in names.items()}

    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0, mean=0.0):
        return torch.randn(*shape, generator=gen) * std + mean

    state = {}
    for key in sorted(shapes):
        shape = shapes[key]
        if key in ("embed.weight",):
            value = randn(*shape)
        elif key.endswith(("hc_attn_fn", "hc_ffn_fn")):
            value = randn(*shape, std=0.05)
        elif key.endswith(("hc_attn_base", "hc_ffn_base")):
            value = randn(*shape, std=0.5)
        elif key.endswith(("hc_attn_scale", "hc_ffn_scale")):
            value = randn(*shape, std=0.3, mean=1.0)
        elif key.endswith("attn.attn_sink"):
            value = randn(*shape, std=1.0)
        elif key.endswith(("ffn.gate.bias", "ffn.gate.bias_vl")):
            value = randn(*shape, std=0.1)
        elif key.endswith(("engram.q_weight", "engram.k_weight")):
            value = randn(*shape, std=0.2, mean=1.0)
        elif key.endswith("engram.embed.weight"):
            value = randn(*shape, std=1.0)
        elif len(shape) == 1:  # norms, biases, image delimiters
            value = randn(*shape, std=0.1, mean=1.0) if key.endswith("norm.weight") or "norm" in key else randn(
                *shape, std=0.1
            )
        elif len(shape) == 2:
            value = randn(*shape, std=shape[1] ** -0.5)
        else:
            raise ValueError(f"unexpected tensor rank for {key}: {shape}")
        state[key] = value
    return state, shapes


def add_extra_tensors(state: dict, seed: int) -> None:
    """Tensors present in official checkpoints that a V4.1 backbone loader must ignore."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    hidden = TINY_CONFIG["text_config"]["hidden_size"]
    state["image_pad"] = torch.randn(hidden, generator=gen)
    state["mtp.0.main_proj.weight"] = torch.randn(hidden, 3 * hidden, generator=gen) * (3 * hidden) ** -0.5
    state["mtp.0.main_norm.weight"] = torch.ones(hidden)
    state["mtp.0.attn_norm.weight"] = torch.ones(hidden)
    state["mtp.0.attn.wkv.weight"] = torch.randn(32, hidden, generator=gen) * hidden**-0.5
    state["mtp.1.norm.weight"] = torch.ones(hidden)
    state["mtp.0.ffn.experts.0.w1.weight"] = torch.randn(32, hidden, generator=gen) * hidden**-0.5


def quantise_and_cast(state: dict) -> dict:
    import torch

    out = {}
    for key, value in state.items():
        if FP4_EXPERT.fullmatch(key):
            q, s = quant_fp4_rowwise(value)
        elif FP8_DENSE.fullmatch(key):
            q, s = quant_fp8_block(value)
        elif FP8_ROWWISE.fullmatch(key):
            q, s = quant_fp8_rowwise(value)
        else:
            out[key] = value.to(torch.float32 if FP32_KEYS.fullmatch(key) else torch.bfloat16).contiguous()
            continue
        out[key] = q.contiguous()
        out[key.removesuffix(".weight") + ".scale"] = s.contiguous()
    return out


def write_checkpoint(tensors: dict, out_dir: Path, n_shards: int = 3) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    keys = sorted(tensors)
    weight_map, total = {}, 0
    for i in range(n_shards):
        name = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[i::n_shards]}
        save_file(part, str(out_dir / name), metadata={"format": "pt"})
        for k, v in part.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out_dir / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output checkpoint directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    state, _ = build_official_state(args.seed)
    add_extra_tensors(state, args.seed)
    tensors = quantise_and_cast(state)
    write_checkpoint(tensors, Path(args.out))
    n_scale = sum(k.endswith(".scale") for k in tensors)
    print(f"[make_nemo_checkpoint] wrote {len(tensors)} tensors ({n_scale} scales) to {args.out}")


if __name__ == "__main__":
    main()
