"""Verify-length policies that only the simulator runs: Algorithm B and the baselines it is measured against.

No engine schedules with them yet (the engines call ``plan_verify_lengths``, Algorithm A), so they live beside the
simulator rather than in the runtime package. They share the runtime's input checks and sorted path
(deepinfer_plugins/dspark/length_policy.py), whose module doc states the layout and the non-anticipation argument
that the stale budget relies on.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from deepinfer_plugins.dspark.length_policy import (_as_survival, _eval_costs, _lengths_from_prefix, _token_cap,
                                                    admission_order)


# --------------------------------------------------------------------------- Algorithm B


def search_budget(values, num_requests: int, step_cost, max_batch_tokens: int | None = None) -> int:
    """Global argmax over K of (R + sum of the K largest values) / T(R + K).

    No early stop, so it finds the true optimum of a jagged T. Only safe when ``values`` do
    not come from the current draft block (stale confidences, or realised outcomes for the
    oracle). Ties go to the smaller K. On a step-function T the argmax already sits at the
    top of a bucket (τ grows while T is flat), so the budget already snaps to a captured bucket.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if num_requests == 0:
        return 0
    v = np.sort(np.asarray(values, dtype=np.float64).reshape(-1))[::-1]
    v = v[v > 0]
    cap = _token_cap(num_requests, max_batch_tokens)
    k_max = v.size if cap is None else min(v.size, cap)
    tau = np.cumsum(np.concatenate([[float(num_requests)], v[:k_max]]))
    theta = tau / _eval_costs(step_cost, num_requests + np.arange(k_max + 1))
    return int(np.argmax(theta))


def allocate_top_k(survival, num_drafted, budget: int | None) -> np.ndarray:
    """Admit the first ``budget`` entries of the sorted path (None = all of them).

    The caps per request are num_drafted (γ_r, or a graph's maximum query length).
    """
    a, n = _as_survival(survival, num_drafted)
    rows, _, _ = admission_order(a, n)
    if budget is None:
        k = rows.size
    else:
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 0:
            raise ValueError(f"budget must be a non-negative int or None, got {budget!r}")
        k = min(int(budget), rows.size)
    return _lengths_from_prefix(rows, k, a.shape[0])


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


class StaleBudget:
    """Algorithm B (docs/dspark.md#scheduling): budget from confidences ``lag`` steps old, allocation on current.

    An asynchronous engine must fix step t's batch shape before step t-1 finishes, so the
    budget K can only use confidences from step t-2; that also makes it lossless, because K
    does not depend on the current block. The current block only decides *which* K entries
    (top-K of current a's), which is non-anticipating by the rank argument in the module doc.

    budget_rule(stale_survival, num_requests, step_cost, max_batch_tokens) -> K;
    ``search_budget`` gives Algorithm B, ``uniform_length_budget`` the uniform-L baseline.
    Until ``lag`` steps of history exist the whole block is verified.
    """

    def __init__(self, budget_rule: str = "global", lag: int = 2):
        rules = {"global": self._global, "uniform": self._uniform}
        if budget_rule not in rules:
            raise ValueError(f"budget_rule must be one of {sorted(rules)}, got {budget_rule!r}")
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 1:
            raise ValueError(f"lag must be an int >= 1 (2 for a one-step-ahead engine), got {lag!r}")
        self.budget_rule = budget_rule
        self._rule = rules[budget_rule]
        self.lag = lag
        self._history: deque[np.ndarray] = deque(maxlen=lag)

    @staticmethod
    def _global(stale, num_requests, step_cost, max_batch_tokens):
        return search_budget(stale, num_requests, step_cost, max_batch_tokens)

    @staticmethod
    def _uniform(stale, num_requests, step_cost, max_batch_tokens):
        return uniform_length_budget(stale, num_requests, step_cost, max_batch_tokens)

    def reset(self) -> None:
        self._history.clear()

    def budget(self, num_requests: int, step_cost, max_batch_tokens: int | None = None) -> int | None:
        """K for the coming step, from the survivals seen ``lag`` steps ago (None: no history)."""
        if len(self._history) < self.lag:
            return None
        return self._rule(self._history[0], num_requests, step_cost, max_batch_tokens)

    def plan(self, survival, num_drafted, step_cost, max_batch_tokens: int | None = None) -> np.ndarray:
        a, n = _as_survival(survival, num_drafted)
        k = self.budget(a.shape[0], step_cost, max_batch_tokens)
        if k is None and max_batch_tokens is not None:
            k = _token_cap(a.shape[0], max_batch_tokens)
        lengths = allocate_top_k(a, n, k)
        self._history.append(a)
        return lengths


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
