"""Verify-cost table for verification scheduling: T_verify(B) from a profile.

The scheduler trades expected accepted tokens against step time, so it needs T_verify(B) for
every B it might choose (docs/dspark.md#scheduling). Engines profile it once at start-up for each captured
CUDA-graph size; the result is a *step function* (a batch is padded up to the next captured
size), flat while the step is memory-bound and rising once it is compute-bound (the knee).
Lookups therefore take the ceiling bucket at or below the capture limit and interpolate
linearly above it (eager mode), and the table is kept monotone in B.

All times are milliseconds. The synthetic curves (roofline knee, soft knee, jagged variants)
and the whole-step model the CPU simulator charges time with are in
benchmarks/dspark_research/cost_models.py; they build their tables with this ``CostTable``.
"""

from __future__ import annotations

import numpy as np


class CostTable:
    """Verify time T(B) in ms from measured points.

    sizes: strictly increasing batch-token counts; ms: the step time at each size.
    Sizes ≤ capture_limit are CUDA-graph buckets (ceiling lookup, a batch pays for its bucket);
    above it time is linear between points and extrapolated from the last two points.
    monotone=True replaces ms by its running maximum, so a noisy profile can never make a
    larger batch look cheaper.
    """

    def __init__(self, sizes, ms, capture_limit: int | None = None, monotone: bool = True):
        s = np.asarray(sizes)
        t = np.asarray(ms, dtype=np.float64)
        if s.ndim != 1 or t.shape != s.shape or s.size == 0:
            raise ValueError(f"sizes and ms must be equal-length 1-D arrays, got {list(s.shape)} and {list(t.shape)}")
        if not np.issubdtype(s.dtype, np.integer):
            raise TypeError(f"sizes must be integers (token counts), got dtype {s.dtype}")
        if s[0] < 1 or (np.diff(s) <= 0).any():
            raise ValueError("sizes must be positive and strictly increasing")
        if not np.isfinite(t).all() or (t <= 0).any():
            raise ValueError("ms must be positive and finite")
        limit = int(s[-1]) if capture_limit is None else int(capture_limit)
        if limit not in set(s.tolist()):
            raise ValueError(f"capture_limit={limit} must be one of the measured sizes")
        self.sizes = s.astype(np.int64)
        self.ms = np.maximum.accumulate(t) if monotone else t
        self.capture_limit = limit
        self._n_graph = int(np.searchsorted(self.sizes, limit, side="right"))

    def costs(self, batch_tokens) -> np.ndarray:
        """T(B) for an array of B ≥ 1."""
        b = np.asarray(batch_tokens)
        if b.size and b.min() < 1:
            raise ValueError(f"batch tokens must be >= 1, got {int(b.min())}")
        bf = b.astype(np.float64)
        out = np.empty(b.shape, dtype=np.float64)
        graph = b <= self.capture_limit
        out[graph] = self.ms[np.searchsorted(self.sizes[: self._n_graph], b[graph], side="left")]
        if (~graph).any():
            xs = self.sizes[self._n_graph - 1:].astype(np.float64)
            ys = self.ms[self._n_graph - 1:]
            if xs.size == 1:  # nothing measured above the limit: assume the roofline T ∝ B
                out[~graph] = ys[0] * bf[~graph] / xs[0]
            else:
                slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
                inside = np.interp(bf[~graph], xs, ys)
                beyond = ys[-1] + slope * (bf[~graph] - xs[-1])
                out[~graph] = np.where(bf[~graph] > xs[-1], beyond, inside)
        return out

    def __call__(self, batch_tokens: int) -> float:
        return float(self.costs(np.array([batch_tokens]))[0])


def measure_step_cost(model, sizes, context: int = 256, repeats: int = 5, seed: int = 0,
                      clock=None) -> CostTable:
    """T(B) of ``model`` (the core DeepseekV41ForCausalLM) on its own device: the median wall time of a forward of
    B new tokens over a cached context of ``context`` tokens, rolled back after each run so that every B is timed
    at the same length. One untimed run per size warms up. It times the model's forward only, not an engine's
    scheduling and sampling around it, so on an engine whose step overhead is large next to the forward the
    verify lengths it plans are too long; profile inside the engine there. ``clock``: seconds, time.perf_counter
    unless given."""
    import time

    import torch

    from ..models.deepseek_v41.kv_cache import SequenceCache

    clock = clock or time.perf_counter
    sizes = [int(b) for b in sizes]
    if not sizes or min(sizes) < 1 or context < 1 or repeats < 1:
        raise ValueError(f"need sizes >= 1, context >= 1 and repeats >= 1; got {sizes}, {context}, {repeats}")
    args = model.args
    device = model.embed.weight.device
    high = min(args.vocab_size, args.image_token_id)  # the image token needs pixels
    ids = torch.randint(3, high, (context + max(sizes),), generator=torch.Generator().manual_seed(seed))
    cache = SequenceCache(args, device, max_rollback=max(sizes))
    ms = []
    with torch.inference_mode():
        model(ids[:context].to(device), cache)
        for b in sizes:
            step = ids[context: context + b].to(device)
            times = []
            for run in range(repeats + 1):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = clock()
                model(step, cache)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                elapsed_ms = (clock() - start) * 1e3
                if run:
                    times.append(elapsed_ms)
                cache.rollback(context)
            ms.append(float(np.median(times)))
    return CostTable(sizes, ms)
