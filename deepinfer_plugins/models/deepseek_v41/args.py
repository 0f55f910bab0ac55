"""ModelArgs: the checkpoint's nested HF ``config.json`` as one plain, validated object.

The released config is nested (top level + ``text_config`` + ``vision_config``); every text field lives in
``ModelArgs`` under its HF name, the vision fields in ``VisionArgs`` (``ModelArgs.vision``). Derived facts (layer
roles, RoPE ranges, Engram primes) are computed once in ``__post_init__`` so the modules never re-derive them. An
inconsistent config raises ``ConfigError`` naming the key, because a wrong layer table silently produces a different
model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

PRESET_DIR = Path(__file__).parent / "presets"
INT64_MAX = np.iinfo(np.int64).max


class ConfigError(ValueError):
    """The config is missing a key, or its values contradict each other."""


@dataclass
class VisionArgs:
    """``vision_config``: the ViT, its 3x3 aligner and the image preprocessing budget (docs/model.md#vision)."""

    num_hidden_layers: int = 32
    hidden_size: int = 1024
    num_attention_heads: int = 16
    intermediate_size: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None
    rms_norm_eps: float = 1e-6
    """Not in the released config: the tower's norms use 1e-6 (docs/model.md#vision), unlike the LM's 1e-20."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"vision_config: hidden_size={self.hidden_size} is not divisible by "
                              f"num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 4:
            raise ConfigError(f"vision_config: head_dim={self.head_dim} must be a multiple of 4 for the 2-D RoPE "
                              "(half the head rotates, split between rows and columns)")
        if self.max_image_tokens < 4:
            raise ConfigError(f"vision_config: max_image_tokens={self.max_image_tokens} cannot hold one image "
                              "(start, one embedding, newline, end)")
        if self.patch_size < 1 or self.downsample_ratio < 1:
            raise ConfigError(f"vision_config: patch_size={self.patch_size} and downsample_ratio="
                              f"{self.downsample_ratio} must be positive")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        """RGB values of one patch."""
        return 3 * self.patch_size ** 2

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> "VisionArgs | None":
        """The vision tower the config describes, or None for a text-only config (absent or zero layers)."""
        if not config or not config.get("num_hidden_layers"):
            return None
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in config.items() if k in known})
        except TypeError as exc:
            raise ConfigError(f"vision_config: {exc}") from None


@dataclass
class ModelArgs:
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_lora_rank: int = 1024
    o_groups: int = 8
    hidden_act: str = "silu"
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=lambda: {
        "rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
        "original_max_position_embeddings": 65536})
    compress_rope_theta: float = 160000.0
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2304
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    sliding_window: int = 128
    compress_ratios: list = field(default_factory=lambda: [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0])
    kv_source_layer_ids: list = field(default_factory=lambda: [2, 8, 14, 20])
    index_source_layer_ids: list = field(default_factory=lambda: [2, 8, 14, 20, 24, 28, 32, 36])
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: list = field(default_factory=lambda: [1, 14])
    engram_num_embeddings: list = field(default_factory=lambda: [384006168, 384016682])
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: list = field(default_factory=lambda: [37, 38, 39])
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    # top-level fields
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    image_token_id: int = 129264
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    quantization_config: dict | None = None
    vision_config: dict | None = None
    """The nested ``vision_config``; ``vision`` holds it parsed, None when the model is text-only."""
    # Switches for facts the public sources leave uncertain
    # (docs/architecture.md#switches-for-what-public-sources-leave-uncertain).
    q_head_norm: bool = False
    """V4's weightless per-head q RMSNorm. Both ports of the V4.1 reference omit it (docs/model.md#attention)."""
    clamp_shared_expert: bool = False
    """Apply the SwiGLU clamp to the shared expert too. Ports disagree (docs/model.md#moe): NeMo clamps both, a
    third-party engine states the official code clamps routed experts only; we follow the spec's advice."""
    dspark_feature_reduction: str = "mean"
    """How the drafter reduces the 4 residual streams of each target layer (vLLM uses the mean;
    docs/dspark.md#the-v41-drafter)."""

    def __post_init__(self) -> None:
        self.validate()
        self.vision = VisionArgs.from_config(self.vision_config)
        n = self.num_hidden_layers
        self.layer_ratios = list(self.compress_ratios[:n])
        self.last_kv_source = max(self.kv_source_layer_ids) if self.kv_source_layer_ids else -1
        self.kv_source_of = [max((s for s in self.kv_source_layer_ids if s <= i), default=None) for i in range(n)]
        self.index_source_of = [
            max((s for s in self.index_source_layer_ids if s <= i), default=None) if self.layer_ratios[i] else None
            for i in range(n)
        ]
        for i, ratio in enumerate(self.layer_ratios):
            if ratio == 0:
                self.kv_source_of[i] = None
        self.engram_primes = engram_primes(self)
        self.engram_multipliers = [engram_multipliers(layer, self.engram_compressed_vocab_size,
                                                      self.engram_max_ngram_size) for layer in self.engram_layer_ids]

    # ---- validation ------------------------------------------------------------------------------------
    def validate(self) -> None:
        n = self.num_hidden_layers
        if len(self.compress_ratios) < n:
            raise ConfigError(f"compress_ratios has {len(self.compress_ratios)} entries, "
                              f"need at least num_hidden_layers={n}")
        bad = [r for r in self.compress_ratios if r not in (0, 1, 2)]
        if bad:
            raise ConfigError(f"compress_ratios: V4.1 layers use ratios 0, 1 or 2, got {sorted(set(bad))}")
        ratios = self.compress_ratios[:n]
        for key in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            ids = getattr(self, key)
            out = [i for i in ids if not 0 <= i < n]
            if out:
                raise ConfigError(f"{key}: layer ids {out} are outside 0..{n - 1}")
            if list(ids) != sorted(set(ids)):
                raise ConfigError(f"{key} must be strictly increasing, got {ids}")
        for src in self.kv_source_layer_ids:
            if ratios[src] == 0:
                raise ConfigError(f"kv_source_layer_ids: layer {src} has compress_ratios[{src}] = 0, "
                                  "a KV source must have a compressed branch")
        for i, ratio in enumerate(ratios):
            if ratio == 0:
                continue
            sources = [s for s in self.kv_source_layer_ids if s <= i]
            if not sources:
                raise ConfigError(f"kv_source_layer_ids: layer {i} has compress_ratios[{i}] = {ratio} "
                                  "but no KV source layer at or before it")
            if ratios[sources[-1]] != ratio:
                raise ConfigError(f"kv_source_layer_ids does not match compress_ratios: layer {i} (ratio {ratio}) "
                                  f"would reuse layer {sources[-1]} (ratio {ratios[sources[-1]]})")
            if not [s for s in self.index_source_layer_ids if s <= i]:
                raise ConfigError(f"index_source_layer_ids: layer {i} has no index source at or before it")
        missing = [s for s in self.kv_source_layer_ids if s not in self.index_source_layer_ids]
        if missing:
            raise ConfigError(f"index_source_layer_ids must contain every KV source layer; missing {missing}")
        for s in self.index_source_layer_ids:
            if ratios[s] == 0:
                raise ConfigError(f"index_source_layer_ids: layer {s} has compress_ratios[{s}] = 0")
        if self.candidate_source_layer_id is not None and \
                self.candidate_source_layer_id not in self.kv_source_layer_ids:
            raise ConfigError(f"candidate_source_layer_id {self.candidate_source_layer_id} "
                              "must be one of kv_source_layer_ids")
        if self.num_key_value_heads != 1:
            raise ConfigError(f"num_key_value_heads must be 1 (single latent MQA), got {self.num_key_value_heads}")
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                              f"o_groups={self.o_groups}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and fit head_dim and "
                              "index_head_dim")
        for key, block in (("head_dim", 32), ("index_head_dim", 32), ("head_dim", 16)):
            size = getattr(self, key)
            if size > block and size % block:
                raise ConfigError(f"{key}={size} must be a multiple of the {block}-channel quantisation block")
        if self.scoring_func != "sqrtsoftplus":
            raise ConfigError(f"scoring_func={self.scoring_func!r}: only 'sqrtsoftplus' is V4.1")
        if self.topk_method != "noaux_tc":
            raise ConfigError(f"topk_method={self.topk_method!r}: only 'noaux_tc' is V4.1")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act={self.hidden_act!r}: only 'silu' is supported")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ConfigError(f"engram_num_embeddings has {len(self.engram_num_embeddings)} entries for "
                              f"{len(self.engram_layer_ids)} engram_layer_ids")
        primes = engram_primes(self)
        for layer, rows, layer_primes in zip(self.engram_layer_ids, self.engram_num_embeddings, primes):
            if sum(layer_primes) != rows:
                raise ConfigError(f"engram_num_embeddings: layer {layer} has {rows} rows but its "
                                  f"{len(layer_primes)} bucket primes sum to {sum(layer_primes)}")
        if self.engram_pad_token_id >= self.vocab_size:
            raise ConfigError(f"engram_pad_token_id={self.engram_pad_token_id} is outside the vocabulary")
        if self.dspark_feature_reduction not in ("mean", "sum", "stream0"):
            raise ConfigError(f"dspark_feature_reduction={self.dspark_feature_reduction!r}: "
                              "expected 'mean', 'sum' or 'stream0'")
        factor = self.rope_scaling.get("factor") if self.rope_scaling else None
        if self.rope_scaling and self.rope_scaling.get("rope_type", self.rope_scaling.get("type")) != "yarn":
            raise ConfigError(f"rope_scaling: only YaRN is used by V4.1, got {self.rope_scaling}")
        if factor is not None and factor <= 0:
            raise ConfigError(f"rope_scaling.factor must be positive, got {factor}")

    # ---- derived sizes ---------------------------------------------------------------------------------
    @property
    def role_names(self) -> list[str]:
        """Per-layer role: swa, full, reindex or reuse (docs/model.md#layers-and-roles)."""
        roles = []
        for i, ratio in enumerate(self.layer_ratios):
            if ratio == 0:
                roles.append("swa")
            elif i in self.kv_source_layer_ids:
                roles.append("full")
            elif i in self.index_source_layer_ids:
                roles.append("reindex")
            else:
                roles.append("reuse")
        return roles

    def uses_candidates(self, layer: int) -> bool:
        c = self.candidate_source_layer_id
        return c is not None and layer in self.index_source_layer_ids and layer > c

    def yarn_range(self) -> tuple[int, int]:
        """(low, high) frequency indices of the YaRN ramp for the compressed layers' RoPE."""
        rs = self.rope_scaling
        rd, theta = self.qk_rope_head_dim, self.compress_rope_theta
        original = rs["original_max_position_embeddings"]

        def index(rotations: float) -> float:
            return rd * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(index(rs["beta_fast"])), 0)
        high = min(math.ceil(index(rs["beta_slow"])), rd - 1)
        return low, high

    def kv_bytes_per_token(self) -> float:
        """Persistent (context-proportional) cache bytes per token: compressed NVFP4 KV + MXFP4 index keys."""
        nvfp4_entry = self.head_dim // 2 + self.head_dim // 16  # packed E2M1 + one E4M3 scale per 16
        mxfp4_key = self.index_head_dim // 2 + self.index_head_dim // 32
        return sum((nvfp4_entry + mxfp4_key) / self.layer_ratios[s] for s in self.kv_source_layer_ids)

    # ---- construction ----------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: dict[str, Any], **overrides: Any) -> "ModelArgs":
        if "text_config" not in config:
            raise ConfigError("config.json has no 'text_config': expected the nested V4.1 layout "
                              "(model_type 'deepseek_v41')")
        if config.get("model_type") not in ("deepseek_v41", None):
            raise ConfigError(f"model_type={config.get('model_type')!r}: this model implements 'deepseek_v41'")
        known = {f.name for f in fields(cls)}
        merged = {k: v for k, v in config.items() if k in known}
        merged.update({k: v for k, v in config["text_config"].items() if k in known})
        merged.update(overrides)
        try:
            return cls(**merged)
        except TypeError as exc:
            raise ConfigError(f"config.json: {exc}") from None

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> "ModelArgs":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_hf_config(config, **overrides)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "ModelArgs":
        """Named configs next to each other: 'full' (the release), 'tiny' and 'tiny-vocab256'
        (docs/model.md#test-configurations), 'small'."""
        return cls.from_hf_config(preset_config(name), **overrides)


PRESETS = ("full", "tiny", "tiny-vocab256", "small")


def preset_config(name: str) -> dict[str, Any]:
    path = PRESET_DIR / f"{name}.json"
    if not path.exists():
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return json.loads(path.read_text())


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def engram_primes(args: ModelArgs) -> list[list[int]]:
    """Bucket primes per Engram layer, [order 2 heads.., order 3 heads.., ...]; never reused across layers."""
    primes, last = [], args.engram_vocab_size - 1
    per_layer = (args.engram_max_ngram_size - 1) * args.engram_n_heads
    for _ in args.engram_layer_ids:
        layer = []
        while len(layer) < per_layer:
            last += 1
            if _is_prime(last):
                layer.append(last)
        primes.append(layer)
    return primes


def engram_multipliers(layer_id: int, compressed_vocab: int, count: int) -> list[int]:
    """Odd per-layer hash multipliers, seeded by the layer id (docs/model.md#hash)."""
    rng = np.random.default_rng(10007 * layer_id)
    u = rng.integers(0, (INT64_MAX // compressed_vocab) // 2, size=count, dtype=np.int64)
    return [int(2 * v + 1) for v in u]
