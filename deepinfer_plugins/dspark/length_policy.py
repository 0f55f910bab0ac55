"""Verify-length policies: how many drafted tokens of each request the target checks this step.

Every policy is a function of acceptance statistics and a step-cost curve, so the simulator and the
engines call the same code. Algorithm B (``StaleBudget``, the only policy with state) is what the
vLLM proposer runs: the simulator shows it never below fixed-k, where Algorithm A stops at the first
bucket boundary of a jagged cost table (docs/dspark.md). The baselines it is measured against, which
only the simulator runs, are in benchmarks/dspark_research/policies.py.

Shared layout (R requests, γ = block size):
  survival     float64 [R, γ]  a[r, j-1] = c[r,1]···c[r,j], prefix survival, non-increasing in j
  num_drafted  int64   [R]     γ_r ≤ γ positions drafted for request r (0 allowed);
                               entries at j ≥ γ_r are ignored
  step_cost    B -> ms         step time for B verified tokens (anchors included) at this R;
                               a ``cost_model`` table or any callable returning a positive float
  result       int64   [R]     verify lengths ℓ_r, 0 ≤ ℓ_r ≤ γ_r (target checks anchor + ℓ_r rows)

Objective (docs/dspark.md#scheduling): maximise Θ = τ / T(B) with B = Σ(1 + ℓ_r) and expected committed
tokens τ = Σ(1 + Σ_{j≤ℓ_r} a_{r,j}). Extending r from j-1 to j gains exactly a_{r,j}, and a is
non-increasing in j, so for any B the best plan takes the B - R largest a's. Sorting all (r, j)
by (-a, j, r) therefore keeps every request's admitted set a prefix, and the problem reduces to
choosing how far to walk along that one sorted path.

Non-anticipation: whether position k of request r is verified may depend on
x_{r,<k} and c_{r,≤k} but not on x_{r,k}, and c_{r,k+1} is a function of x_{r,k}. An entry's
rank in the sorted path depends only on entries ranked above it (r's own later entries always
rank below), so the safe policies decide on an entry from entries at or above it (early
stop), from earlier steps (stale budget), or from the entry alone (threshold).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

StepCost = Callable[[int], float]


# --------------------------------------------------------------------------- inputs


def _as_num_drafted(num_drafted, rows: int, gamma: int) -> np.ndarray:
    n = np.asarray(num_drafted)
    if n.shape != (rows,):
        raise ValueError(f"num_drafted must have shape [{rows}], got {list(n.shape)}")
    if n.size and not np.issubdtype(n.dtype, np.integer):
        raise TypeError(f"num_drafted must be integers, got dtype {n.dtype}")
    n = n.astype(np.int64)
    if n.size and (n.min() < 0 or n.max() > gamma):
        raise ValueError(f"num_drafted must lie in [0, {gamma}], got range [{n.min()}, {n.max()}]")
    return n


def _as_survival(survival, num_drafted) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(survival, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError(f"survival must be a [requests, gamma] array, got shape {list(a.shape)}")
    n = _as_num_drafted(num_drafted, a.shape[0], a.shape[1])
    live = np.arange(a.shape[1])[None, :] < n[:, None]  # [R, γ]
    a = np.where(live, a, 0.0)
    if np.isnan(a).any() or (a < 0).any() or (a > 1).any():
        raise ValueError("survival values must lie in [0, 1] (no NaN)")
    if (np.diff(a, axis=1) > 1e-12).any():
        raise ValueError("survival must be non-increasing along each row (it is a cumulative "
                         "product of conditional confidences); pass cumulative_survival(c)")
    return a, n


def cumulative_survival(confidences, num_drafted) -> np.ndarray:
    """Prefix survival a = cumprod(c) from conditional confidences c [R, γ].

    The confidence head predicts the *conditional* acceptance of position k given 1..k-1 were
    accepted; the scheduler needs the probability that the whole prefix survives.
    Positions at or beyond num_drafted[r] are set to 0.
    """
    c = np.asarray(confidences, dtype=np.float64)
    if c.ndim != 2:
        raise ValueError(f"confidences must be a [requests, gamma] array, got shape {list(c.shape)}")
    n = _as_num_drafted(num_drafted, c.shape[0], c.shape[1])
    live = np.arange(c.shape[1])[None, :] < n[:, None]
    c = np.where(live, c, 0.0)
    if np.isnan(c).any() or (c < 0).any() or (c > 1).any():
        raise ValueError("confidences must be probabilities in [0, 1] (no NaN)")
    return np.cumprod(c, axis=1)


def _eval_costs(step_cost, batch_tokens: np.ndarray) -> np.ndarray:
    """T(B) for an array of B; tables answer in one call, plain callables one B at a time."""
    if hasattr(step_cost, "costs"):
        t = np.asarray(step_cost.costs(batch_tokens), dtype=np.float64)
    elif callable(step_cost):
        t = np.array([float(step_cost(int(b))) for b in batch_tokens], dtype=np.float64)
    else:
        raise TypeError(f"step_cost must be callable B -> seconds, got {type(step_cost).__name__}")
    if t.shape != batch_tokens.shape:
        raise ValueError(f"step_cost returned shape {list(t.shape)} for {batch_tokens.size} batch sizes")
    bad = np.isnan(t) | (t <= 0)
    if bad.any():
        b = int(batch_tokens[np.flatnonzero(bad)[0]])
        raise ValueError(f"step_cost({b}) = {t[bad][0]!r}; step times must be positive "
                         "(use float('inf') for an infeasible batch size)")
    return t


def _token_cap(num_requests: int, max_batch_tokens) -> int | None:
    if max_batch_tokens is None:
        return None
    if isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, (int, np.integer)):
        raise TypeError(f"max_batch_tokens must be an int or None, got {max_batch_tokens!r}")
    if max_batch_tokens < num_requests:
        raise ValueError(f"max_batch_tokens={max_batch_tokens} is below the {num_requests} anchor "
                         "rows every decoding request needs; raise it or schedule fewer requests")
    return int(max_batch_tokens) - num_requests


# --------------------------------------------------------------------------- the sorted path


def admission_order(survival, num_drafted) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All (r, j) with a_{r,j} > 0, sorted by a descending; ties: smaller j, then smaller r.

    Returns (rows, positions, values), each [N]; positions are 0-based (j - 1). The tie rule
    keeps prefix order even when a confidence is exactly 1 (a_{r,j} = a_{r,j+1}).
    """
    a, _ = _as_survival(survival, num_drafted)
    rows, cols = np.nonzero(a > 0)
    vals = a[rows, cols]
    order = np.lexsort((rows, cols, -vals))  # last key is primary
    return rows[order], cols[order], vals[order]


def _lengths_from_prefix(rows: np.ndarray, n: int, num_requests: int) -> np.ndarray:
    return np.bincount(rows[:n], minlength=num_requests).astype(np.int64)


# --------------------------------------------------------------------------- Algorithm A


def algorithm_a(survival, num_drafted, step_cost, max_batch_tokens: int | None = None,
                envelope: bool = False) -> np.ndarray:
    """Greedy admission with early stop (paper Algorithm 1; docs/dspark.md#scheduling).

    Walk the sorted path from B = R; admit the next entry while Θ = τ / T(B) strictly improves,
    stop at the first entry that does not. The early stop is what makes it non-anticipating:
    the decision on an entry only looks at entries ranked at or above it, so position k is
    never chosen because of how good position k+1 looked. The price is that a step-shaped or
    jagged T(B) stops it at the first bucket boundary whose jump outweighs one token's gain
    (past the knee that is every boundary); Algorithm B searches globally instead.

    envelope=True is our variant for bucketed costs (not in the paper): the stop test uses
    the piecewise-linear curve through the bucket tops (the last B of each flat run of T),
    then the chosen B is filled up to the top of its bucket, where the extra rows are free.
    Both steps still only look at entries ranked at or above the one being decided, so the
    rule stays non-anticipating; with a flat or smooth T it equals Algorithm A.
    """
    a, n = _as_survival(survival, num_drafted)
    num_requests = a.shape[0]
    if num_requests == 0:
        return np.zeros(0, dtype=np.int64)
    rows, _, vals = admission_order(a, n)
    cap = _token_cap(num_requests, max_batch_tokens)
    n_max = vals.size if cap is None else min(vals.size, cap)
    batch = num_requests + np.arange(n_max + 1)  # B after admitting 0..n_max entries
    tau = np.cumsum(np.concatenate([[float(num_requests)], vals[:n_max]]))  # same rounding as a loop
    t = _eval_costs(step_cost, batch)
    tops = np.flatnonzero(np.r_[t[1:] > t[:-1], True])  # last B of each flat run of T
    use_envelope = envelope and np.isfinite(t).all()
    if use_envelope:
        t_stop = np.interp(np.arange(n_max + 1), tops, t[tops])
    else:
        t_stop = t
    theta = tau / t_stop
    drops = np.flatnonzero(theta[1:] <= theta[:-1])  # first entry that does not improve Θ
    best_n = int(drops[0]) if drops.size else n_max
    if use_envelope:  # the bucket is paid for: fill it
        best_n = int(tops[np.searchsorted(tops, best_n)])
    return _lengths_from_prefix(rows, best_n, num_requests)


def plan_verify_lengths(confidences: Sequence[Sequence[float]], step_cost: StepCost,
                        max_batch_tokens: int | None = None) -> list[int]:
    """Verify lengths for one engine step with Algorithm A (the stable entry point).

    confidences[r] lists request r's calibrated *conditional* acceptance probabilities
    c_{r,1..γ_r} for its drafted positions (may be empty); step_cost(B) is the step time for B
    verified tokens, anchors included; max_batch_tokens caps B. Returns ℓ_r per request.
    """
    if isinstance(confidences, (str, bytes)) or not hasattr(confidences, "__iter__"):
        raise TypeError(f"confidences must be a sequence of per-request sequences, "
                        f"got {type(confidences).__name__}")
    rows = []
    for r, row in enumerate(confidences):
        try:
            x = np.asarray(row, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise TypeError(f"confidences[{r}] must be a sequence of floats: {e}") from None
        if isinstance(row, (str, bytes)) or x.ndim != 1:
            raise TypeError(f"confidences[{r}] must be a 1-D sequence of floats, got {row!r}")
        rows.append(x)
    gamma = max((len(x) for x in rows), default=0)
    c = np.zeros((len(rows), gamma))
    for r, x in enumerate(rows):
        c[r, : len(x)] = x
    num_drafted = np.array([len(x) for x in rows], dtype=np.int64)
    if np.isnan(c).any() or (c < 0).any() or (c > 1).any():
        r = int(np.argwhere(np.isnan(c) | (c < 0) | (c > 1))[0, 0])
        raise ValueError(f"confidences[{r}] = {rows[r].tolist()} must be probabilities in [0, 1]")
    survival = cumulative_survival(c, num_drafted)
    return algorithm_a(survival, num_drafted, step_cost, max_batch_tokens).tolist()


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


class StaleBudget:
    """Algorithm B (docs/dspark.md#scheduling): budget from confidences ``lag`` steps old, allocation on current.

    An asynchronous engine must fix step t's batch shape before step t-1 finishes, so the
    budget K can only use confidences from step t-2; that also makes it lossless, because K
    does not depend on the current block. The current block only decides *which* K entries
    (top-K of current a's), which is non-anticipating by the rank argument in the module doc.

    budget_rule(stale_survival, num_requests, step_cost, max_batch_tokens) -> K: "global" (``search_budget``)
    is Algorithm B; the simulator passes its baselines' rules (uniform-L).
    Until ``lag`` steps of history exist the whole block is verified.
    """

    def __init__(self, budget_rule="global", lag: int = 2):
        if budget_rule == "global":
            budget_rule = search_budget
        elif not callable(budget_rule):
            raise ValueError(f"budget_rule must be 'global' or a callable, got {budget_rule!r}")
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 1:
            raise ValueError(f"lag must be an int >= 1 (2 for a one-step-ahead engine), got {lag!r}")
        self._rule = budget_rule
        self.lag = lag
        self._history: deque[np.ndarray] = deque(maxlen=lag)

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
