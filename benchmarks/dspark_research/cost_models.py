"""Cost models for the simulator: synthetic verify-cost curves and the whole-step model it charges time with.

Engines profile a measured ``CostTable`` (deepinfer_plugins/dspark/cost_model.py) and plan with it directly; the
knee curves, the per-request-count table and the draft / overhead terms exist so the CPU simulator can sweep
operating points without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deepinfer_plugins.dspark.cost_model import CostTable

# vLLM's default cudagraph capture sizes up to 512 tokens: 1, 2, 4, 8..256 step 8, 272..512 step 16.
CAPTURE_SIZES: tuple[int, ...] = (1, 2, 4) + tuple(range(8, 257, 8)) + tuple(range(272, 513, 16))


class CostTable2D:
    """T(R, B): one ``CostTable`` per profiled request count.

    Different request counts hit different graphs and attention kernels even at equal B.
    ``at_requests(R)`` returns the table of the smallest profiled count ≥ R (ceiling, like the
    graph it would run in); above the largest count the largest table is used.
    """

    def __init__(self, request_counts, tables):
        r = np.asarray(request_counts)
        if r.ndim != 1 or r.size == 0 or len(tables) != r.size:
            raise ValueError("request_counts and tables must be non-empty and of equal length")
        if not np.issubdtype(r.dtype, np.integer) or r[0] < 1 or (np.diff(r) <= 0).any():
            raise ValueError("request_counts must be positive, strictly increasing integers")
        if not all(isinstance(t, CostTable) for t in tables):
            raise TypeError("tables must be CostTable instances")
        self.request_counts = r.astype(np.int64)
        self.tables = list(tables)

    def at_requests(self, num_requests: int) -> CostTable:
        if num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {num_requests}")
        i = int(np.searchsorted(self.request_counts, num_requests, side="left"))
        return self.tables[min(i, len(self.tables) - 1)]


def knee_cost_table(floor_ms: float, knee_tokens: int, *, shape: str = "roofline",
                    jitter: float = 0.0, seed: int = 0, sizes=CAPTURE_SIZES,
                    eager_sizes=(768, 1024, 1536, 2048, 3072, 4096)) -> CostTable:
    """Synthetic verify-cost curve with a knee, snapped to capture buckets (docs/dspark.md#simulator).

    roofline: T = floor · max(1, B / knee), flat while memory-bound, then T ∝ B
              (doubles at 2·knee).
    soft:     T = floor · sqrt(1 + (B / knee)²), rises gently before the knee, 41% above
              the floor at the knee, and approaches the roofline after it.
    jitter > 0 multiplies every captured bucket by an independent U(1 - jitter, 1 + jitter)
    factor before the running max: the "jagged" tables that break Θ's unimodality.
    """
    if floor_ms <= 0 or knee_tokens < 1:
        raise ValueError(f"need floor_ms > 0 and knee_tokens >= 1, got {floor_ms}, {knee_tokens}")
    if not 0 <= jitter < 1:
        raise ValueError(f"jitter must lie in [0, 1), got {jitter}")
    x = np.concatenate([np.asarray(sizes), np.asarray(eager_sizes)]).astype(np.int64)
    ratio = x / knee_tokens
    if shape == "roofline":
        t = floor_ms * np.maximum(1.0, ratio)
    elif shape == "soft":
        t = floor_ms * np.sqrt(1.0 + ratio**2)
    else:
        raise ValueError(f"shape must be 'roofline' or 'soft', got {shape!r}")
    if jitter:
        rng = np.random.default_rng(seed)
        n_graph = len(sizes)
        t[:n_graph] *= rng.uniform(1 - jitter, 1 + jitter, size=n_graph)
    return CostTable(x, t, capture_limit=int(sizes[-1]))


@dataclass(frozen=True)
class StepCostModel:
    """Whole engine step: T = draft_floor + draft_per_token·R·γ + T_verify(B) + c0 + c1·committed.

    The block is drafted in full before scheduling, so T_draft depends on R and γ only; it
    does not favour any ℓ but shifts Θ = τ/T, which moves the optimum, so the scheduler sees
    it. The per-committed-token overhead c1 is left out of the scheduler's cost on purpose:
    Θ = τ / (T0(B) + c1·τ) is maximised by the same plan as τ / T0(B).
    verify: a CostTable, or a CostTable2D for request-count-dependent profiles.
    """

    verify: CostTable | CostTable2D
    gamma: int
    draft_floor_ms: float = 0.0
    draft_ms_per_token: float = 0.0
    overhead_ms: float = 0.0
    overhead_ms_per_token: float = 0.0

    def __post_init__(self):
        if not isinstance(self.verify, (CostTable, CostTable2D)):
            raise TypeError("verify must be a CostTable or CostTable2D")
        for name in ("draft_floor_ms", "draft_ms_per_token", "overhead_ms", "overhead_ms_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def verify_table(self, num_requests: int) -> CostTable:
        if isinstance(self.verify, CostTable2D):
            return self.verify.at_requests(num_requests)
        return self.verify

    def draft_ms(self, num_requests: int) -> float:
        return self.draft_floor_ms + self.draft_ms_per_token * num_requests * self.gamma

    def for_scheduler(self, num_requests: int) -> "ShiftedCost":
        """B -> ms at this request count: draft + c0 + T_verify(B), the cost the scheduler ranks."""
        return ShiftedCost(self.verify_table(num_requests), self.draft_ms(num_requests) + self.overhead_ms)

    def step_ms(self, num_requests: int, batch_tokens: int, committed: int) -> float:
        return (self.for_scheduler(num_requests)(batch_tokens)
                + self.overhead_ms_per_token * committed)


@dataclass(frozen=True)
class ShiftedCost:
    """T(B) + offset, keeping the vectorised ``costs`` the schedulers use."""

    table: CostTable
    offset_ms: float

    def costs(self, batch_tokens) -> np.ndarray:
        return self.table.costs(batch_tokens) + self.offset_ms

    def __call__(self, batch_tokens: int) -> float:
        return self.table(batch_tokens) + self.offset_ms
