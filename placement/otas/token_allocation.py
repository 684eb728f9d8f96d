"""OTAS token allocation (otas-v2 §III-D): gamma per batch by dynamic programming (Alg. 2) or by load (Alg. 3).

Problem (1): choose gamma_b for every batch of the deadline-sorted queue to maximise sum_r u_r * alpha_r, where a
batch runs after the previous one (1b) and must finish before its deadline d_b (1a); a batch may also be left out
(alpha_r = 0, the l_b = 0 column of Alg. 2). Utility is estimated as sum_r u_r * accuracy(task_r, gamma_b) and time
from the measured profile (§III-D, last paragraph). The memory constraint (1c) is enforced by the profile: only
batch sizes up to epsilon are formed and those are the ones profiled.

Alg. 2 keeps one (utility, clock) pair per cell (b, l_b). That can miss the optimum: a prefix with less utility that
finishes earlier may leave room for more later. Here every cell keeps the Pareto front of (earlier clock, higher
utility) labels, which makes the DP exact (tests check it against brute force); `max_labels_per_cell=1` is the
paper's single-label Alg. 2, and a larger cap bounds the work on long queues.

Alg. 3 (the fallback when the queue has at most beta batches or in the initial stage): gamma = f(q) from the arrival
rate q with f profiled from the throughput of every gamma; a batch that would miss its deadline gets min(L), a batch
whose mean utility exceeds kappa gets max(L). As published, f(q) alone decides for every other batch: once the rate
of the last window passes a gamma's throughput, Alg. 3 merges even when the queue's deadlines leave room for the
plain or prompted model (the speed is only needed if the backlog outgrows the slack, and then the queue grows past
beta and Alg. 2 plans with the deadlines). By default (`use_queue_slack`) Alg. 3 adjusts the selection as problem
(1) asks -- the most utility subject to the deadlines (1a) of sequential batches (1b): a batch takes a gamma of
higher estimated utility than f(q)'s when it and every batch queued after it still meet their deadlines at that
gamma, and a batch above kappa takes the gamma of the highest estimated utility that meets its own deadline (max(L)
in the paper, where accuracy grows with gamma; not on every profile).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, Protocol, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from placement.otas.adaptive_batching import OtasBatch
from placement.otas.profile import OtasProfile

#: f(q) uses the throughput at this fraction of the batch cap epsilon (OTAS Fig. 7: throughput saturates early).
RATE_MAP_HEADROOM = 0.9


@dataclass(frozen=True)
class BatchEstimate:
    latency_s: float  # \hat{t}^{(p)}_b
    utility: float  # \hat{U}_b


class BatchEstimator(Protocol):
    def __call__(self, batch: OtasBatch, gamma: int) -> BatchEstimate: ...


def profile_estimator(profile: OtasProfile) -> BatchEstimator:
    """OTAS §III-D "Profile(B_b, gamma)": batch latency from the measured table, utility = sum u_r * accuracy."""

    def estimate(batch: OtasBatch, gamma: int) -> BatchEstimate:
        utility = sum(r.utility * profile.task_accuracy(r.task_id, gamma) for r in batch.requests)
        return BatchEstimate(profile.batch_latency_s(gamma, len(batch)), utility)

    return estimate


@dataclass
class AllocationPlan:
    """Gamma per batch of `batches` (deadline order); None = left out of this plan."""

    batches: list[OtasBatch]
    gammas: list[int | None]
    expected_utility: float
    method: Literal["dp", "load", "fixed", "switching"]
    setup_s: float = 0.0  # time before the first batch can run (model switching baselines: a weight load)


# ---- Algorithm 2 ---------------------------------------------------------------------------------------------------
@dataclass
class _Label:
    clock_s: float  # C[b, l_b]
    utility: float  # dp[b, l_b]
    prev_column: int  # S[b, l_b]
    prev_label: int


def _pareto(labels: list[_Label], cap: int | None) -> list[_Label]:
    """Keep labels not dominated by one with an earlier-or-equal clock and higher-or-equal utility."""
    labels.sort(key=lambda lab: (lab.clock_s, -lab.utility))
    front: list[_Label] = []
    for label in labels:
        if not front or label.utility > front[-1].utility:
            front.append(label)
    if cap is not None and len(front) > cap:
        if cap == 1:
            return [max(front, key=lambda lab: (lab.utility, -lab.clock_s))]
        step = (len(front) - 1) / (cap - 1)
        front = [front[round(i * step)] for i in range(cap)]
    return front


def allocate_dp(batches: Sequence[OtasBatch], now_s: float, gamma_list: Sequence[int], estimate: BatchEstimator,
                max_labels_per_cell: int | None = None) -> AllocationPlan:
    """OTAS Algorithm 2 over `batches` (sorted by deadline here, line 1), starting at clock `now_s`."""
    order = sorted(batches, key=lambda b: b.deadline_s)
    columns = [None] + list(gamma_list)  # l_b = 0: batch not executed
    # Row 0 (lines 5-8): dp = 0, C = T.
    rows: list[list[list[_Label]]] = [[[_Label(now_s, 0.0, -1, -1)]] + [[] for _ in gamma_list]]
    for batch in order:  # line 9
        previous = rows[-1]
        cells: list[list[_Label]] = []
        estimates = {g: estimate(batch, g) for g in gamma_list}
        for column, gamma in enumerate(columns):  # line 10
            candidates = []
            for prev_column, prev_labels in enumerate(previous):  # line 11 (empty cells are dp = -inf, line 12)
                for prev_index, prev in enumerate(prev_labels):
                    if gamma is None:  # lines 14-19: skip batch b
                        candidates.append(_Label(prev.clock_s, prev.utility, prev_column, prev_index))
                        continue
                    est = estimates[gamma]  # line 22
                    finish = prev.clock_s + est.latency_s
                    if finish < batch.deadline_s:  # line 23: (1a)
                        candidates.append(_Label(finish, prev.utility + est.utility, prev_column, prev_index))
            cells.append(_pareto(candidates, max_labels_per_cell))  # lines 26-32 (no label: -inf / +inf)
        rows.append(cells)
    # Lines 33-37: best final label, then backtrack.
    best_column, best_index, best = 0, 0, rows[-1][0][0] if rows[-1][0] else None
    for column, cell in enumerate(rows[-1]):
        for index, label in enumerate(cell):
            if best is None or (label.utility, -label.clock_s) > (best.utility, -best.clock_s):
                best_column, best_index, best = column, index, label
    gammas: list[int | None] = [None] * len(order)
    column, index = best_column, best_index
    for b in range(len(order), 0, -1):
        label = rows[b][column][index]
        gammas[b - 1] = columns[column]
        column, index = label.prev_column, label.prev_label
    return AllocationPlan(list(order), gammas, best.utility if best else 0.0, "dp")


# ---- Algorithm 3 ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RateToGamma:
    """f of OTAS Alg. 3 line 1 (the paper's Table I), profiled: the largest gamma whose throughput covers q."""

    thresholds: list[tuple[int, float]]  # (gamma, sustainable rate in requests/s), gamma descending

    @classmethod
    def from_profile(cls, profile: OtasProfile, batch_size: int) -> "RateToGamma":
        size = min(batch_size, profile.batch_sizes[-1])
        rates = [(g, RATE_MAP_HEADROOM * profile.throughput_rps(g, size))
                 for g in sorted(profile.gamma_list, reverse=True)]
        return cls(rates)

    def __call__(self, rate_rps: float) -> int:
        for gamma, capacity in self.thresholds:
            if rate_rps <= capacity:
                return gamma
        return self.thresholds[-1][0]


def _meets_deadlines(batches: Sequence[OtasBatch], start_s: float, gamma: int, estimate: BatchEstimator) -> bool:
    """Whether `batches`, run one after another from `start_s` at `gamma`, all finish before their deadlines."""
    clock = start_s
    for batch in batches:
        clock += estimate(batch, gamma).latency_s
        if clock >= batch.deadline_s:
            return False
    return True


def _most_utility(candidates: Sequence[int], estimates: dict[int, BatchEstimate]) -> int:
    """The candidate gamma of the highest estimated utility; ties: the faster one."""
    return max(candidates, key=lambda g: (estimates[g].utility, -estimates[g].latency_s))


def allocate_by_load(batches: Sequence[OtasBatch], now_s: float, gamma_list: Sequence[int], estimate: BatchEstimator,
                     rate_rps: float, rate_to_gamma: Callable[[float], int], kappa: float,
                     use_queue_slack: bool = True) -> AllocationPlan:
    """OTAS Algorithm 3 (Manually Allocate); `use_queue_slack=False` is the published rule, True (the default)
    lets a batch take a more accurate gamma than f(q) where the queue's deadlines allow it (module docstring)."""
    order = sorted(batches, key=lambda b: b.deadline_s)
    gamma = rate_to_gamma(rate_rps)  # line 1
    clock, total, gammas = now_s, 0.0, []
    for index, batch in enumerate(order):  # line 2
        if clock + estimate(batch, gamma).latency_s >= batch.deadline_s:  # lines 3-5
            chosen = min(gamma_list)
        elif not use_queue_slack:
            chosen = max(gamma_list) if batch.mean_utility > kappa else gamma  # lines 6-9
        else:
            estimates = {g: estimate(batch, g) for g in gamma_list}
            if batch.mean_utility > kappa:  # lines 6-7: the most accurate gamma that meets this deadline
                candidates = [g for g in gamma_list if clock + estimates[g].latency_s < batch.deadline_s]
            else:  # line 9, or a more accurate gamma that keeps this and every later queued deadline
                candidates = [gamma] + [g for g in gamma_list if estimates[g].utility > estimates[gamma].utility
                                        and _meets_deadlines(order[index:], clock, g, estimate)]
            chosen = _most_utility(candidates, estimates)
        est = estimate(batch, chosen)  # line 10
        clock += est.latency_s  # line 11
        total += est.utility if clock < batch.deadline_s else 0.0
        gammas.append(chosen)
    return AllocationPlan(list(order), gammas, total, "load")


# ---- the allocator policies ----------------------------------------------------------------------------------------
class TokenAllocationParams(BaseModel):
    """Parameters of OTAS Alg. 2-3 (defaults: the paper's §V setup, with the digits gamma list)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    #: The fields `paper()` sets: Alg. 2 with one label per cell, Alg. 3 without the queue's slack.
    PAPER_VALUES: ClassVar[dict[str, Any]] = {"max_labels_per_cell": 1, "use_queue_slack": False}

    gamma_list: list[int] = Field(default_factory=lambda: [-16, -12, -8, -4, 0, 2, 4, 8], min_length=1,
                                  description="OTAS L^(gamma): the selectable gammas (tokens per layer: <0 merged, >0 "
                                              "prompts).")
    beta: int = Field(default=5, ge=0,
                      description="OTAS Alg. 2 beta: at most this many batches in the queue -> Alg. 3.")
    kappa: float = Field(default=0.8, ge=0,
                         description="OTAS Alg. 3 kappa: mean utility above which a batch gets max(L) (with "
                                     "use_queue_slack: the most accurate gamma that meets its deadline).")
    initial_stage_s: float = Field(default=2.0, ge=0,
                                   description="OTAS Alg. 2 initial stage: Alg. 3 during the first seconds of service, "
                                               "in seconds.")
    rate_window_s: float = Field(default=1.0, gt=0,
                                 description="Window over which the arrival rate q is measured, in seconds.")
    max_labels_per_cell: int | None = Field(default=32, ge=1,
                                            description="Pareto labels kept per DP cell (1 = the paper's Alg. 2; None "
                                                        "= exact).")
    use_queue_slack: bool = Field(default=True,
                                  description="Alg. 3 takes a gamma of higher estimated utility than f(q)'s where the "
                                              "batch and every batch queued after it still meet their deadlines, and "
                                              "above kappa the most accurate gamma that meets the batch's deadline "
                                              "(False: Alg. 3 as published, f(q) and max(L)).")

    @classmethod
    def paper(cls, **overrides: Any) -> "TokenAllocationParams":
        """OTAS Alg. 2-3 as published (otas-v2 §III-D): one (utility, clock) label per DP cell, the highest
        utility (ties: the earlier clock), and Alg. 3's gamma from f(q) alone (max(L) above kappa). The project
        default keeps up to 32 Pareto labels per cell, a superset of the paper's label: never less expected utility
        per plan (the single label can miss the optimum when a prefix with more utility finishes too late for later
        batches; tests/unit/test_otas_policies.py solves one by hand); and Alg. 3 uses the queue's slack
        (`use_queue_slack`): on a fluctuating trace, f(q) alone merges batches that gamma 0 would serve in time,
        and loses accuracy for nothing (benchmarks/paper_claims.py compares the two)."""
        return cls(**{**cls.PAPER_VALUES, **overrides})


def parse_allocation_params(params: dict[str, Any]) -> TokenAllocationParams:
    try:
        return TokenAllocationParams(**params)
    except ValidationError as error:
        fields = ", ".join(".".join(str(p) for p in e["loc"]) + ": " + e["msg"] for e in error.errors())
        raise ValueError(f"invalid token allocation params: {fields}") from None


@dataclass
class ArrivalRateEstimator:
    """q of Alg. 2-3: arrivals per second over the last `window_s` of the caller's clock."""

    window_s: float
    _times: deque = field(default_factory=deque)

    def record(self, arrival_s: float) -> None:
        self._times.append(arrival_s)

    def rate_rps(self, now_s: float) -> float:
        while self._times and self._times[0] < now_s - self.window_s:
            self._times.popleft()
        return len(self._times) / self.window_s


class TokenAllocator(Protocol):
    def allocate(self, batches: Sequence[OtasBatch], now_s: float, rate_rps: float,
                 since_start_s: float) -> AllocationPlan: ...

    def min_latency_s(self, batch_size: int) -> float: ...


class OtasTokenAllocator:
    """OTAS Alg. 2 with the Alg. 3 fallback (queue of at most beta batches, or the initial stage)."""

    def __init__(self, profile: OtasProfile, params: TokenAllocationParams, batch_cap: int):
        unknown = [g for g in params.gamma_list if g not in profile.latency_s]
        if unknown:
            raise ValueError(f"gamma_list has gammas {unknown} that the profile does not cover ({profile.gamma_list})")
        self.profile = profile
        self.params = params
        self.estimate = profile_estimator(profile)
        self.rate_to_gamma = RateToGamma.from_profile(
            profile.model_copy(update={"gamma_list": list(params.gamma_list)}), batch_cap)

    def allocate(self, batches: Sequence[OtasBatch], now_s: float, rate_rps: float,
                 since_start_s: float) -> AllocationPlan:
        p = self.params
        if len(batches) <= p.beta or since_start_s < p.initial_stage_s:  # Alg. 2 line 2
            return allocate_by_load(batches, now_s, p.gamma_list, self.estimate, rate_rps, self.rate_to_gamma, p.kappa,
                                    p.use_queue_slack)
        return allocate_dp(batches, now_s, p.gamma_list, self.estimate, p.max_labels_per_cell)

    def min_latency_s(self, batch_size: int) -> float:
        return self.profile.batch_latency_s(min(self.params.gamma_list), batch_size)
