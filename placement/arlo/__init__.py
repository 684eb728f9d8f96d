"""Arlo (polymorphing runtimes): runtime profiles, the Runtime Scheduler's allocation (Eq. 1-7) and its live
re-allocation, instance replacement, target-tracking autoscaling, the Request Scheduler (multi-level queue) and
a simulation of one polymorphing request stream.

Builds on :mod:`placement.core` and :mod:`placement.sim`; imports no other system package.
"""

from placement.arlo.autoscaling import AutoscalingParams, ScalingDecision, TargetTrackingAutoscaler
from placement.arlo.instance_replacement import InstanceChange, ReplacementPlan, plan_replacement, rank_assignment
from placement.arlo.live_allocator import (
    AllocationDecision,
    LiveAllocatorParams,
    LiveRuntimeAllocator,
    Solver,
    apply_scaling,
    profiles_from_capacities,
)
from placement.arlo.paper_profiles import dynamic_latency_s, paper_runtime_profiles, paper_slo_s, staircase_latency_s
from placement.arlo.request_scheduler import (
    ArloDispatch,
    ArloDispatchParams,
    BinPackingDispatch,
    InterGroupGreedy,
    IntraGroupLoadBalance,
    MultiLevelQueue,
)
from placement.arlo.runtime_allocation import (
    PeriodicAllocatorParams,
    PeriodicRuntimeAllocator,
    RuntimeAllocation,
    allocation_lower_bounds,
    evaluate_allocation,
    proportional_allocation,
    solve_allocation,
    solve_allocation_brute_force,
)
from placement.arlo.runtimes import (
    RuntimeProfile,
    RuntimeProfileSet,
    choose_runtime_lengths,
    ideal_runtime_length,
    queueing_latency_s,
)
from placement.arlo.simulation import ArloEngine, SimulationResult, simulate

__all__ = [
    "choose_runtime_lengths", "ideal_runtime_length", "RuntimeProfile", "queueing_latency_s", "RuntimeProfileSet",
    "staircase_latency_s", "dynamic_latency_s", "paper_slo_s", "paper_runtime_profiles", "RuntimeAllocation",
    "allocation_lower_bounds", "evaluate_allocation", "solve_allocation_brute_force", "solve_allocation",
    "PeriodicAllocatorParams", "PeriodicRuntimeAllocator", "proportional_allocation", "InstanceChange",
    "ReplacementPlan", "plan_replacement", "rank_assignment", "AutoscalingParams", "ScalingDecision",
    "TargetTrackingAutoscaler", "Solver", "profiles_from_capacities", "LiveAllocatorParams", "AllocationDecision",
    "LiveRuntimeAllocator", "apply_scaling", "ArloDispatchParams", "MultiLevelQueue", "ArloDispatch",
    "IntraGroupLoadBalance", "InterGroupGreedy", "BinPackingDispatch", "SimulationResult", "simulate", "ArloEngine",
]
