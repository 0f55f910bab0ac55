"""The policies only the simulator runs: Algorithm B (stale budget, global search) and the baselines behave, and
B agrees with Algorithm A where it should."""

import numpy as np
import pytest

from benchmarks.dspark_research import policies
from deepinfer_plugins.dspark import length_policy as lp
from deepinfer_plugins.dspark.cost_model import CostTable


def test_search_budget_finds_global_optimum_of_jagged_cost():
    # Θ dips at K = 1 (a step) and peaks at K = 4: early stop would return 0.
    cost = CostTable(np.array([2, 3, 6]), np.array([1.0, 1.6, 1.6]))
    values = np.array([0.9, 0.9, 0.9, 0.9])
    assert policies.search_budget(values, 2, cost) == 4
    a = values.reshape(2, 2)  # two requests, survival non-increasing along rows
    assert lp.algorithm_a(a, np.array([2, 2]), cost).sum() == 0


def test_stale_budget_uses_history_and_allocates_current_top_k():
    cost = lambda B: 1.0 + 0.05 * max(0, B - 4) ** 2  # noqa: E731
    sched = policies.StaleBudget("global", lag=2)
    n = np.array([3, 3])
    old = lp.cumulative_survival(np.array([[0.9, 0.9, 0.9], [0.9, 0.9, 0.9]]), n)
    cur = lp.cumulative_survival(np.array([[0.2, 0.9, 0.9], [0.99, 0.99, 0.9]]), n)
    assert sched.plan(old, n, cost).tolist() == [3, 3]  # no history yet: verify everything
    sched.plan(old, n, cost)
    k = policies.search_budget(old, 2, cost)
    ell = sched.plan(cur, n, cost)
    assert ell.sum() == k and 0 < k < 6
    assert ell.tolist() == policies.allocate_top_k(cur, n, k).tolist()
    assert ell[1] >= ell[0]  # the current block of request 1 is far more confident
    with pytest.raises(ValueError):
        policies.StaleBudget("lookahead")


def test_b_agrees_with_a_when_stale_equals_current_and_theta_unimodal():
    rng = np.random.default_rng(3)
    for _ in range(50):
        R = int(rng.integers(1, 10))
        a = lp.cumulative_survival(rng.uniform(0.3, 1, (R, 5)), np.full(R, 5))
        s = rng.uniform(0.001, 0.05)
        cost = lambda B, s=s: 1.0 + s * B * B  # noqa: E731
        k = policies.search_budget(a, R, cost)
        assert policies.allocate_top_k(a, np.full(R, 5), k).tolist() == lp.algorithm_a(a, np.full(R, 5), cost).tolist()


def test_baselines():
    n = np.array([5, 2, 0])
    assert policies.fixed_lengths(n, 3).tolist() == [3, 2, 0]
    a = lp.cumulative_survival(np.array([[0.9, 0.8, 0.5, 0.5, 0.5], [0.4, 1, 0, 0, 0], [0, 0, 0, 0, 0]]), n)
    assert policies.threshold_lengths(a, n, 0.5).tolist() == [2, 0, 0]
    # uniform-L on a knee at 2 tokens per request: L* = 1 for 2 requests
    cost = lambda B: max(1.0, B / 4)  # noqa: E731
    stale = lp.cumulative_survival(np.full((2, 3), 0.9), np.full(2, 3))
    assert policies.uniform_length_budget(stale, 2, cost) == 2 * 1
    # oracle: 3 sure tokens, cost flat up to 5 tokens
    ell = policies.oracle_lengths(np.array([2, 1]), np.array([3, 3]), lambda B: 1.0 if B <= 5 else 10.0)
    assert ell.tolist() == [2, 1]
    with pytest.raises(ValueError):
        policies.oracle_lengths(np.array([4]), np.array([3]), lambda B: 1.0)
    with pytest.raises(ValueError):
        policies.threshold_lengths(a, n, 1.5)
