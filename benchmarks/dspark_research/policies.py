"""Verify-length baselines that only the simulator runs, measured against the engines' Algorithm B.

They live beside the simulator rather than in the runtime package, and share the runtime's input checks, sorted
path and budget search (deepinfer_plugins/dspark/length_policy.py), whose module doc states the layout and the
non-anticipation argument.
"""

from __future__ import annotations

import numpy as np

from deepinfer_plugins.dspark.length_policy import _as_survival, _eval_costs, _token_cap, allocate_top_k, search_budget


# --------------------------------------------------------------------------- uniform-L


def uniform_length_budget(values_by_position, num_requests: int, step_cost,
                          max_batch_tokens: int | None = None) -> int:
    """Budget R·L* for the uniform-L baseline: L* = argmax_L R(1 + A(L)) / T(R(1 + L)).

    values_by_position: [n, γ] stale survivals; A(L) sums their per-position means.
    """
    a = np.asarray(values_by_position, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError(f"values_by_position must be [rows, gamma], got shape {list(a.shape)}")
    if num_requests == 0 or a.shape[0] == 0:
        return 0
    gamma = a.shape[1]
    cap = _token_cap(num_requests, max_batch_tokens)
    max_len = gamma if cap is None else min(gamma, cap // num_requests)
    mean_a = np.concatenate([[0.0], np.cumsum(a.mean(axis=0))])[: max_len + 1]  # A(L), L = 0..
    lengths = np.arange(max_len + 1)
    theta = num_requests * (1 + mean_a) / _eval_costs(step_cost, num_requests * (1 + lengths))
    return int(np.argmax(theta)) * num_requests


# --------------------------------------------------------------------------- baselines


def fixed_lengths(num_drafted, k: int) -> np.ndarray:
    """Fixed-k: ℓ_r = min(k, γ_r) (k = 0 is plain decoding)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(f"k must be a non-negative int, got {k!r}")
    n = np.asarray(num_drafted, dtype=np.int64)
    return np.minimum(n, k)


def threshold_lengths(survival, num_drafted, threshold: float) -> np.ndarray:
    """Static threshold: ℓ_r = #{j : a_{r,j} ≥ threshold} (load-unaware; a is prefix-monotone)."""
    if not 0.0 <= float(threshold) <= 1.0:
        raise ValueError(f"threshold must lie in [0, 1], got {threshold!r}")
    a, _ = _as_survival(survival, num_drafted)
    return ((a >= threshold) & (a > 0)).sum(axis=1).astype(np.int64)


def oracle_lengths(accepted_if_full, num_drafted, step_cost, max_batch_tokens: int | None = None) -> np.ndarray:
    """Upper bound: knows m*_r, the drafts that *would* be accepted under full verification.

    Every verified row with j ≤ m*_r yields exactly one token and any other row yields
    nothing, so the oracle picks K = argmax (R + K) / T(R + K) over K ≤ Σ m*_r. It is
    anticipating by construction and only for measuring regret.
    """
    n = np.asarray(num_drafted, dtype=np.int64)
    m = np.asarray(accepted_if_full, dtype=np.int64)
    if m.shape != n.shape:
        raise ValueError(f"accepted_if_full shape {list(m.shape)} != num_drafted shape {list(n.shape)}")
    if m.size and (m.min() < 0 or (m > n).any()):
        raise ValueError("accepted_if_full must lie in [0, num_drafted]")
    gamma = int(n.max()) if n.size else 0
    sure = (np.arange(gamma)[None, :] < m[:, None]).astype(np.float64)  # [R, γ]
    k = search_budget(sure, n.size, step_cost, max_batch_tokens)
    return allocate_top_k(sure, n, k)
