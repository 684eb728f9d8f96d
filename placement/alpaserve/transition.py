"""What a move costs: a candidate placement simulated *through its rollout* from the running placement.

AlpaServe plans once and never prices a re-placement (§4.2 is offline). A live controller that judges each candidate
as if it were already deployed overrates every move: while a rollout runs, the slots it changes serve only what they
serve both before and after (`placement_rollout.transition_routes`), a slot that restarts serves nothing, and loading
weights competes with serving on shared devices. This module turns a rollout (`placement_rollout.plan_rollout`, make
before break, the same steps the controller runs) into a timeline of placements in force and simulates a workload
piecewise on it:

- step k lasts `step_overhead_s` (Serve config updates and routing) plus the longest load among its changes: a rehost
  loads the models it adds, each into the stage actors of a model it drops where there is one (the group replica
  recycles them: weights only) and else into new actor processes (`actor_start_s` first); a start or replace
  restarts a replica (`replica_start_s`) and starts and loads all of its models; a stop takes no load time;
- during step k the ingress routes by `transition_routes(before, after)`: those groups serve, nothing else;
- while a step loads (its load time, after its overhead) the devices serve at `1 / loading_slowdown` of their speed
  (every latency is scaled: on this project's stand-in machine all devices share two cores, so a load slows every
  group, not just the one that loads); during the overhead they serve at full speed;
- after the last step the target placement serves until the horizon ends.

Load times come from the profiles (`ConfigProfile.load_s`, measured per model and parallel configuration where the
profile has it); where a profile has none, the stand-in is the configuration's per-device weight bytes over
`load_bandwidth_bytes_per_s` (the devices of a group load in parallel). Each span is simulated on its own (queues
start empty at a span's start), as `benchmarks/fidelity.py` simulates a live run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from placement.alpaserve.placement_rollout import SlotChange, SlotLayout, plan_rollout, transition_routes
from placement.alpaserve.simulator import SERVED, SimulatorConfig, simulate
from placement.core.placement_plan import GroupPlacement, Placement
from placement.core.profiles import ProfileSet
from placement.core.transition_costs import TransitionModel
from placement.core.workload import Workload

__all__ = ["TransitionModel", "Span", "change_s", "serving_placement", "rollout_timeline", "scaled_profiles",
           "attainment_through"]


def change_s(transition: TransitionModel, profiles: ProfileSet, change: SlotChange) -> float:
    """Seconds one slot change takes (see the module doc)."""
    if change.after is None:
        return 0.0
    weights_s = lambda models: sum(transition.load_s(profiles, m, change.after) for m in models)  # noqa: E731
    if change.kind == "rehost":
        before = set(change.before.models if change.before is not None else [])
        added, dropped = set(change.after.models) - before, before - set(change.after.models)
        # The group replica recycles a dropped model's actors for an added one when no shard is tensor-parallel.
        recycled = min(len(added), len(dropped)) if change.after.config.intra_op_degree == 1 else 0
        return (len(added) - recycled) * transition.actor_start_s + weights_s(added)
    return transition.replica_start_s + len(change.after.models) * transition.actor_start_s + weights_s(
        change.after.models)


@dataclass
class Span:
    """A time span of the horizon and the placement serving during it."""

    start_s: float
    end_s: float
    placement: Placement
    loading: bool  # a rollout step loads models (latencies scaled by loading_slowdown)


def serving_placement(before: SlotLayout, after: SlotLayout, routes: list[list[str]] | None = None) -> Placement:
    """What serves while a step moves `before` to `after`: each slot's group with the models it serves both before
    and after (`routes`: `transition_routes(before, after)`, computed here unless the caller has them); slots left
    with none serve nothing."""
    if routes is None:
        routes = transition_routes(before, after)
    return Placement(groups=[GroupPlacement(num_devices=g.num_devices, config=g.config, models=models)
                             for g, models in zip(before.slots, routes) if g is not None and models])


def rollout_timeline(current: SlotLayout, target: Placement, profiles: ProfileSet, num_devices: int,
                     transition: TransitionModel, horizon_s: float,
                     max_changes_per_step: int = 1) -> tuple[list[Span], float]:
    """The spans of [0, horizon_s) when moving from `current` to `target` from time 0, and the rollout's seconds."""
    rollout = plan_rollout(current, target, num_devices, max_changes_per_step)
    spans: list[Span] = []
    t = 0.0
    before = current
    for step in rollout.steps:
        loading_s = max(change_s(transition, profiles, c) for c in step.changes)
        serving = serving_placement(before, step.layout)
        for duration, loading in ((transition.step_overhead_s, False), (loading_s, True)):
            if duration > 0:
                spans.append(Span(t, t + duration, serving, loading=loading))
                t += duration
        before = step.layout
    spans.append(Span(t, max(t, horizon_s), before.placement(), loading=False))
    return spans, t


def scaled_profiles(profiles: ProfileSet, factor: float) -> ProfileSet:
    """`profiles` with every stage latency multiplied by `factor` (devices slowed by a concurrent load)."""
    scaled = profiles.model_copy(deep=True)
    for model in scaled.models.values():
        for config in model.configs:
            for stage in config.stages:
                stage.latency_s = {b: s * factor for b, s in stage.latency_s.items()}
    return scaled


def attainment_through(spans: Sequence[Span], profiles: ProfileSet, workload: Workload, config: SimulatorConfig,
                       loading_profiles: ProfileSet | None = None) -> float:
    """SLO attainment of `workload` served span by span (each span on its own placement and profiles)."""
    if not len(workload):
        return 1.0
    met = np.zeros(len(workload), dtype=bool)
    for span in spans:
        index = np.flatnonzero((workload.arrival_s >= span.start_s) & (workload.arrival_s < span.end_s))
        if not len(index):
            continue
        if not span.placement.groups:
            continue  # nothing serves: every request of the span is missed
        used = loading_profiles if span.loading and loading_profiles is not None else profiles
        met[index] = simulate(span.placement, used, workload.take(index), config).status == SERVED
    # Requests past the last span (the horizon ends before the rollout does) are missed too.
    return float(met.mean())
