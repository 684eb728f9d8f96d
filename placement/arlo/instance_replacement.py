"""Instance replacement plan after a new runtime allocation (Arlo §4 "Instance replacement").

Given the runtime each current instance runs and the new instance count per runtime, keep as many instances as
possible on their runtime and change only the rest: the fewest instances are re-loaded, added or released. The
changes are applied in small batches so the uninvolved instances never absorb a large share of traffic at once.
Among a runtime's surplus instances the least busy change first (their queues drain soonest).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

#: Arlo §4 replaces "in small batches"; the batch size is not given, this is plexserve's default.
DEFAULT_REPLACEMENT_BATCH = 2


@dataclass(frozen=True)
class InstanceChange:
    """One step: `instance_id` None adds a new instance; `to_max_length_tokens` None releases one."""

    instance_id: Hashable | None
    from_max_length_tokens: int | None
    to_max_length_tokens: int | None


@dataclass
class ReplacementPlan:
    keep: dict[Hashable, int] = field(default_factory=dict)
    changes: list[InstanceChange] = field(default_factory=list)
    batches: list[list[InstanceChange]] = field(default_factory=list)

    @property
    def num_changed(self) -> int:
        return len(self.changes)


def plan_replacement(current: dict[Hashable, int], target_counts: dict[int, int],
                     loads: dict[Hashable, int] | None = None,
                     batch_size: int = DEFAULT_REPLACEMENT_BATCH) -> ReplacementPlan:
    """The plan changing the fewest instances from `current` (instance -> max length) to `target_counts`.

    Every runtime keeps min(current, target) of its instances, which is the most any plan can keep, so the number
    of changes, max(sum of surpluses, sum of deficits), is the least possible. Surplus instances are re-loaded with a
    runtime in deficit; the rest are released (fewer devices) and missing ones are added (more devices).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if any(count < 0 for count in target_counts.values()):
        raise ValueError(f"target_counts must be >= 0, got {target_counts}")
    loads = loads or {}
    by_runtime: dict[int, list[Hashable]] = {}
    for instance, length in current.items():
        by_runtime.setdefault(length, []).append(instance)
    plan = ReplacementPlan()
    surplus: list[tuple[Hashable, int]] = []
    for length, instances in by_runtime.items():
        instances.sort(key=lambda iid: (loads.get(iid, 0), str(iid)))  # least busy first
        excess = max(len(instances) - target_counts.get(length, 0), 0)
        surplus.extend((iid, length) for iid in instances[:excess])
        plan.keep.update({iid: length for iid in instances[excess:]})
    deficits: list[int] = []
    for length in sorted(target_counts):
        deficits.extend([length] * max(target_counts[length] - len(by_runtime.get(length, [])), 0))
    surplus.sort(key=lambda item: (loads.get(item[0], 0), str(item[0])))
    for (instance, old), new in zip(surplus, deficits):
        plan.changes.append(InstanceChange(instance, old, new))
    for instance, old in surplus[len(deficits):]:
        plan.changes.append(InstanceChange(instance, old, None))
    for new in deficits[len(surplus):]:
        plan.changes.append(InstanceChange(None, None, new))
    plan.batches = [plan.changes[k:k + batch_size] for k in range(0, len(plan.changes), batch_size)]
    return plan


def rank_assignment(previous: dict[int, int], target_counts: dict[int, int]) -> dict[int, int]:
    """Runtime per replica rank 0..n-1 for `target_counts`, keeping each surviving rank's runtime where possible.

    The live deployment identifies instances by Ray Serve replica rank and cannot choose which replicas a downscale
    stops, so ranks >= n count as released; among ranks < n this is `plan_replacement`'s minimal plan.
    """
    total = sum(target_counts.values())
    if total < 1:
        raise ValueError(f"target_counts must place at least one instance, got {target_counts}")
    surviving = {rank: length for rank, length in previous.items() if 0 <= rank < total}
    plan = plan_replacement(surviving, target_counts)
    assignment = dict(plan.keep)
    free_ranks = iter(sorted(set(range(total)) - set(surviving)))
    for change in plan.changes:
        if change.to_max_length_tokens is None:
            continue
        rank = change.instance_id if change.instance_id is not None else next(free_ranks)
        assignment[rank] = change.to_max_length_tokens
    return dict(sorted(assignment.items()))
