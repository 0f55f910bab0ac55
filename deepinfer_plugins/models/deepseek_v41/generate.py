"""Reference decoding loop (no engine): chunked prefill with bounded replay, then one token per step.

Engines own batching and scheduling; this loop exists for tests, the CLI and as the ground truth that served
outputs are compared against (greedy output through vLLM must equal ``generate`` token for token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import DeepseekV41Model
from .sampling import sample


@dataclass
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@torch.inference_mode()
def generate(model: DeepseekV41Model, prompt_ids: list[int], params: SamplingParams | None = None,
             prefill_chunk: int = 2048) -> list[int]:
    """Prompt token ids -> generated token ids (stop token included when hit)."""
    params = params or SamplingParams()
    if not prompt_ids:
        raise ValueError("prompt_ids is empty")
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    cache = model.new_cache()
    device = model.embed.weight.device
    prompt = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    for start in range(0, prompt.numel(), prefill_chunk):
        logits = model(prompt[start: start + prefill_chunk], cache, bounded_replay=True)
    out: list[int] = []
    for _ in range(params.max_new_tokens):
        token = sample(logits[-1], params.temperature, params.top_k, params.top_p, generator)
        out.append(token)
        if token in params.stop_token_ids:
            break
        logits = model(torch.tensor([token], device=device), cache)
    return out
