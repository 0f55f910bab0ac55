"""The baselines only the simulator runs behave as their definitions say."""

import numpy as np
import pytest

from benchmarks.dspark_research import policies
from deepinfer_plugins.dspark import length_policy as lp


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
