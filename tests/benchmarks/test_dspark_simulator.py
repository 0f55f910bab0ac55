"""Simulator: the synthetic source reproduces the published survival curves, common random
numbers make policies comparable (flat cost: Algorithm A = fixed-5 token for token), the
oracle bounds the other policies, and the benchmark script writes the documented rows."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks.dspark_research.acceptance import SURVIVAL_ANCHORS, SyntheticSource, SyntheticWorkload, mixture_survival
from benchmarks.dspark_research.cost_models import StepCostModel, knee_cost_table
from benchmarks.dspark_research.simulator import AlgorithmA, Fixed, Oracle, Stale, default_policies, simulate
from deepinfer_plugins.dspark.cost_model import CostTable

ROOT = Path(__file__).resolve().parents[2]


def test_fitted_logits_reproduce_anchor_curves():
    w = SyntheticWorkload()
    sigma = np.hypot(w.sigma_request, w.sigma_round)
    for i, name in enumerate(w.names):
        assert np.allclose(mixture_survival(w.base_logits[i], sigma), SURVIVAL_ANCHORS[name][: w.gamma], atol=1e-6)


def test_realised_acceptance_matches_target_survival():
    # One round per slot across many slots: i.i.d. rounds. (Over a closed-loop run, rounds are
    # weighted towards slow, low-acceptance requests, so per-round acceptance there is lower.)
    w = SyntheticWorkload()
    _, n, m = SyntheticSource(w, 6000, seed=0).observe()
    realised = (m[:, None] > np.arange(w.gamma)[None, :]).mean(0)
    assert np.allclose(realised, w.target_survival(), atol=0.025), realised


def test_flat_cost_makes_algorithm_a_identical_to_fixed5():
    w = SyntheticWorkload(out_len=(64, 128))
    cost = StepCostModel(CostTable([1, 4096], [10.0, 10.0]), gamma=5)
    a = simulate(AlgorithmA(), SyntheticSource(w, 8, seed=1), cost, 100)
    f5 = simulate(Fixed(5), SyntheticSource(w, 8, seed=1), cost, 100)
    assert a.throughput == f5.throughput and a.acceptance_length == f5.acceptance_length


def test_oracle_bounds_policies_and_dynamic_beats_fixed5_past_knee():
    w = SyntheticWorkload()
    cost = StepCostModel(knee_cost_table(20.0, 64), gamma=5, draft_floor_ms=1.0, overhead_ms=2.0)
    res = {p.name: simulate(p, SyntheticSource(w, 64, seed=2), cost, 150) for p in default_policies()}
    assert res["oracle"].throughput >= max(r.throughput for n, r in res.items() if n != "oracle")
    assert res["dspark-B"].throughput > 1.07 * res["fixed-5"].throughput
    assert res["no-spec"].mean_verify_length == 0 and res["fixed-5"].mean_verify_length == 5
    assert Stale("global").name == "dspark-B" and Oracle().name == "oracle"


def test_benchmark_script_quick_run(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/dspark_sim.py"), "--out", str(out), "--quick",
           "--md", str(tmp_path / "r.md"), "--png", str(tmp_path / "r.png")]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())
    keys = {"policy", "concurrency", "cost_model", "throughput", "tokens_per_user_s", "acceptance_length"}
    assert rows and all(keys <= set(r) for r in rows)
    assert {r["policy"] for r in rows} >= {"fixed-5", "dspark-A", "dspark-B", "oracle", "uniform-L"}
    assert (tmp_path / "r.png").stat().st_size > 0 and "fixed-5" in (tmp_path / "r.md").read_text()
