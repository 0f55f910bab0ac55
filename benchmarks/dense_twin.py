"""The serving benchmark's anchor: a dense Llama twin of the ``small`` preset that vLLM serves natively.

The twin has the preset's residual width, depth, attention shape (8 query heads of 128, one KV head), vocabulary
and untied head, and an SwiGLU MLP as wide as the expert width one token activates in the preset (its routed
experts per token plus the shared expert), so ``native / ours`` prices what the V4.1 machinery (mHC, compressed
and sparse attention, Engram, MoE routing, the plugin's ops) costs over a plain decoder of the same size on the
same vLLM. Pure config logic here; only ``write_twin_checkpoint`` needs torch and transformers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

TWIN_MAX_POSITIONS = 8192
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# vLLM's chat endpoint needs a template; the V4 tokenizer_config carries none (our plugin's tokenizer mode
# renders chats itself). This one wraps the user turn in the V4 role markers, so both servers see the same text.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}<｜User｜>"
                 "{% endif %}{{ message['content'] }}{% endfor %}<｜Assistant｜>")


def twin_config(preset: dict) -> dict:
    """``LlamaConfig`` keyword arguments for the dense twin of a V4.1 preset config (the preset's config.json)."""
    text = preset["text_config"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": text["hidden_size"],
        "num_hidden_layers": text["num_hidden_layers"],
        "num_attention_heads": text["num_attention_heads"],
        "num_key_value_heads": text["num_key_value_heads"],
        "head_dim": text["head_dim"],
        "intermediate_size": text["moe_intermediate_size"] * (text["num_experts_per_tok"]
                                                              + text["n_shared_experts"]),
        "hidden_act": "silu",
        "vocab_size": text["vocab_size"],
        "tie_word_embeddings": preset["tie_word_embeddings"],
        "max_position_embeddings": TWIN_MAX_POSITIONS,
        "rope_theta": text["rope_theta"],
        "rms_norm_eps": 1e-6,
        "bos_token_id": preset["bos_token_id"],
        "eos_token_id": preset["eos_token_id"],
        "pad_token_id": preset["pad_token_id"],
        "torch_dtype": "float32",
    }


def write_twin_checkpoint(out_dir: Path, preset: dict, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Random-weight fp32 HF checkpoint of the twin, with our checkpoint's tokenizer files (same prompt ids)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**twin_config(preset))).to(torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir
