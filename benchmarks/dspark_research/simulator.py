"""Closed-loop serving simulator for verify-length policies (docs/dspark.md#simulator).

Fixed concurrency C: every slot always holds a decoding request; a finished request is
replaced at once. One engine step: the acceptance source reports confidences and (for the
oracle only) what full verification would accept; the policy picks ℓ_r; the source commits
min(m*_r, ℓ_r) + 1 tokens per request; simulated time advances by
T_draft(R) + T_verify(Σ(1 + ℓ_r)) + c0 + c1·committed. Sources replay the same requests and
uniforms for every policy (common random numbers), so differences between policies are
differences in scheduling, not in luck.

The policies below are thin adapters: the decisions are made by ``length_policy`` (Algorithm A)
and ``policies``.
"""

from __future__ import annotations

import abc

import time
from dataclasses import asdict, dataclass

import numpy as np

from deepinfer_plugins.dspark import length_policy as lp
from deepinfer_plugins.dspark.calibration import apply_sts

from . import policies
from .cost_models import StepCostModel


@dataclass
class Observation:
    """What a policy may see at one step (accepted_if_full is for the oracle only)."""

    survival: np.ndarray  # [R, γ] calibrated prefix survival
    num_drafted: np.ndarray  # [R]
    step_cost: object  # B -> ms at this R
    accepted_if_full: np.ndarray  # [R]


class Policy(abc.ABC):
    name = "policy"

    def reset(self) -> None:
        """Forget history (called before every simulated run)."""

    @abc.abstractmethod
    def plan(self, obs: Observation) -> np.ndarray:
        """Verify lengths [R] for this step's requests."""


class Fixed(Policy):
    def __init__(self, k: int):
        self.k, self.name = k, ("no-spec" if k == 0 else f"fixed-{k}")

    def plan(self, obs):
        return policies.fixed_lengths(obs.num_drafted, self.k)


class Threshold(Policy):
    def __init__(self, threshold: float):
        self.threshold, self.name = threshold, f"threshold-{threshold:g}"

    def plan(self, obs):
        return policies.threshold_lengths(obs.survival, obs.num_drafted, self.threshold)


class AlgorithmA(Policy):
    """Algorithm A as specified, or with envelope=True our bucket-aware variant."""

    def __init__(self, envelope: bool = False):
        self.envelope = envelope
        self.name = "dspark-A-env" if envelope else "dspark-A"

    def plan(self, obs):
        return lp.algorithm_a(obs.survival, obs.num_drafted, obs.step_cost, envelope=self.envelope)


class Stale(Policy):
    """Algorithm B ("global" budget) or uniform-L ("uniform"), budget from 2-step-old survivals."""

    def __init__(self, rule: str):
        self.rule = rule
        self.name = {"global": "dspark-B", "uniform": "uniform-L"}[rule]
        self.state = lp.StaleBudget({"global": "global", "uniform": policies.uniform_length_budget}[rule], lag=2)

    def reset(self):
        self.state.reset()

    def plan(self, obs):
        return self.state.plan(obs.survival, obs.num_drafted, obs.step_cost)


class Oracle(Policy):
    name = "oracle"

    def plan(self, obs):
        return policies.oracle_lengths(obs.accepted_if_full, obs.num_drafted, obs.step_cost)


def default_policies(gamma: int = 5, thresholds=(0.3, 0.5, 0.7)) -> list[Policy]:
    return ([Fixed(k) for k in range(gamma + 1)] + [Threshold(t) for t in thresholds]
            + [Stale("uniform"), AlgorithmA(), AlgorithmA(envelope=True), Stale("global"), Oracle()])


@dataclass
class SimResult:
    policy: str
    concurrency: int
    cost_model: str
    source: str
    throughput: float  # useful committed tokens / simulated second (tok/s)
    tokens_per_user_s: float  # throughput / C: the mean per-slot decode speed
    acceptance_length: float  # mean over rounds of accepted drafts + 1
    accepted_drafts: float  # mean accepted drafts per round
    verify_efficiency: float  # committed / verified tokens
    draft_acceptance: float  # accepted / verified drafts
    mean_verify_length: float  # mean ℓ per round
    mean_step_ms: float
    sched_overhead_us: float  # median wall time of the policy call per step (robust to a busy host)
    sched_overhead_mean_us: float
    steps: int
    finished_requests: int

    def as_dict(self) -> dict:
        return asdict(self)


def simulate(policy: Policy, source, cost: StepCostModel, steps: int, temperatures=None,
             cost_name: str = "", source_name: str = "") -> SimResult:
    """Run ``steps`` engine steps of ``policy`` against a fresh ``source`` (see module doc).

    source: an object with observe() -> (raw conf logits [C, γ], num_drafted [C], m* [C]) and
    advance(ℓ) -> (accepted [C], useful committed [C]), e.g. ``SyntheticSource``.
    temperatures: STS temperatures applied to the raw logits (None: use them uncalibrated).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    policy.reset()
    sched_s = []
    sim_ms = verified = committed = accepted_total = rounds = drafts_verified = 0.0
    for _ in range(steps):
        conf_logits, num_drafted, m_full = source.observe()
        r = num_drafted.size
        c = apply_sts(conf_logits, temperatures) if temperatures is not None else 1 / (1 + np.exp(-conf_logits))
        obs = Observation(lp.cumulative_survival(c, num_drafted), num_drafted, cost.for_scheduler(r), m_full)
        t0 = time.perf_counter()
        lengths = policy.plan(obs)
        sched_s.append(time.perf_counter() - t0)
        accepted, useful = source.advance(lengths)
        batch = r + int(lengths.sum())
        sim_ms += cost.step_ms(r, batch, int(useful.sum()))
        verified += batch
        committed += useful.sum()
        accepted_total += accepted.sum()
        drafts_verified += lengths.sum()
        rounds += r
    throughput = committed / (sim_ms / 1e3)
    return SimResult(
        policy=policy.name, concurrency=r, cost_model=cost_name, source=source_name,
        throughput=throughput, tokens_per_user_s=throughput / r,
        acceptance_length=(accepted_total + rounds) / rounds, accepted_drafts=accepted_total / rounds,
        verify_efficiency=(accepted_total + rounds) / verified,
        draft_acceptance=accepted_total / drafts_verified if drafts_verified else float("nan"),
        mean_verify_length=drafts_verified / rounds, mean_step_ms=sim_ms / steps,
        sched_overhead_us=float(np.median(sched_s)) * 1e6, sched_overhead_mean_us=float(np.mean(sched_s)) * 1e6,
        steps=steps, finished_requests=int(source.finished),
    )
