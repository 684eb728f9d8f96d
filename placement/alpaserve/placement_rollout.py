"""From the running placement to a new one in small, safe steps: which group slot changes how, and in what order.

A running plexserve application has a fixed number of group *slots* (Serve deployments `group-<i>`); each slot
runs one device group of the placement or stands empty. Moving to a new placement (AlpaServe §4.2's triple:
group partition, parallel configurations, model selection) changes slots in three ways:

- **keep**: the slot's group is in the new placement as it is; nothing happens to it;
- **rehost**: same devices and parallel configuration, other models; the replica loads the new models and drops
  the old ones in place (`reconfigure`, no restart);
- **start** / **stop** / **replace**: a group of another shape needs a new replica holding other devices (Serve
  restarts only that slot's deployment); a replace stops one group and starts another in its slot at once.

`plan_rollout` orders the changes make-before-break: groups start on free devices first; a group stops only when
the devices it holds are needed (and then hands them to a waiting group in the same step), preferring groups whose
models other running groups also host; at most
`max_changes_per_step` slots change per step. During a step the ingress routes only to what is serving both
before and after it (`transition_routes`), so no request is sent to a model that a replica is dropping.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from placement.core.placement_plan import GroupPlacement, Placement

ChangeKind = Literal["rehost", "start", "stop", "replace"]


class SlotLayout(BaseModel):
    """What each group slot runs: a device group, or nothing (None)."""

    model_config = ConfigDict(extra="forbid")

    slots: list[GroupPlacement | None] = Field(description="Per slot (deployment `group-<i>`): its group, or null when "
                                                           "empty.")

    @classmethod
    def from_placement(cls, placement: Placement | None, num_slots: int) -> "SlotLayout":
        groups = list(placement.groups) if placement is not None else []
        if len(groups) > num_slots:
            raise ValueError(f"placement has {len(groups)} groups; the application has {num_slots} group slots")
        return cls(slots=[*groups, *([None] * (num_slots - len(groups)))])

    def placement(self) -> Placement:
        """The running groups as a placement (empty slots left out)."""
        return Placement(groups=[group for group in self.slots if group is not None])

    @property
    def num_devices(self) -> int:
        return sum(group.num_devices for group in self.slots if group is not None)

    def routes(self) -> list[list[str]]:
        """Per slot, the models the ingress may send there."""
        return [sorted(group.models) if group is not None else [] for group in self.slots]


@dataclass(frozen=True)
class SlotChange:
    slot: int
    kind: ChangeKind
    before: GroupPlacement | None
    after: GroupPlacement | None

    def to_json(self) -> dict:
        describe = (lambda g: None if g is None  # noqa: E731
                    else {"num_devices": g.num_devices, "config": g.config.key(), "models": sorted(g.models)})
        return {"slot": self.slot, "kind": self.kind, "before": describe(self.before), "after": describe(self.after)}


@dataclass
class RolloutStep:
    """One batch of slot changes and the layout once it is applied."""

    changes: list[SlotChange]
    layout: SlotLayout


@dataclass
class Rollout:
    steps: list[RolloutStep] = field(default_factory=list)

    @property
    def changes(self) -> list[SlotChange]:
        return [change for step in self.steps for change in step.changes]

    @property
    def final(self) -> SlotLayout | None:
        return self.steps[-1].layout if self.steps else None


def _same_shape(a: GroupPlacement, b: GroupPlacement) -> bool:
    return a.num_devices == b.num_devices and a.config == b.config


def match_slots(current: SlotLayout, target: Placement) -> tuple[dict[int, GroupPlacement], list[GroupPlacement]]:
    """Target groups that can take over a running slot (slot -> group: kept or rehosted), and those that must start.

    Identical groups keep their slot; then each remaining target group takes the running slot of the same shape
    whose models overlap it most (a rehost moves the fewest models)."""
    free_slots = {i: g for i, g in enumerate(current.slots) if g is not None}
    matched: dict[int, GroupPlacement] = {}
    rest: list[GroupPlacement] = []
    for group in target.groups:
        same = next((i for i, g in free_slots.items()
                     if _same_shape(g, group) and sorted(g.models) == sorted(group.models)), None)
        if same is None:
            rest.append(group)
        else:
            matched[same] = group
            del free_slots[same]
    to_start = []
    for group in sorted(rest, key=lambda g: -len(g.models)):
        candidates = [i for i, g in free_slots.items() if _same_shape(g, group)]
        if not candidates:
            to_start.append(group)
            continue
        best = max(candidates, key=lambda i: (len(set(free_slots[i].models) & set(group.models)), -i))
        matched[best] = group
        del free_slots[best]
    return matched, to_start


def plan_rollout(current: SlotLayout, target: Placement, total_devices: int, max_changes_per_step: int = 1) -> Rollout:
    """The steps that move `current` to `target` on `total_devices` devices, make-before-break (see module doc)."""
    if max_changes_per_step < 1:
        raise ValueError(f"max_changes_per_step={max_changes_per_step}: must be >= 1")
    if target.num_devices > total_devices:
        raise ValueError(f"target placement uses {target.num_devices} devices; the cluster has {total_devices}")
    if len(target.groups) > len(current.slots):
        raise ValueError(f"target placement has {len(target.groups)} groups; the application has {len(current.slots)} "
                         "group slots")
    matched, to_start = match_slots(current, target)
    rehosts = [SlotChange(i, "rehost", current.slots[i], group) for i, group in sorted(matched.items())
               if sorted(group.models) != sorted(current.slots[i].models)]  # type: ignore[union-attr]
    to_stop = [i for i, g in enumerate(current.slots) if g is not None and i not in matched]
    slots = list(current.slots)
    rollout = Rollout()

    def commit(changes: list[SlotChange]) -> None:
        for change in changes:
            slots[change.slot] = change.after
        rollout.steps.append(RolloutStep(changes, SlotLayout(slots=list(slots))))

    # Rehosts first: they need no devices, and the models they add serve while groups move.
    for k in range(0, len(rehosts), max_changes_per_step):
        commit(rehosts[k:k + max_changes_per_step])
    pending = sorted(to_start, key=lambda g: g.num_devices)
    while pending or to_stop:
        used = sum(g.num_devices for g in slots if g is not None)
        step: list[SlotChange] = []
        free_devices = total_devices - used
        empty = [i for i, g in enumerate(slots) if g is None]
        for group in list(pending):
            if len(step) >= max_changes_per_step or not empty or group.num_devices > free_devices:
                continue
            slot = empty.pop(0)
            step.append(SlotChange(slot, "start", None, group))
            free_devices -= group.num_devices
            pending.remove(group)
        if not step:
            if not to_stop:
                raise ValueError("target placement cannot be reached: no free devices and no group left to stop")
            # Break before make only when needed: stop the group whose models the other running groups host most.
            hosted_elsewhere = lambda i: sum(any(m in g.models for j, g in enumerate(slots) if g is not None and j != i)  # noqa: E731
                                             for m in slots[i].models)  # type: ignore[union-attr]
            order = sorted(to_stop,
                           key=lambda i: (-(hosted_elsewhere(i) == len(slots[i].models)), -slots[i].num_devices, i))  # type: ignore[union-attr]
            for i in order[:max_changes_per_step]:
                freed = free_devices + slots[i].num_devices  # type: ignore[union-attr]
                fits = next((g for g in pending if g.num_devices <= freed), None)
                if fits is not None:  # the freed devices go straight to a new group: one replica restart, not two
                    step.append(SlotChange(i, "replace", slots[i], fits))
                    pending.remove(fits)
                    free_devices = freed - fits.num_devices
                else:
                    step.append(SlotChange(i, "stop", slots[i], None))
                    free_devices = freed
                to_stop.remove(i)
        commit(step)
    return rollout


def transition_routes(before: SlotLayout, after: SlotLayout) -> list[list[str]]:
    """Per slot, the models served both before and after a step: where the ingress may route while it runs."""
    routes = []
    for old, new in zip(before.slots, after.slots):
        if old is None or new is None or not _same_shape(old, new):
            routes.append([])
        else:
            routes.append(sorted(set(old.models) & set(new.models)))
    return routes
