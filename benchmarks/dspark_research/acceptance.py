"""Synthetic acceptance traces fitted to published survival curves (docs/dspark.md#simulator).

No GPU is needed to ask how a scheduler behaves if the drafter accepts like DSpark does:
each request gets a domain curve, a difficulty, per-round noise and a noisy confidence head,
and acceptance is realised by Bernoulli draws. The model (logit space, per request r, round
starting at text position t, block position k):

    p_{r,t,k}   = sigmoid(l_{d,k} + z_r + ε_{r,t})        z_r ~ N(0, σ_req²), ε ~ N(0, σ_round²)
    accept k    iff  U_r[t + k] < p_{r,t,k}                one uniform per output position
    conf logit  = logit p_{r,t,k} + bias + σ_conf · η_{r,t,k}   (bias > 0: overconfident head)

l_{d,k} is fitted so the *mixture* survival E[Π_{j≤k} p_j] equals the published curve
(Gauss–Hermite quadrature over s = z + ε). Uniforms are keyed by output position, so every
policy sees the same acceptance outcome at the same text position (common random numbers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

# Unconditional prefix survival by draft position (sources per curve).
SURVIVAL_ANCHORS: dict[str, tuple[float, ...]] = {
    # vLLM dynamic-SD prior, "shape from DSpark-V4-Flash/Qwen3 measurements" [S]
    "v4_prior": (0.78, 0.55, 0.37, 0.24, 0.16, 0.11, 0.08),
    # DSpark Qwen3-8B block7, greedy gsm8k, vLLM MRV2 reproduction [S]: high-acceptance math/code
    "qwen3_8b_gsm8k": (0.947, 0.890, 0.832, 0.778, 0.728, 0.678, 0.628),
    # DFlash Qwen3-8B, vllm-ascend MRV1 [S]: a middle curve
    "dflash_qwen3_8b_gsm8k": (0.85, 0.71, 0.59, 0.50, 0.42, 0.36, 0.30),
}


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _quadrature(sigma: float, n_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    x, w = np.polynomial.hermite_e.hermegauss(n_nodes)  # weight exp(-x²/2)
    return sigma * x, w / w.sum()


def fit_conditional_logits(survival, sigma: float, n_nodes: int = 80) -> np.ndarray:
    """Base logits l_1..l_γ with E_s[Π_{j≤k} sigmoid(l_j + s)] = survival[k], s ~ N(0, σ²)."""
    target = np.asarray(survival, dtype=np.float64)
    if target.ndim != 1 or target.size == 0 or target.min() <= 0 or target.max() >= 1:
        raise ValueError("survival must be a 1-D curve of values in (0, 1)")
    if (np.diff(target) >= 0).any():
        raise ValueError(f"survival must be strictly decreasing, got {target.tolist()}")
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    s, w = _quadrature(sigma, n_nodes)
    prefix = np.ones_like(s)
    logits = np.empty(target.size)
    for k, goal in enumerate(target):
        lo, hi = -40.0, 40.0  # Σ w·prefix·sigmoid(l + s) is increasing in l: bisect
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if np.dot(w, prefix * _sigmoid(mid + s)) < goal else (lo, mid)
        logits[k] = 0.5 * (lo + hi)
        prefix = prefix * _sigmoid(logits[k] + s)
    return logits


def mixture_survival(logits, sigma: float, n_nodes: int = 80) -> np.ndarray:
    """Inverse of ``fit_conditional_logits``: the survival curve a set of base logits implies."""
    s, w = _quadrature(sigma, n_nodes)
    prefix = np.cumprod(_sigmoid(np.asarray(logits)[None, :] + s[:, None]), axis=1)  # [nodes, γ]
    return w @ prefix


@dataclass(frozen=True)
class SyntheticWorkload:
    """A request mix: domain name -> weight, plus the noise model in the module docstring."""

    domains: dict[str, float] = field(default_factory=lambda: {"v4_prior": 0.7, "qwen3_8b_gsm8k": 0.3})
    gamma: int = 5
    sigma_request: float = 0.8
    sigma_round: float = 0.5
    conf_bias: float = 0.5
    conf_noise: float = 0.6
    out_len: tuple[int, int] = (256, 768)

    def __post_init__(self):
        if not self.domains or any(w <= 0 for w in self.domains.values()):
            raise ValueError("domains must map at least one name to a positive weight")
        unknown = set(self.domains) - set(SURVIVAL_ANCHORS)
        if unknown:
            raise ValueError(f"unknown domains {sorted(unknown)}; known: {sorted(SURVIVAL_ANCHORS)}")
        if not 1 <= self.gamma <= min(len(v) for v in SURVIVAL_ANCHORS.values()):
            raise ValueError(f"gamma must lie in [1, 7], got {self.gamma}")
        if not 1 <= self.out_len[0] <= self.out_len[1]:
            raise ValueError(f"out_len must be (min, max) with 1 <= min <= max, got {self.out_len}")

    @cached_property
    def names(self) -> list[str]:
        return sorted(self.domains)

    @cached_property
    def weights(self) -> np.ndarray:
        w = np.array([self.domains[n] for n in self.names], dtype=np.float64)
        return w / w.sum()

    @cached_property
    def base_logits(self) -> np.ndarray:
        """[domains, γ] fitted l_{d,k}."""
        sigma = float(np.hypot(self.sigma_request, self.sigma_round))
        return np.stack([fit_conditional_logits(SURVIVAL_ANCHORS[n][: self.gamma], sigma) for n in self.names])

    def target_survival(self) -> np.ndarray:
        """The weighted anchor curve the mix should reproduce. [γ]"""
        return self.weights @ np.array([SURVIVAL_ANCHORS[n][: self.gamma] for n in self.names])

    def sample_request(self, rng: np.random.Generator) -> dict:
        """One request's pre-drawn randomness (keyed by output position, see module doc)."""
        g = self.gamma
        n = int(rng.integers(self.out_len[0], self.out_len[1] + 1))
        d = int(rng.choice(len(self.names), p=self.weights))
        return {
            "out_len": n,
            "base": self.base_logits[d] + rng.normal(0.0, self.sigma_request),  # [γ]
            "eps": rng.normal(0.0, self.sigma_round, size=n + 1),  # by round start t
            "u": rng.random(n + g + 1),  # by output position t + k
            "eta": rng.normal(0.0, 1.0, size=(n + 1, g)),  # confidence noise by (t, k)
        }

    def sample_rounds(self, num_rounds: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Held-out rounds under full verification: (conf_logits [n, γ], accepted [n], p [n, γ])."""
        rng = np.random.default_rng(seed)
        d = rng.choice(len(self.names), size=num_rounds, p=self.weights)
        s = rng.normal(0, self.sigma_request, num_rounds) + rng.normal(0, self.sigma_round, num_rounds)
        logit_p = self.base_logits[d] + s[:, None]
        p = _sigmoid(logit_p)
        acc = rng.random(p.shape) < p
        accepted = np.cumprod(acc, axis=1).sum(axis=1)
        conf = logit_p + self.conf_bias + self.conf_noise * rng.normal(size=p.shape)
        return conf, accepted, p


class SyntheticSource:
    """Closed-loop acceptance for C slots: observe() the current round, advance() by ℓ.

    Slot i runs requests (i, 0), (i, 1), ...; request (i, j) draws its randomness from
    ``seed`` and (i, j) only, so every policy replays the same requests. The first request of
    each slot starts part-way through (same offset for every policy) so completions are
    spread out from the first step.
    """

    def __init__(self, workload: SyntheticWorkload, concurrency: int, seed: int = 0):
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.w, self.c, self.seed = workload, concurrency, seed
        g, n_max = workload.gamma, workload.out_len[1]
        self.base = np.zeros((concurrency, g))
        self.eps = np.zeros((concurrency, n_max + 1))
        self.u = np.ones((concurrency, n_max + g + 1))
        self.eta = np.zeros((concurrency, n_max + 1, g))
        self.out_len = np.zeros(concurrency, dtype=np.int64)
        self.t = np.zeros(concurrency, dtype=np.int64)
        self.req = np.zeros(concurrency, dtype=np.int64)
        self.finished = 0
        for i in range(concurrency):
            self._load(i, first=True)

    def _load(self, i: int, first: bool = False) -> None:
        rng = np.random.default_rng([self.seed, i, int(self.req[i])])
        r = self.w.sample_request(rng)
        n = r["out_len"]
        self.out_len[i] = n
        self.base[i] = r["base"]
        self.eps[i, : n + 1] = r["eps"]
        self.u[i, : n + self.w.gamma + 1] = r["u"]
        self.eta[i, : n + 1] = r["eta"]
        self.t[i] = int(rng.integers(0, n)) if first else 0

    def observe(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(raw confidence logits [C, γ], num_drafted [C], accepted-if-fully-verified [C])."""
        g = self.w.gamma
        rows = np.arange(self.c)
        logit_p = self.base + self.eps[rows, self.t][:, None]  # [C, γ]
        u = self.u[rows[:, None], self.t[:, None] + 1 + np.arange(g)[None, :]]  # [C, γ]
        self._m_full = np.cumprod(u < _sigmoid(logit_p), axis=1).sum(axis=1)
        conf = logit_p + self.w.conf_bias + self.w.conf_noise * self.eta[rows, self.t]
        return conf, np.full(self.c, g, dtype=np.int64), self._m_full

    def advance(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Commit min(m*, ℓ) + 1 per slot; returns (accepted [C], useful committed [C]).

        Tokens past a request's output length are not counted as useful; the slot then
        starts its next request.
        """
        accepted = np.minimum(self._m_full, lengths)
        commit = accepted + 1
        useful = np.minimum(commit, self.out_len - self.t)
        self.t += commit
        for i in np.flatnonzero(self.t >= self.out_len):
            self.finished += 1
            self.req[i] += 1
            self._load(int(i))
        return accepted, useful
