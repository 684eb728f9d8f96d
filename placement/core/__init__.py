"""The shared core of every policy: what to serve (the deployment spec), what is known of each model (latency
and memory profiles over one batch-latency table type), a placement as plain data, the traffic (arrival
processes, workloads, trace replay) and the live traffic window.

Imports nothing from the system packages (alpaserve, arlo, otas, tcb); they all build on it.
"""

from placement.core.arrivals import (
    ArrivalProcess,
    GammaProcess,
    MarkovModulatedProcess,
    PoissonProcess,
    poisson_arrivals,
)
from placement.core.deployment_spec import (
    ClusterSpec,
    ControllerSpec,
    DeploymentSpec,
    ModelSpec,
    PolicySpec,
    ServingSpec,
    format_validation_error,
    is_valid_model_name,
    parse_spec,
    spec_json_schema,
)
from placement.core.latency_table import Beyond, LatencyTable, check_latency_table, table_latency_s
from placement.core.placement_plan import GroupPlacement, Placement, SearchStats
from placement.core.profiles import ConfigProfile, ModelProfile, ParallelConfig, ProfileSet, StageProfile
from placement.core.traces import (
    FittedTrace,
    Trace,
    fit_arrivals,
    fit_gamma_windows,
    function_to_model,
    load_maf2019,
    load_maf2021,
    load_trace,
    trace_workload,
)
from placement.core.traffic_window import ModelWindowStats, ObservedTraffic, Outcome, RequestRecord, TrafficWindow
from placement.core.workload import (
    ClippedNormalLength,
    EmpiricalLength,
    FixedLength,
    LengthDistribution,
    ModelTraffic,
    ShiftingPopularity,
    Workload,
    gamma_workload,
    generate_workload,
    power_law_popularity,
    uniform_popularity,
)

__all__ = [
    "Beyond", "check_latency_table", "LatencyTable", "table_latency_s", "ParallelConfig", "StageProfile",
    "ConfigProfile", "ModelProfile", "ProfileSet", "GroupPlacement", "SearchStats", "Placement", "ModelSpec",
    "ClusterSpec", "PolicySpec", "ServingSpec", "ControllerSpec", "DeploymentSpec", "format_validation_error",
    "parse_spec", "spec_json_schema", "is_valid_model_name", "ArrivalProcess", "PoissonProcess", "GammaProcess",
    "MarkovModulatedProcess", "poisson_arrivals", "uniform_popularity", "power_law_popularity", "LengthDistribution",
    "FixedLength", "ClippedNormalLength", "EmpiricalLength", "Workload", "ModelTraffic", "ShiftingPopularity",
    "generate_workload", "gamma_workload", "Trace", "load_maf2019", "load_maf2021", "load_trace", "FittedTrace",
    "function_to_model", "fit_gamma_windows", "fit_arrivals", "trace_workload", "Outcome", "ObservedTraffic",
    "RequestRecord", "ModelWindowStats", "TrafficWindow",
]
