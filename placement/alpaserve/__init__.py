"""AlpaServe (OSDI'23): the discrete-event simulator, the placement planner (Alg. 1-2) and its baselines, dispatch
and batch forming (§4.3, §6.5), the paper's Table 1 profiles, and plexserve's re-placement (a re-plan policy and a
slot-by-slot rollout) and planning specs.

Builds on :mod:`placement.core` and :mod:`placement.sim`.
"""

from placement.alpaserve.baselines import (
    DynamicResult,
    WindowPlacement,
    clockwork_plus_plus,
    round_robin,
    selective_replication,
)
from placement.alpaserve.batching import BatchPolicy, MaxBatchWithinSLO
from placement.alpaserve.deployment_planning import (
    DeploymentPlanning,
    parse_planning,
    plan_deployment,
    planning_spec,
    replan_policy,
)
from placement.alpaserve.dispatch import (
    DispatchPolicy,
    EarliestFinishDispatch,
    GroupView,
    RoundRobinDispatch,
    ShortestQueueDispatch,
    dispatch_from_spec,
    make_dispatch,
)
from placement.alpaserve.paper_profiles import (
    OverheadModel,
    PaperModelSet,
    model_profile,
    replicate_profiles,
    table1_model_set,
    table1_profiles,
)
from placement.alpaserve.placement_rollout import (
    ChangeKind,
    Rollout,
    RolloutStep,
    SlotChange,
    SlotLayout,
    match_slots,
    plan_rollout,
    transition_routes,
)
from placement.alpaserve.plan_spec import (
    PlannerSpec,
    PlanSpec,
    ProfilesSpec,
    SimulationSpec,
    WorkloadSpec,
    build_workload,
    load_plan_spec,
    model_names,
    planner_config,
    prepare,
    run_planner,
    simulator_config,
    slos_s,
)
from placement.alpaserve.planner import (
    PlannerConfig,
    device_buckets,
    greedy_selection,
    group_partitions,
    model_buckets,
    parallel_configs,
    place_unplaced,
    plan,
    select_models,
)
from placement.alpaserve.replanning import Candidate, CandidateName, ModelTrafficFit, ReplanDecision, ReplanPolicy
from placement.alpaserve.simulator import (
    AlpaServeEngine,
    GroupSpec,
    LatencyCache,
    LatencyStats,
    SimulationResult,
    SimulationSummary,
    SimulatorConfig,
    build_tables,
    simulate,
    simulate_groups,
)

__all__ = [
    "BatchPolicy", "MaxBatchWithinSLO", "GroupView", "DispatchPolicy", "ShortestQueueDispatch",
    "EarliestFinishDispatch", "RoundRobinDispatch", "make_dispatch", "dispatch_from_spec", "SimulatorConfig",
    "LatencyCache", "GroupSpec", "build_tables", "LatencyStats", "SimulationSummary", "SimulationResult", "simulate",
    "simulate_groups", "AlpaServeEngine", "PlannerConfig", "greedy_selection", "model_buckets", "device_buckets",
    "group_partitions", "parallel_configs", "plan", "select_models", "place_unplaced", "selective_replication",
    "round_robin", "WindowPlacement", "DynamicResult", "clockwork_plus_plus", "OverheadModel", "PaperModelSet",
    "model_profile", "table1_profiles", "table1_model_set", "replicate_profiles", "ProfilesSpec", "WorkloadSpec",
    "PlannerSpec", "SimulationSpec", "PlanSpec", "load_plan_spec", "model_names", "slos_s", "build_workload",
    "prepare", "simulator_config", "planner_config", "run_planner", "CandidateName", "ModelTrafficFit", "Candidate",
    "ReplanDecision", "ReplanPolicy", "DeploymentPlanning", "parse_planning", "planning_spec", "replan_policy",
    "plan_deployment", "ChangeKind", "SlotLayout", "SlotChange", "RolloutStep", "Rollout", "match_slots",
    "plan_rollout", "transition_routes",
]
