"""Calibration of confidence-head outputs: Sequential Temperature Scaling (STS) and its metrics.

The scheduler multiplies conditional confidences into prefix survival a_k = c_1···c_k and
spends real verify rows on them, so an overconfident head buys rows that are then rejected.
STS (paper §3.2.1) fits one temperature per position on held-out rounds, in order k = 1..γ,
each minimising the ECE of the *cumulative* a_k against "the first k drafts were accepted"
with T_1..T_{k-1} already fixed. Dividing a logit by T > 0 keeps each c_k's ranking, so the
per-position AUC of c_k is unchanged; only the probabilities move.

Held-out rounds should be logged with full verification (ℓ = γ) so every position has a label;
``num_verified`` handles logs where it was not.
"""

from __future__ import annotations

import numpy as np

DEFAULT_GRID = np.unique(np.concatenate([np.geomspace(0.2, 5.0, 97), [1.0]]))


def _flat(pred, label) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(pred, dtype=np.float64).reshape(-1)
    y = np.asarray(label).reshape(-1)
    if p.shape != y.shape:
        raise ValueError(f"pred and label must have the same size, got {p.size} and {y.size}")
    if p.size and (np.isnan(p).any() or p.min() < 0 or p.max() > 1):
        raise ValueError("pred must be probabilities in [0, 1]")
    return p, y.astype(np.float64)


def ece(pred, label, n_bins: int = 15) -> float:
    """Expected calibration error: Σ_bins (n_b / n) · |mean pred - mean label|, equal-width bins."""
    p, y = _flat(pred, label)
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    if p.size == 0:
        return 0.0
    b = np.minimum((p * n_bins).astype(np.int64), n_bins - 1)
    n = np.bincount(b, minlength=n_bins)
    gap = np.abs(np.bincount(b, p, n_bins) - np.bincount(b, y, n_bins))
    return float(gap.sum() / p.size) if n.sum() else 0.0


def auc(pred, label) -> float:
    """Area under the ROC curve (Mann–Whitney U with average ranks for ties); nan if one class."""
    p, y = _flat(pred, label)
    pos = y > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(p, kind="mergesort")
    ranks = np.empty(p.size)
    sorted_p = p[order]
    # average rank over runs of equal predictions
    starts = np.flatnonzero(np.r_[True, sorted_p[1:] != sorted_p[:-1]])
    ends = np.r_[starts[1:], p.size]
    avg = (starts + ends - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def brier(pred, label) -> float:
    p, y = _flat(pred, label)
    return float(np.mean((p - y) ** 2)) if p.size else 0.0


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _check_logs(conf_logits, accepted, num_verified):
    z = np.asarray(conf_logits, dtype=np.float64)
    if z.ndim != 2 or not np.isfinite(z).all():
        raise ValueError(f"conf_logits must be a finite [rounds, gamma] array, got shape {list(z.shape)}")
    m = np.asarray(accepted)
    if m.shape != (z.shape[0],) or (m.size and (m.min() < 0 or m.max() > z.shape[1])):
        raise ValueError(f"accepted must be [rounds] counts in [0, {z.shape[1]}]")
    n = np.full(z.shape[0], z.shape[1]) if num_verified is None else np.asarray(num_verified)
    if n.shape != m.shape or (m > n).any() or (n.size and n.max() > z.shape[1]):
        raise ValueError("num_verified must be [rounds], >= accepted and <= gamma")
    return z, m, n


def apply_sts(conf_logits, temperatures) -> np.ndarray:
    """Calibrated conditional confidences c_k = sigmoid(logit_k / T_k). [rounds, γ]"""
    z = np.asarray(conf_logits, dtype=np.float64)
    t = np.asarray(temperatures, dtype=np.float64)
    if z.ndim < 1 or t.shape != (z.shape[-1],):
        raise ValueError(f"need one temperature per position: logits {list(z.shape)}, temperatures {list(t.shape)}")
    if not (t > 0).all():
        raise ValueError("temperatures must be positive")
    return _sigmoid(z / t)


def fit_sts(conf_logits, accepted, num_verified=None, grid=DEFAULT_GRID, n_bins: int = 15) -> np.ndarray:
    """Per-position temperatures T_1..T_γ fitted in order on held-out rounds.

    conf_logits [rounds, γ] raw head logits; accepted [rounds] drafts accepted; num_verified
    [rounds] how many were verified (default: all γ). Position k is fitted on rounds that
    verified it; label = (accepted ≥ k); prediction = cumulative a_k with the T's fitted so far.
    A position with no verified rounds keeps T = 1.
    """
    z, m, n = _check_logs(conf_logits, accepted, num_verified)
    grid = np.asarray(grid, dtype=np.float64)
    if grid.ndim != 1 or grid.size == 0 or (grid <= 0).any():
        raise ValueError("grid must be a non-empty 1-D array of positive temperatures")
    temps = np.ones(z.shape[1])
    prefix = np.ones(z.shape[0])  # a_{k-1} with the fitted temperatures
    for k in range(z.shape[1]):
        rows = n > k
        if rows.any():
            label = m[rows] > k
            cand = prefix[rows, None] * _sigmoid(z[rows, k, None] / grid[None, :])  # [rows, grid]
            errs = [ece(cand[:, g], label, n_bins) for g in range(grid.size)]
            temps[k] = grid[int(np.argmin(errs))]
        prefix = prefix * _sigmoid(z[:, k] / temps[k])
    return temps


def calibration_report(conf_logits, accepted, temperatures, num_verified=None, n_bins: int = 15) -> list[dict]:
    """Per position: ECE of cumulative a_k raw vs calibrated, AUC of c_k (conditional label), Brier."""
    z, m, n = _check_logs(conf_logits, accepted, num_verified)
    raw_a = np.cumprod(_sigmoid(z), axis=1)
    cal_c = apply_sts(z, temperatures)
    cal_a = np.cumprod(cal_c, axis=1)
    out = []
    for k in range(z.shape[1]):
        rows = n > k
        label = m[rows] > k
        cond = rows & (m >= k)  # reached position k: conditional label
        out.append({
            "position": k + 1,
            "rounds": int(rows.sum()),
            "realised_survival": float(label.mean()) if rows.any() else float("nan"),
            "mean_raw_survival": float(raw_a[rows, k].mean()) if rows.any() else float("nan"),
            "mean_calibrated_survival": float(cal_a[rows, k].mean()) if rows.any() else float("nan"),
            "ece_raw": ece(raw_a[rows, k], label, n_bins),
            "ece_calibrated": ece(cal_a[rows, k], label, n_bins),
            "auc_conditional": auc(cal_c[cond, k], m[cond] > k),
            "brier_calibrated": brier(cal_a[rows, k], label),
        })
    return out
