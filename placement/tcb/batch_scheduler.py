"""Batch forming for ConcatBatching text replicas: which waiting requests run in the next batch (TCB §5).

A batch has B rows of at most L tokens (TCB §5.1); several requests share a row (ops/packing.py). The schedulers
are pure policies: `form_batch(now_s, queue)` takes the clock and the waiting requests and returns a
`BatchDecision` (the requests of every row, or of every slot, and the requests dropped because their deadline
passed). The simulator (placement/tcb/trace_replay.py) and the live text replica (rayserve_apps/replicas/text.py)
call the same objects.

- `das`: TCB Alg. 1, online deadline-aware scheduling (utility 1/length, eta + q = 1).
- `slotted_das`: TCB Alg. 2, DAS then slot size z from the longest utility-dominant request.
- `fcfs`, `sjf`, `edf`: TCB §6.2.4's comparison schedulers (arrival, length, deadline order), first-fit into rows.

Every scheduler drops the waiting requests that can no longer start by their deadline (TCB §5.2: "requests that
have arrived but not been scheduled by their deadlines are excluded from N_t"); `start_allowance_ms` drops them
that much earlier, e.g. one batch's latency, so that a scheduled request also finishes in time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

#: Tolerance of the eta + q = 1 check.
ETA_Q_TOLERANCE = 1e-6


@dataclass(frozen=True)
class TextRequest:
    """A waiting request as the scheduler sees it (TCB §5.1: arrival a_n, deadline d_n, length l_n)."""

    request_id: Hashable
    length_tokens: int  # TCB §5.1: l_n
    arrival_s: float  # TCB §5.1: a_n
    deadline_s: float  # TCB §5.1: d_n

    @property
    def utility(self) -> float:
        """TCB §5.1: v_n = 1 / l_n."""
        return 1.0 / self.length_tokens


@dataclass
class BatchDecision:
    """The next batch: requests per row (TCB Alg. 1: H_tk), per slot when slotted, and the requests dropped."""

    rows: list[list[TextRequest]]
    dropped: list[TextRequest] = field(default_factory=list)
    #: TCB Alg. 2: slot size z; None for pure ConcatBatching.
    slot_size_tokens: int | None = None
    #: Slotted only: requests per slot, the unit that executes (each slot's requests also appear in `rows`).
    slots: list[list[TextRequest]] | None = None

    @property
    def requests(self) -> list[TextRequest]:
        return [r for row in self.rows for r in row]

    @property
    def is_empty(self) -> bool:
        return not any(self.rows)

    @property
    def num_tokens(self) -> int:
        return sum(r.length_tokens for r in self.requests)

    @property
    def utility(self) -> float:
        """TCB Eq. 9: sum of v_n over the scheduled requests."""
        return sum(r.utility for r in self.requests)

    def bins(self) -> list[list[TextRequest]]:
        """What executes as rows of the packed tensor: the slots when slotted, else the rows."""
        return self.slots if self.slots is not None else [row for row in self.rows if row]

    def remaining(self, queue: Sequence[TextRequest]) -> list[TextRequest]:
        """The queue without the scheduled and the dropped requests, order kept."""
        taken = {id(r) for r in self.requests} | {id(r) for r in self.dropped}
        return [r for r in queue if id(r) not in taken]


class BatchingParams(BaseModel):
    """Parameters of a batching policy (`spec.policy('batching', model).params`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    row_length_tokens: int = Field(default=128, ge=1, description="L: most tokens of one batch row (TCB §5.1).")
    num_rows: int = Field(default=8, ge=1, le=4096, description="B: rows of one batch (TCB §5.1).")
    eta: float = Field(default=0.5, gt=0, lt=1,
                       description="DAS: share of the s_tk requests that fill a row taken as the utility-dominant set "
                                   "(TCB Alg. 1).")
    q: float = Field(default=0.5, gt=0, lt=1,
                     description="DAS: deadline-aware set keeps requests of utility >= q * mean utility of the "
                                 "utility-dominant set; eta + q = 1 (TCB §5.2).")
    slot_size_tokens: int | None = Field(default=None, ge=1,
                                         description="Fixed slot size z for slotted batching; for slotted_das, None "
                                                     "lets Alg. 2 choose z per batch.")
    slot_granularity_tokens: int = Field(default=1, ge=1,
                                         description="slotted_das rounds its slot size up to a multiple of this, in "
                                                     "tokens (1: TCB Alg. 2's unrounded z; more: fewer distinct "
                                                     "shapes).")
    backfill_slots: bool = Field(default=False,
                                 description="slotted_das: fill room left in the slots with other waiting requests "
                                             "(plexserve's addition to TCB Alg. 2; off as in the paper).")
    dispatch_when_idle: bool = Field(default=True,
                                     description="Form a batch at once when no batch of the model runs, without the "
                                                 "batch wait (a text that finds the engine idle runs alone); "
                                                 "otherwise wait for full rows or the batch wait.")
    refuse_early: bool = Field(default=True,
                               description="Refuse a call on arrival (503 overloaded) when the queued tokens ahead of "
                                           "it cannot finish by its deadline, by the model's measured batch cost.")
    start_allowance_ms: float = Field(default=0.0, ge=0,
                                      description="Drop a request unless it can start this long before its deadline, "
                                                  "in milliseconds.")

    @classmethod
    def paper(cls, **overrides: Any) -> "BatchingParams":
        """TCB Alg. 2 (Slotted DAS, §5.3) as published: the slot size z is the longest request of the
        utility-dominant sets, not rounded (`slot_granularity_tokens=1`), and room left in the slots stays empty
        (`backfill_slots=False`). These are also the defaults: plexserve's additions (z rounded up to a granularity,
        e.g. 8 tokens, for fewer distinct shapes; slots back-filled with waiting requests that fit, by utility)
        lost to the paper's Alg. 2 in every run of benchmarks/paper_claims.py (held-out DAS utility on the MiniLM
        latency model, paper over additions 1.03-1.09), so they are options, off by default. The preset pins the
        paper's values whatever the defaults become."""
        return cls(**{"slot_granularity_tokens": 1, "backfill_slots": False, **overrides})

    @model_validator(mode="after")
    def _check(self) -> "BatchingParams":
        if abs(self.eta + self.q - 1.0) > ETA_Q_TOLERANCE:
            raise ValueError(f"q: eta + q must equal 1 (TCB §5.2), got eta={self.eta} q={self.q}")
        if self.slot_size_tokens is not None and self.slot_size_tokens > self.row_length_tokens:
            raise ValueError(f"slot_size_tokens: {self.slot_size_tokens} is more than "
                             f"row_length_tokens={self.row_length_tokens}")
        return self


class BatchScheduler:
    """Forms one batch of B rows x L tokens from the waiting requests; subclasses choose the requests."""

    name = "base"

    def __init__(self, params: BatchingParams | None = None):
        self.params = params or BatchingParams()

    @property
    def max_request_tokens(self) -> int:
        """Longest request the batches can hold: L, or the fixed slot size."""
        return self.params.slot_size_tokens or self.params.row_length_tokens

    def check_request(self, request: TextRequest) -> None:
        """Raise ValueError for a request no batch can hold (no silent truncation)."""
        limit = self.max_request_tokens
        name = "slot_size_tokens" if self.params.slot_size_tokens else "row_length_tokens"
        if request.length_tokens < 1:
            raise ValueError(f"request {request.request_id!r} is empty")
        if request.length_tokens > limit:
            raise ValueError(f"request {request.request_id!r} has {request.length_tokens} tokens, more than "
                             f"{name}={limit}")

    def form_batch(self, now_s: float, queue: Sequence[TextRequest]) -> BatchDecision:
        """The batch to run at `now_s` from the waiting `queue` (TCB §5.2: invoked at the start of each time slot)."""
        for request in queue:
            self.check_request(request)
        latest_start = now_s + self.params.start_allowance_ms / 1000.0
        live = [r for r in queue if r.deadline_s >= latest_start]
        dropped = [r for r in queue if r.deadline_s < latest_start]
        decision = self._choose(live)
        decision.dropped = dropped
        return decision

    def _choose(self, live: list[TextRequest]) -> BatchDecision:  # pragma: no cover - interface
        raise NotImplementedError


def _first_fit(ordered: Sequence[TextRequest], num_bins: int, capacity_tokens: int) -> list[list[TextRequest]]:
    """Each request, in the order given, into the first bin with room; requests that fit nowhere wait."""
    bins: list[list[TextRequest]] = [[] for _ in range(num_bins)]
    free = [capacity_tokens] * num_bins
    for request in ordered:
        for b in range(num_bins):
            if request.length_tokens <= free[b]:
                bins[b].append(request)
                free[b] -= request.length_tokens
                break
    return bins


class OrderedFirstFitScheduler(BatchScheduler):
    """TCB §6.2.4's comparison schedulers: requests in a fixed order, first-fit into the rows (or fixed slots)."""

    def order_key(self, request: TextRequest) -> tuple:  # pragma: no cover - interface
        raise NotImplementedError

    def _choose(self, live: list[TextRequest]) -> BatchDecision:
        ordered = sorted(live, key=self.order_key)
        p = self.params
        if p.slot_size_tokens is None:
            return BatchDecision(rows=_first_fit(ordered, p.num_rows, p.row_length_tokens))
        per_row = p.row_length_tokens // p.slot_size_tokens
        slots = _first_fit(ordered, p.num_rows * per_row, p.slot_size_tokens)
        rows = [[r for slot in slots[k * per_row:(k + 1) * per_row] for r in slot] for k in range(p.num_rows)]
        return BatchDecision(rows=rows, slot_size_tokens=p.slot_size_tokens, slots=[s for s in slots if s])


class FcfsScheduler(OrderedFirstFitScheduler):
    """First come, first served: arrival order."""

    name = "fcfs"

    def order_key(self, request: TextRequest) -> tuple:
        return (request.arrival_s, request.deadline_s)


class SjfScheduler(OrderedFirstFitScheduler):
    """Shortest job first: fewest tokens first."""

    name = "sjf"

    def order_key(self, request: TextRequest) -> tuple:
        return (request.length_tokens, request.arrival_s)


class EdfScheduler(OrderedFirstFitScheduler):
    """Earliest deadline first (TCB §6.2.4 'DEF')."""

    name = "edf"

    def order_key(self, request: TextRequest) -> tuple:
        return (request.deadline_s, request.arrival_s)


@dataclass
class DasRows:
    """DAS's rows H_tk and, per row, its utility-dominant set N^U_tk (Slotted DAS needs both)."""

    rows: list[list[TextRequest]]
    utility_dominant: list[list[TextRequest]]


def das_rows(live: Sequence[TextRequest], num_rows: int, row_length_tokens: int, eta: float, q: float) -> DasRows:
    """TCB Alg. 1 (DAS), one batch: fill rows k = 0..B-1 from the waiting requests N_t.

    For each row: if all of N_t fits, it goes in (lines 4-5). Otherwise N_t is sorted by utility 1/l_n,
    non-increasing (line 7); s_tk is how many of the first requests fill the row (line 8); the first
    p_tk = eta * s_tk of them form the utility-dominant set N^U, which goes in (lines 9-10); the deadline-aware set
    N^D (the rest with utility >= q * mean utility of N^U) goes in by earliest deadline, greedily (lines 11-12);
    if room is left, the remaining requests go in greedily in utility order (lines 13-14).
    """
    # TCB Alg. 1 line 7: utility order; ties by deadline then arrival.
    waiting = sorted(live, key=lambda r: (-r.utility, r.deadline_s, r.arrival_s))
    rows: list[list[TextRequest]] = []
    dominant: list[list[TextRequest]] = []
    for _ in range(num_rows):
        if not waiting:
            break
        if sum(r.length_tokens for r in waiting) <= row_length_tokens:  # lines 4-5
            rows.append(waiting)
            dominant.append(list(waiting))
            waiting = []
            break
        used, s_tk = 0, 0  # line 8: s_tk
        for r in waiting:
            if used + r.length_tokens > row_length_tokens:
                break
            used += r.length_tokens
            s_tk += 1
        p_tk = max(1, math.floor(eta * s_tk))  # line 9: p_tk = eta * s_tk (at least one request)
        utility_set = waiting[:p_tk]
        row = list(utility_set)  # line 10
        room = row_length_tokens - sum(r.length_tokens for r in row)
        v_bar = sum(r.utility for r in utility_set) / len(utility_set)
        rest = waiting[p_tk:]
        deadline_set = sorted((r for r in rest if r.utility >= q * v_bar), key=lambda r: (r.deadline_s, r.arrival_s))
        for r in deadline_set:  # lines 11-12
            if r.length_tokens <= room:
                row.append(r)
                room -= r.length_tokens
        if room > 0:  # lines 13-14
            chosen = {id(r) for r in row}
            for r in rest:
                if id(r) not in chosen and r.length_tokens <= room:
                    row.append(r)
                    room -= r.length_tokens
        chosen = {id(r) for r in row}
        waiting = [r for r in waiting if id(r) not in chosen]
        rows.append(row)
        dominant.append(utility_set)
    return DasRows(rows=rows, utility_dominant=dominant)


class DasScheduler(BatchScheduler):
    """TCB Alg. 1: online deadline-aware scheduling for pure ConcatBatching (§5.2)."""

    name = "das"

    def _choose(self, live: list[TextRequest]) -> BatchDecision:
        p = self.params
        result = das_rows(live, p.num_rows, p.row_length_tokens, p.eta, p.q)  # TCB Alg. 1: eta, q
        return BatchDecision(rows=result.rows)


class SlottedDasScheduler(BatchScheduler):
    """TCB Alg. 2: slotted online deadline-aware scheduling (§5.3).

    DAS chooses the rows H_tk (line 2); the slot size z is the longest request of the utility-dominant sets H^U
    (lines 3-4), rounded up to `slot_granularity_tokens` (or the fixed `slot_size_tokens`); every row is cut into
    L // z slots (line 5) and each row's requests go into its slots greedily, longest first (lines 6-7). A request
    that fits no slot of its row waits for a later batch. With `backfill_slots` (plexserve's addition, off by
    default: it lost to the paper's Alg. 2 in benchmarks/paper_claims.py) the room left in the slots then takes
    other waiting requests that fit, by utility.
    """

    name = "slotted_das"

    def slot_size(self, utility_dominant: Sequence[Sequence[TextRequest]]) -> int:
        p = self.params
        if p.slot_size_tokens is not None:
            return p.slot_size_tokens
        longest = max((r.length_tokens for group in utility_dominant for r in group), default=1)
        granule = p.slot_granularity_tokens
        return min(p.row_length_tokens, granule * math.ceil(longest / granule))

    def _choose(self, live: list[TextRequest]) -> BatchDecision:
        p = self.params
        candidates = live if p.slot_size_tokens is None else [r for r in live if r.length_tokens <= p.slot_size_tokens]
        result = das_rows(candidates, p.num_rows, p.row_length_tokens, p.eta, p.q)  # line 2; TCB Alg. 1: eta, q
        z = self.slot_size(result.utility_dominant)  # lines 3-4: slot size z
        per_row = p.row_length_tokens // z  # line 5
        row_slots: list[list[list[TextRequest]]] = []
        for row in result.rows:  # lines 6-7
            longest_first = sorted(row, key=lambda r: (-r.length_tokens, r.deadline_s))
            row_slots.append(_first_fit(longest_first, per_row, z))
        if p.backfill_slots:
            self._backfill(row_slots, candidates, z)
        slots = [s for slots_of_row in row_slots for s in slots_of_row if s]
        rows = [[r for s in slots_of_row for r in s] for slots_of_row in row_slots]
        return BatchDecision(rows=rows, slot_size_tokens=z, slots=slots)

    @staticmethod
    def _backfill(row_slots: list[list[list[TextRequest]]], candidates: Sequence[TextRequest], z: int) -> None:
        """plexserve's addition to Alg. 2: room left in the slots takes waiting requests that fit, by utility.

        DAS filled each row for a row of L tokens; cut into slots of z, some of a row's requests no longer fit and
        the slots keep room that the paper's Alg. 2 leaves empty.
        """
        placed = {id(r) for slots_of_row in row_slots for s in slots_of_row for r in s}
        waiting = sorted((r for r in candidates if id(r) not in placed and r.length_tokens <= z),
                         key=lambda r: (-r.utility, r.deadline_s))
        for slots_of_row in row_slots:
            for slot in slots_of_row:
                room = z - sum(r.length_tokens for r in slot)
                for r in waiting:
                    if id(r) not in placed and r.length_tokens <= room:
                        slot.append(r)
                        placed.add(id(r))
                        room -= r.length_tokens


SCHEDULERS: dict[str, type[BatchScheduler]] = {
    cls.name: cls for cls in (DasScheduler, SlottedDasScheduler, FcfsScheduler, SjfScheduler, EdfScheduler)
}


def parse_batching_params(params: dict[str, Any] | BatchingParams | None) -> BatchingParams:
    """Validate batching params; a ValueError names every offending field."""
    if isinstance(params, BatchingParams):
        return params
    try:
        return BatchingParams.model_validate(params or {})
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'params'}: {e['msg']}" for e in error.errors())
        raise ValueError(f"invalid batching params: {problems}") from None


def make_batch_scheduler(name: str, params: dict[str, Any] | BatchingParams | None = None) -> BatchScheduler:
    """A scheduler by its registered name: das, slotted_das, fcfs, sjf or edf."""
    if name not in SCHEDULERS:
        raise ValueError(f"unknown batching policy name {name!r}; known: {', '.join(sorted(SCHEDULERS))}")
    return SCHEDULERS[name](parse_batching_params(params))
