"""Where a variable-length request goes among polymorphing runtime instances: Arlo's Request Scheduler (§3.4).

Arlo keeps a multi-level queue (Fig. 5): one level per runtime, in increasing max length, and in each level a
priority queue of that runtime's instances keyed by outstanding requests (queued + executing), least loaded at
the head. `ArloDispatch.dispatch` is Alg. 1:

    candidates = runtimes whose max_length >= request length, shortest first, at most L of them   (lines 2-5)
    for each candidate: P = head.outstanding / capacity; if P < lambda: take it (lines 6-13)
                        else lambda *= alpha (line 15)
    if none qualified: the first candidate, i.e. the ideal runtime (lines 18-19)
    send to that level's head instance and update its priority queue (lines 21-22)

Baselines from Arlo §5.2.3: `IntraGroupLoadBalance` (ILB: ideal runtime, least-loaded instance in it) and
`InterGroupGreedy` (IG: the least busy head among all candidate runtimes); and `BinPackingDispatch`, an
INFaaS-like first fit over instances that can take the length (Arlo §5 compared scheme).

Every policy is a plain object: `dispatch(length_tokens) -> instance id` counts the request as outstanding on that
instance, `complete(instance_id)` when it finishes. The live router (rayserve_apps/routers/polymorph.py) and the
simulator (placement/arlo/simulation.py) drive the same objects. A dispatch costs O(L + log(N/K)) (Arlo §3.4).
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from typing import Hashable

from pydantic import BaseModel, ConfigDict, Field

#: Arlo §5 "Parameter settings".
ARLO_LAMBDA = 0.85
ARLO_ALPHA = 0.9
ARLO_MAX_LEVELS = 6
#: Rebuild a level's heap when stale entries outnumber live instances by this factor.
_HEAP_REBUILD_FACTOR = 4


class ArloDispatchParams(BaseModel):
    """Parameters of Alg. 1 (policy role 'polymorphing', params key 'dispatch')."""

    model_config = ConfigDict(extra="forbid")

    threshold: float = Field(default=ARLO_LAMBDA, gt=0, description="Arlo Alg. 1 lambda: initial congestion threshold.")
    decay: float = Field(default=ARLO_ALPHA, gt=0, le=1, description="Arlo Alg. 1 alpha: threshold decay per level.")
    max_levels: int = Field(default=ARLO_MAX_LEVELS, ge=1, description="Arlo Alg. 1 L: most candidate runtimes peeked.")


@dataclass
class _Level:
    """One runtime: its max length, per-instance capacity M_i and a lazy min-heap of (outstanding, slot, version)."""

    max_length_tokens: int
    capacity_requests: int
    heap: list
    size: int = 0


class MultiLevelQueue:
    """Runtime levels and instance loads (Arlo Fig. 5), shared by all dispatch policies here."""

    def __init__(self, capacities_by_length: dict[int, int]):
        if not capacities_by_length:
            raise ValueError("capacities_by_length needs at least one runtime")
        for length, capacity in capacities_by_length.items():
            if length < 1 or capacity < 1:
                raise ValueError(f"runtime {length}: max length and capacity must be >= 1, got capacity {capacity}")
        self._lengths = sorted(capacities_by_length)
        self._levels = [_Level(length, capacities_by_length[length], []) for length in self._lengths]
        self._level_of_length = {length: index for index, length in enumerate(self._lengths)}
        self._slot_of: dict[Hashable, int] = {}
        self._ids: list[Hashable] = []
        self._level: list[int] = []
        self._outstanding: list[int] = []
        self._version: list[int] = []
        self._free_slots: list[int] = []

    # --- instances -------------------------------------------------------------------------------------------
    def add_instance(self, instance_id: Hashable, max_length_tokens: int, outstanding: int = 0) -> None:
        if instance_id in self._slot_of:
            raise ValueError(f"instance {instance_id!r} is already in the queue")
        if max_length_tokens not in self._level_of_length:
            raise ValueError(f"instance {instance_id!r}: no runtime with max length {max_length_tokens} (have "
                             f"{self._lengths})")
        level = self._level_of_length[max_length_tokens]
        if self._free_slots:
            slot = self._free_slots.pop()
            self._ids[slot], self._level[slot], self._outstanding[slot] = instance_id, level, outstanding
            self._version[slot] += 1
        else:
            slot = len(self._ids)
            self._ids.append(instance_id)
            self._level.append(level)
            self._outstanding.append(outstanding)
            self._version.append(0)
        self._slot_of[instance_id] = slot
        entry = self._levels[level]
        entry.size += 1
        heapq.heappush(entry.heap, (outstanding, slot, self._version[slot]))

    def remove_instance(self, instance_id: Hashable) -> None:
        slot = self._slot_of.pop(instance_id)
        self._version[slot] += 1  # its heap entries go stale
        self._levels[self._level[slot]].size -= 1
        self._level[slot] = -1
        self._free_slots.append(slot)

    def set_outstanding(self, instance_id: Hashable, outstanding: int) -> None:
        """Overwrite an instance's count (e.g. from a replica's own report)."""
        self._update(self._slot_of[instance_id], outstanding)

    def complete(self, instance_id: Hashable) -> None:
        """One request finished on `instance_id` (inlined `_update`: called once per request)."""
        slot = self._slot_of.get(instance_id)
        if slot is None:
            return
        count = self._outstanding[slot] - 1
        if count < 0:
            count = 0
        self._outstanding[slot] = count
        stamp = self._version[slot] + 1
        self._version[slot] = stamp
        level = self._levels[self._level[slot]]
        heapq.heappush(level.heap, (count, slot, stamp))
        if len(level.heap) > _HEAP_REBUILD_FACTOR * (level.size + 1) + 16:
            self._rebuild(level)

    def outstanding(self, instance_id: Hashable) -> int:
        return self._outstanding[self._slot_of[instance_id]]

    def instances(self) -> dict[Hashable, int]:
        """instance id -> max length of its runtime."""
        return {iid: self._lengths[self._level[slot]] for iid, slot in self._slot_of.items()}

    @property
    def max_lengths(self) -> list[int]:
        return list(self._lengths)

    def capacity(self, max_length_tokens: int) -> int:
        return self._levels[self._level_of_length[max_length_tokens]].capacity_requests

    # --- internals ------------------------------------------------------------------------------------------
    def _update(self, slot: int, outstanding: int) -> None:
        self._outstanding[slot] = outstanding
        self._version[slot] += 1
        level = self._levels[self._level[slot]]
        heapq.heappush(level.heap, (outstanding, slot, self._version[slot]))
        if len(level.heap) > _HEAP_REBUILD_FACTOR * (level.size + 1) + 16:
            self._rebuild(level)

    def _rebuild(self, level: _Level) -> None:
        live = {}
        for _, slot, version in level.heap:
            if self._version[slot] == version:
                live[slot] = (self._outstanding[slot], slot, version)
        level.heap = list(live.values())
        heapq.heapify(level.heap)

    def _head(self, level: _Level) -> int:
        """Slot of the level's least-loaded instance (-1 when it has none); drops stale heap entries."""
        heap, version = level.heap, self._version
        while heap:
            top = heap[0]
            if version[top[1]] == top[2]:
                return top[1]
            heapq.heappop(heap)
        return -1

    def _candidate_levels(self, length_tokens: int) -> int:
        """Index of the first runtime long enough for the request."""
        first = bisect.bisect_left(self._lengths, length_tokens)
        if first == len(self._lengths):
            raise ValueError(f"request of {length_tokens} tokens exceeds the longest runtime ({self._lengths[-1]} "
                             "tokens)")
        return first

    def _send(self, slot: int) -> Hashable:
        self._update(slot, self._outstanding[slot] + 1)
        return self._ids[slot]

    def _no_instance(self, length_tokens: int):
        raise ValueError(f"no runtime instance can take a request of {length_tokens} tokens "
                         f"(instances per runtime: { {lv.max_length_tokens: lv.size for lv in self._levels} })")

    def dispatch(self, length_tokens: int) -> Hashable:  # pragma: no cover - interface
        raise NotImplementedError


class ArloDispatch(MultiLevelQueue):
    """Arlo Alg. 1: demote to a longer runtime only while its head instance is below a decaying threshold."""

    def __init__(self, capacities_by_length: dict[int, int], threshold: float = ARLO_LAMBDA,
                 decay: float = ARLO_ALPHA, max_levels: int = ARLO_MAX_LEVELS):
        super().__init__(capacities_by_length)
        params = ArloDispatchParams(threshold=threshold, decay=decay, max_levels=max_levels)
        self.threshold = params.threshold  # Arlo Alg. 1: lambda
        self.decay = params.decay          # Arlo Alg. 1: alpha
        self.max_levels = params.max_levels  # Arlo Alg. 1: L

    def choose(self, length_tokens: int) -> int:
        """Alg. 1 lines 1-20: the slot of the instance the request goes to (no state change)."""
        first = self._candidate_levels(length_tokens)
        levels, outstanding, head = self._levels, self._outstanding, self._head
        threshold = self.threshold
        fallback = -1
        peeked = 0
        for index in range(first, len(levels)):
            level = levels[index]
            if level.size == 0:
                continue  # a runtime with no instance is not a candidate
            slot = head(level)
            if fallback < 0:
                fallback = slot  # Q_e[0], the ideal runtime's head (line 19)
            if outstanding[slot] / level.capacity_requests < threshold:  # lines 7-13
                return slot
            threshold *= self.decay  # line 15
            peeked += 1
            if peeked == self.max_levels:  # lines 3-4: only the first L candidates
                break
        if fallback < 0:
            self._no_instance(length_tokens)
        return fallback

    def choose_instance(self, length_tokens: int) -> Hashable:
        """The instance Alg. 1 would send the request to, without counting it (for callers that count themselves)."""
        return self._ids[self.choose(length_tokens)]

    def dispatch(self, length_tokens: int) -> Hashable:
        """Alg. 1 in full: choose, send to the head instance, update its level's priority queue (lines 21-22).

        The same steps as `choose` + `_send`, inlined: this is the hot path (Arlo §5.1.4 asks for 150k/s).
        """
        lengths = self._lengths
        first = bisect.bisect_left(lengths, length_tokens)
        if first == len(lengths):
            raise ValueError(f"request of {length_tokens} tokens exceeds the longest runtime ({lengths[-1]} tokens)")
        levels, outstanding, version = self._levels, self._outstanding, self._version
        threshold, decay, budget = self.threshold, self.decay, self.max_levels
        chosen = fallback = -1
        chosen_level = fallback_level = None
        for index in range(first, len(levels)):
            level = levels[index]
            if not level.size:
                continue
            heap = level.heap
            top = heap[0]
            while version[top[1]] != top[2]:  # drop stale entries
                heapq.heappop(heap)
                top = heap[0]
            slot = top[1]
            if fallback < 0:
                fallback, fallback_level = slot, level
            if outstanding[slot] < threshold * level.capacity_requests:
                chosen, chosen_level = slot, level
                break
            threshold *= decay
            budget -= 1
            if not budget:
                break
        if chosen < 0:
            if fallback < 0:
                self._no_instance(length_tokens)
            chosen, chosen_level = fallback, fallback_level
        count = outstanding[chosen] + 1
        outstanding[chosen] = count
        stamp = version[chosen] + 1
        version[chosen] = stamp
        heap = chosen_level.heap
        heapq.heappush(heap, (count, chosen, stamp))
        if len(heap) > _HEAP_REBUILD_FACTOR * (chosen_level.size + 1) + 16:
            self._rebuild(chosen_level)
        return self._ids[chosen]


class IntraGroupLoadBalance(MultiLevelQueue):
    """ILB (Arlo §5.2.3): the runtime needing the least padding, load-balanced within it."""

    def dispatch(self, length_tokens: int) -> Hashable:
        for index in range(self._candidate_levels(length_tokens), len(self._levels)):
            level = self._levels[index]
            if level.size:
                return self._send(self._head(level))
        self._no_instance(length_tokens)


class InterGroupGreedy(MultiLevelQueue):
    """IG (Arlo §5.2.3): the least busy instance (lowest outstanding/capacity) among all candidate runtimes."""

    def dispatch(self, length_tokens: int) -> Hashable:
        best, best_load = -1, float("inf")
        for index in range(self._candidate_levels(length_tokens), len(self._levels)):
            level = self._levels[index]
            if level.size:
                slot = self._head(level)
                load = self._outstanding[slot] / level.capacity_requests
                if load < best_load:  # ties keep the shorter runtime
                    best, best_load = slot, load
        if best < 0:
            self._no_instance(length_tokens)
        return self._send(best)


class BinPackingDispatch(MultiLevelQueue):
    """INFaaS-like bin packing (Arlo §5): the first instance, shortest runtime first, that is under capacity.

    When every candidate is full, the least congested one. O(instances) per request: a baseline, not for speed.
    """

    def dispatch(self, length_tokens: int) -> Hashable:
        first = self._candidate_levels(length_tokens)
        best, best_load = -1, float("inf")
        for slot in sorted(self._slot_of.values()):
            level_index = self._level[slot]
            if level_index < first:
                continue
            capacity = self._levels[level_index].capacity_requests
            if self._outstanding[slot] < capacity:
                return self._send(slot)
            if self._outstanding[slot] / capacity < best_load:
                best, best_load = slot, self._outstanding[slot] / capacity
        if best < 0:
            self._no_instance(length_tokens)
        return self._send(best)


DISPATCH_POLICIES = {
    "arlo": ArloDispatch,
    "ilb": IntraGroupLoadBalance,
    "ig": InterGroupGreedy,
    "bin_packing": BinPackingDispatch,
}
