"""Small moves from the running placement: one model added, removed, swapped or moved between groups.

AlpaServe's planner searches from scratch (Alg. 2) or re-selects every model of the running groups (Alg. 1); after
a small traffic shift both can return a placement that differs in many replicas from the running one, and each
changed replica costs a load during the rollout. The live controller therefore also tries the placements one
replica away from the running one (a plexserve addition, not in the paper):

- **add** a replica of model m to group g (g has room for it);
- **remove** model m's replica from group g (another group still hosts m: the live system keeps answering it);
- **swap**: group g drops model x and hosts model y instead;
- **move**: model m leaves group g and goes to group h.

The groups (devices, parallel configurations) never change, so every move is a rehost of one or two slots. Each
neighbour is simulated on the planning workload and the best one is the candidate.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from placement.core.placement_plan import GroupPlacement, Placement
from placement.core.profiles import ProfileSet


def _with(groups: Sequence[GroupPlacement], changes: dict[int, list[str]]) -> list[GroupPlacement]:
    return [g.model_copy(update={"models": sorted(changes[i])}) if i in changes else g for i, g in enumerate(groups)]


def neighbours(current: Placement, model_names: Sequence[str], profiles: ProfileSet,
               device_memory_bytes: int) -> Iterator[tuple[str, Placement]]:
    """Every placement one move away from `current` (see the module doc) that fits device memory and still hosts
    every model `current` hosts; yields (description, placement)."""
    groups = list(current.groups)

    def fits(group: GroupPlacement, models: list[str]) -> bool:
        if any(not profiles.models[m].has(group.config) for m in models):
            return False
        return group.model_copy(update={"models": models}).weight_bytes_per_device(profiles) <= device_memory_bytes

    def hosted_elsewhere(model: str, index: int) -> bool:
        return any(model in g.models for j, g in enumerate(groups) if j != index)

    for i, group in enumerate(groups):
        absent = [m for m in model_names if m not in group.models]
        for m in absent:
            if fits(group, [*group.models, m]):
                yield f"add {m} to group {i}", Placement(groups=_with(groups, {i: [*group.models, m]}))
        for x in group.models:
            if hosted_elsewhere(x, i):
                yield f"remove {x} from group {i}", Placement(groups=_with(groups,
                                                                           {i: [m for m in group.models if m != x]}))
            for y in absent:
                swapped = [y if m == x else m for m in group.models]
                if hosted_elsewhere(x, i) and fits(group, swapped):
                    yield f"swap {x} for {y} in group {i}", Placement(groups=_with(groups, {i: swapped}))
            for j, other in enumerate(groups):
                if j == i or x in other.models or not fits(other, [*other.models, x]):
                    continue
                yield (f"move {x} from group {i} to group {j}",
                       Placement(groups=_with(groups, {i: [m for m in group.models if m != x], j: [*other.models, x]})))
