"""The vision path: ViT tower over one image's patches, the 3x3 aligner into the LM width, and the image span.

An image reaches the language model as one span of ``n_h * (n_w + 1) + 2`` rows (docs/model.md#vision): the
learned ``image_start``, then each of the ``n_h`` rows of aligned embeddings followed by ``image_newline``, then
``image_end``; every position of the span carries ``image_token_id``. The tower attends over the whole image at
once (bidirectional), so it runs once per image, before the language model; engines cache its output as the
image's embeddings and hand the LM whichever rows of the span a chunk covers. Module names mirror the checkpoint
(``vision.*``, ``aligner.*``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ... import ops
from .args import VisionArgs


class VisionInputError(ValueError):
    """Pixels or a patch grid that do not describe one image the tower can encode."""


class VisionLinear(nn.Module):
    """A float (bf16-stored) projection with an optional bias: the tower's and the aligner's GEMMs."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.dense_linear(x, self.weight, self.bias)


class VisionRMSNorm(nn.Module):
    """RMSNorm with an fp32 weight (stored fp32 in the release) and the tower's own eps."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps).to(x.dtype)


def rope_2d(n_h: int, n_w: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(cos, sin) [n_h * n_w, head_dim / 2] for patches in row-major order: the first quarter of the head's
    channels turns with the patch's row, the second with its column."""
    rope_dim = head_dim // 2
    inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim)
    rows = torch.arange(n_h, device=device).repeat_interleave(n_w).float()
    cols = torch.arange(n_w, device=device).repeat(n_h).float()
    angles = torch.cat((rows[:, None] * inv_freq, cols[:, None] * inv_freq), dim=-1)
    return angles.cos(), angles.sin()


def rotate_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [P, H, D] rotated as pairs (channel i, channel i + D/2) by the angles of its patch, in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, args: VisionArgs, dtype: torch.dtype):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.wqkv = VisionLinear(args.hidden_size, 3 * args.hidden_size, True, dtype)
        self.wo = VisionLinear(args.hidden_size, args.hidden_size, True, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [P, dim] -> [P, dim]: every patch of the image attends to every other."""
        q, k, v = (t.unflatten(-1, (self.n_heads, -1)) for t in self.wqkv(x).chunk(3, dim=-1))
        out = ops.bidirectional_attention(rotate_half_split(q, cos, sin), rotate_half_split(k, cos, sin), v)
        return self.wo(out.flatten(1))


class VisionMLP(nn.Module):
    """SwiGLU without biases; ``w1`` holds the gate rows, then the up rows."""

    def __init__(self, args: VisionArgs, dtype: torch.dtype):
        super().__init__()
        self.w1 = VisionLinear(args.hidden_size, 2 * args.intermediate_size, False, dtype)
        self.w2 = VisionLinear(args.intermediate_size, args.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, args: VisionArgs, dtype: torch.dtype):
        super().__init__()
        self.norm1 = VisionRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = VisionAttention(args, dtype)
        self.norm2 = VisionRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = VisionMLP(args, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """Patches of one image -> one feature per patch (pre-norm blocks, 2-D RoPE, final norm)."""

    def __init__(self, args: VisionArgs, dtype: torch.dtype):
        super().__init__()
        self.args = args
        self.patch_embed = nn.Module()
        self.patch_embed.proj = VisionLinear(args.patch_dim, args.hidden_size, True, dtype)
        self.blocks = nn.ModuleList(VisionBlock(args, dtype) for _ in range(args.num_hidden_layers))
        self.norm = VisionRMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """patches [n_h * n_w, 3, p, p] (or flattened [n_h * n_w, 3 * p * p]), row-major -> [n_h * n_w, dim]."""
        x = self.patch_embed.proj(patches.flatten(1))
        cos, sin = rope_2d(n_h, n_w, self.args.head_dim, self.args.rope_theta, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nn.Module):
    """Merges each 3x3 cell of patch features (zero-padded at the bottom and right edges) into one LM
    embedding: w2(gelu(w1(cell)))."""

    def __init__(self, args: VisionArgs, lm_dim: int, dtype: torch.dtype):
        super().__init__()
        self.ratio = args.downsample_ratio
        self.w1 = VisionLinear(args.hidden_size * self.ratio ** 2, lm_dim, True, dtype)
        self.w2 = VisionLinear(lm_dim, lm_dim, True, dtype)

    def forward(self, features: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """features [n_h * n_w, dim] -> [ceil(n_h / r) * ceil(n_w / r), lm_dim], cells row-major."""
        r = self.ratio
        grid = features.view(n_h, n_w, -1).permute(2, 0, 1)  # [dim, n_h, n_w]
        grid = F.pad(grid, (0, -n_w % r, 0, -n_h % r))
        # a cell's vector lists channel by channel its r x r values (row-major within the cell)
        cells = F.unfold(grid[None], r, stride=r)[0].t()  # [cells, dim * r * r]
        return self.w2(F.gelu(self.w1(cells)))


def llm_grid(n_h: int, n_w: int, downsample_ratio: int) -> tuple[int, int]:
    """Patch grid -> (rows, columns) of image embeddings the language model sees."""
    return -(-n_h // downsample_ratio), -(-n_w // downsample_ratio)


def image_span(embeddings: torch.Tensor, rows: int, cols: int, start: torch.Tensor, newline: torch.Tensor,
               end: torch.Tensor) -> torch.Tensor:
    """embeddings [rows * cols, d] -> the span [rows * (cols + 1) + 2, d]: start, each row then a newline, end."""
    lines = torch.cat((embeddings.view(rows, cols, -1), newline.to(embeddings.dtype).expand(rows, 1, -1)), dim=1)
    return torch.cat((start.to(embeddings.dtype)[None], lines.flatten(0, 1), end.to(embeddings.dtype)[None]))


def check_patches(patches: torch.Tensor, n_h: int, n_w: int, args: VisionArgs) -> None:
    if n_h < 1 or n_w < 1:
        raise VisionInputError(f"patch grid must be positive, got {n_h} x {n_w}")
    if not patches.is_floating_point():
        raise VisionInputError(f"patches must be a float tensor, got {patches.dtype}")
    if patches.shape[0] != n_h * n_w or patches[0].numel() != args.patch_dim:
        raise VisionInputError(f"a {n_h} x {n_w} grid of {args.patch_size}-pixel RGB patches needs patches of shape "
                               f"[{n_h * n_w}, 3, {args.patch_size}, {args.patch_size}], got {tuple(patches.shape)}")
