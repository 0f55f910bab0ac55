"""Verify-length policies: Algorithm A matches a line-by-line transcription of the paper's Algorithm 1 and has
the listed properties (prefix contiguity, extremes, ties, caps, Θ ≥ fixed-k when unimodal,
non-anticipation on the Appendix-A case); input errors behave. Algorithm B (what the vLLM proposer
runs) finds the global optimum of a jagged cost, budgets from its history and agrees with A where
it should."""

import math

import numpy as np
import pytest

from benchmarks.dspark_research.cost_models import ShiftedCost
from deepinfer_plugins.dspark import length_policy as lp
from deepinfer_plugins.dspark import plan_verify_lengths
from deepinfer_plugins.dspark.cost_model import CostTable


def reference_algorithm_a(conf, cost, max_batch_tokens=None):
    """The paper's Algorithm 1 (docs/dspark.md#scheduling), transcribed loop by loop."""
    R = len(conf)
    entries = []
    for r, row in enumerate(conf):
        a = 1.0
        for j, c in enumerate(row, start=1):
            a *= c
            if a > 0:
                entries.append((a, j, r))
    entries.sort(key=lambda e: (-e[0], e[1], e[2]))
    B, tau = R, float(R)
    best, best_n = tau / cost(B), 0
    for n, (a, j, r) in enumerate(entries, start=1):
        if max_batch_tokens is not None and B + 1 > max_batch_tokens:
            break
        B += 1
        tau += a
        theta = tau / cost(B)
        if theta > best:
            best, best_n = theta, n
        else:
            break
    ell = [0] * R
    for _, _, r in entries[:best_n]:
        ell[r] += 1
    return ell


def theta(conf, ell, cost):
    tau = sum(1 + sum(math.prod(row[:j]) for j in range(1, k + 1)) for row, k in zip(conf, ell))
    return tau / cost(len(conf) + sum(ell))


def random_instance(rng):
    R = int(rng.integers(1, 9))
    conf = []
    for _ in range(R):
        g = int(rng.integers(0, 6))
        row = rng.choice([0.0, 0.5, 0.9, 1.0, rng.random()], size=g, p=[0.05, 0.2, 0.2, 0.1, 0.45])
        conf.append([float(x) for x in row])
    kind = rng.integers(0, 3)
    if kind == 0:  # bucketed roofline
        knee = int(rng.integers(2, 20))
        cost = lambda B, knee=knee: max(1.0, math.ceil(B / 4) * 4 / knee)  # noqa: E731
    elif kind == 1:  # smooth convex
        s = rng.uniform(0.001, 0.1)
        cost = lambda B, s=s: 1.0 + s * B * B  # noqa: E731
    else:  # jagged table
        sizes = np.arange(1, 60)
        cost = CostTable(sizes, 1.0 + np.cumsum(rng.uniform(0, 0.3, sizes.size)) * (rng.random(sizes.size) < 0.3))
    cap = None if rng.random() < 0.5 else R + int(rng.integers(0, 12))
    return conf, cost, cap


def test_matches_reference_transcription_on_random_instances():
    rng = np.random.default_rng(0)
    for _ in range(400):
        conf, cost, cap = random_instance(rng)
        assert plan_verify_lengths(conf, cost, cap) == reference_algorithm_a(conf, cost, cap), (conf, cap)


def test_admitted_set_is_a_prefix_of_the_sorted_order():
    rng = np.random.default_rng(1)
    for _ in range(200):
        conf, cost, cap = random_instance(rng)
        ell = plan_verify_lengths(conf, cost, cap)
        key = lambda r, j: (-math.prod(conf[r][:j]), j, r)  # noqa: E731
        admitted = [key(r, j) for r, k in enumerate(ell) for j in range(1, k + 1)]
        frontier = [key(r, k + 1) for r, k in enumerate(ell) if k < len(conf[r]) and math.prod(conf[r][: k + 1]) > 0]
        for r, k in enumerate(ell):
            assert 0 <= k <= len(conf[r])
        if admitted and frontier:
            assert max(admitted) < min(frontier)


def test_constant_cost_admits_every_positive_position():
    conf = [[0.9, 0.5, 0.1], [0.3, 0.0, 0.9], [], [1.0, 1.0]]
    assert plan_verify_lengths(conf, lambda B: 7.0) == [3, 1, 0, 2]


def test_constant_cost_respects_batch_cap():
    conf = [[0.9, 0.5, 0.1], [0.95, 0.2]]
    # 2 anchors + 3 drafts: the three largest survivals are 0.95, 0.9, 0.45 (= 0.9 * 0.5)
    assert plan_verify_lengths(conf, lambda B: 1.0, max_batch_tokens=5) == [2, 1]
    assert plan_verify_lengths(conf, lambda B: 1.0, max_batch_tokens=2) == [0, 0]


def test_infinite_cost_beyond_anchors_verifies_nothing():
    conf = [[0.99, 0.99], [0.9]]
    assert plan_verify_lengths(conf, lambda B: 1.0 if B <= 2 else math.inf) == [0, 0]


def test_ties_prefer_smaller_position_then_smaller_request():
    # (r=1, j=1) and (r=0, j=2) both have survival 0.8; j=1 goes first.
    conf = [[1.0, 0.8], [0.8]]
    assert plan_verify_lengths(conf, lambda B: 1.0, max_batch_tokens=4) == [1, 1]
    # identical requests: the smaller request index wins the single spare row
    assert plan_verify_lengths([[0.7], [0.7]], lambda B: 1.0, max_batch_tokens=3) == [1, 0]


def test_theta_beats_every_fixed_k_when_theta_is_unimodal():
    rng = np.random.default_rng(2)
    checked = 0
    for _ in range(200):
        R = int(rng.integers(1, 12))
        conf = [list(rng.uniform(0.3, 1.0, size=5)) for _ in range(R)]
        s = rng.uniform(0.0005, 0.05)
        cost = lambda B, s=s: 1.0 + s * B * B  # noqa: E731
        a = lp.cumulative_survival(np.array(conf), np.full(R, 5))
        _, _, vals = lp.admission_order(a, np.full(R, 5))
        path = np.cumsum(np.r_[R, vals]) / np.array([cost(R + n) for n in range(vals.size + 1)])
        peak = int(np.argmax(path))
        assert (np.diff(path[: peak + 1]) > 0).all() and (np.diff(path[peak:]) < 0).all()  # unimodal
        ell = plan_verify_lengths(conf, cost)
        for k in range(6):
            assert theta(conf, ell, cost) >= theta(conf, [k] * R, cost) - 1e-12
        checked += 1
    assert checked == 200


APPENDIX_A_COST = {1: 1.0, 2: 1 / 0.5, 3: 1 / 0.45}.__getitem__  # SPS(1, 2, 3) = (1, 0.5, 0.45)


@pytest.mark.parametrize("c2", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_appendix_a_decision_ignores_c2(c2):
    # c1 = 1 - TV((0.7, 0.3), (0.5, 0.5)) = 0.8; extending to ℓ = 1 never pays, so Algorithm A
    # stops at ℓ = 0 whatever c2 (which depends on the drafted x1) says.
    assert plan_verify_lengths([[0.8, c2]], APPENDIX_A_COST) == [0]
    # the retrospective global argmax does look at c2 and verifies 2 when it is high
    a = np.cumprod([0.8, c2])
    lookahead = lp.search_budget(a, 1, APPENDIX_A_COST)
    assert lookahead == (2 if 0.45 * (1.8 + 0.8 * c2) > 1 else 0)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match=r"confidences\[0\]"):
        plan_verify_lengths([[1.5]], lambda B: 1.0)
    with pytest.raises(ValueError):
        plan_verify_lengths([[float("nan")]], lambda B: 1.0)
    with pytest.raises(TypeError):
        plan_verify_lengths(5, lambda B: 1.0)
    with pytest.raises(TypeError):
        plan_verify_lengths(["0.5"], lambda B: 1.0)
    with pytest.raises(TypeError):
        plan_verify_lengths([[0.5]], "fast")
    with pytest.raises(ValueError, match="positive"):
        plan_verify_lengths([[0.5]], lambda B: 0.0)
    with pytest.raises(ValueError, match="positive"):
        plan_verify_lengths([[0.5]], lambda B: float("nan"))
    with pytest.raises(ValueError, match="anchor"):
        plan_verify_lengths([[0.5], [0.5]], lambda B: 1.0, max_batch_tokens=1)
    with pytest.raises(TypeError):
        plan_verify_lengths([[0.5]], lambda B: 1.0, max_batch_tokens=2.5)
    with pytest.raises(ValueError, match="non-increasing"):
        lp.algorithm_a(np.array([[0.5, 0.6]]), np.array([2]), lambda B: 1.0)
    assert plan_verify_lengths([], lambda B: 1.0) == []


def test_envelope_variant_crosses_bucket_steps_plain_a_stops_at():
    # Past the knee every 8-token bucket costs more than one token gains: plain A stays at ℓ = 0,
    # although filling whole buckets pays (a fixed 4 ms per step, e.g. drafting, dilutes the slope).
    sizes = np.arange(8, 257, 8)
    table = ShiftedCost(CostTable(sizes, np.maximum(1.0, sizes / 16)), 4.0)
    a = lp.cumulative_survival(np.full((16, 3), 0.95), np.full(16, 3))
    plain = lp.algorithm_a(a, np.full(16, 3), table)
    env = lp.algorithm_a(a, np.full(16, 3), table, envelope=True)
    assert plain.sum() == 0
    assert (16 + env.sum()) % 8 == 0  # filled to a bucket top
    tau = lambda ell: 16 + sum(a[r, :k].sum() for r, k in enumerate(ell))  # noqa: E731
    assert tau(env) / table(16 + env.sum()) > tau(plain) / table(16)
    # with a flat cost the variant is Algorithm A
    flat = lambda B: 2.0  # noqa: E731
    assert (lp.algorithm_a(a, np.full(16, 3), flat, envelope=True) == lp.algorithm_a(a, np.full(16, 3), flat)).all()


# --------------------------------------------------------------------------- Algorithm B


def test_search_budget_finds_global_optimum_of_jagged_cost():
    # Θ dips at K = 1 (a step) and peaks at K = 4: early stop would return 0.
    cost = CostTable(np.array([2, 3, 6]), np.array([1.0, 1.6, 1.6]))
    values = np.array([0.9, 0.9, 0.9, 0.9])
    assert lp.search_budget(values, 2, cost) == 4
    a = values.reshape(2, 2)  # two requests, survival non-increasing along rows
    assert lp.algorithm_a(a, np.array([2, 2]), cost).sum() == 0


def test_stale_budget_uses_history_and_allocates_current_top_k():
    cost = lambda B: 1.0 + 0.05 * max(0, B - 4) ** 2  # noqa: E731
    sched = lp.StaleBudget("global", lag=2)
    n = np.array([3, 3])
    old = lp.cumulative_survival(np.array([[0.9, 0.9, 0.9], [0.9, 0.9, 0.9]]), n)
    cur = lp.cumulative_survival(np.array([[0.2, 0.9, 0.9], [0.99, 0.99, 0.9]]), n)
    assert sched.plan(old, n, cost).tolist() == [3, 3]  # no history yet: verify everything
    sched.plan(old, n, cost)
    k = lp.search_budget(old, 2, cost)
    ell = sched.plan(cur, n, cost)
    assert ell.sum() == k and 0 < k < 6
    assert ell.tolist() == lp.allocate_top_k(cur, n, k).tolist()
    assert ell[1] >= ell[0]  # the current block of request 1 is far more confident
    with pytest.raises(ValueError):
        lp.StaleBudget("lookahead")


def test_b_agrees_with_a_when_stale_equals_current_and_theta_unimodal():
    rng = np.random.default_rng(3)
    for _ in range(50):
        R = int(rng.integers(1, 10))
        a = lp.cumulative_survival(rng.uniform(0.3, 1, (R, 5)), np.full(R, 5))
        s = rng.uniform(0.001, 0.05)
        cost = lambda B, s=s: 1.0 + s * B * B  # noqa: E731
        k = lp.search_budget(a, R, cost)
        assert lp.allocate_top_k(a, np.full(R, 5), k).tolist() == lp.algorithm_a(a, np.full(R, 5), cost).tolist()
