"""STS on held-out synthetic rounds with an overconfident head lowers the cumulative ECE on a
separate split, keeps each position's ranking (conditional AUC identical), and the metrics
themselves are right on hand-made inputs."""

import numpy as np
import pytest

from benchmarks.dspark_research.acceptance import SyntheticWorkload
from deepinfer_plugins.dspark.calibration import apply_sts, auc, calibration_report, ece, fit_sts


def test_metrics_on_small_cases():
    assert auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert auc([0.5, 0.5], [0, 1]) == pytest.approx(0.5)
    assert ece([0.9, 0.9, 0.1, 0.1], [1, 0, 0, 0], n_bins=10) == pytest.approx(0.5 * 0.4 + 0.5 * 0.1)
    with pytest.raises(ValueError):
        ece([1.2], [1])


def test_sts_reduces_cumulative_ece_and_keeps_ranking():
    w = SyntheticWorkload(conf_bias=0.8, conf_noise=0.4)
    conf_fit, acc_fit, _ = w.sample_rounds(30_000, seed=1)
    conf, acc, _ = w.sample_rounds(30_000, seed=2)
    temps = fit_sts(conf_fit, acc_fit)
    ones = np.ones(w.gamma)
    raw = calibration_report(conf, acc, ones)
    cal = calibration_report(conf, acc, temps)
    assert [r["position"] for r in raw] == [c["position"] for c in cal] == list(range(1, w.gamma + 1))
    for r, c in zip(raw, cal, strict=True):
        assert c["ece_calibrated"] < 0.6 * r["ece_calibrated"], (r, c)
        assert c["auc_conditional"] == pytest.approx(r["auc_conditional"], abs=1e-12)
    assert (temps > 1).all()  # an overconfident head gets cooled
    with pytest.raises(ValueError):
        apply_sts(conf, temps[:-1])
    with pytest.raises(ValueError):
        fit_sts(conf, acc + 10)
