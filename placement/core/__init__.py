"""The shared core of every policy: what to serve (the deployment spec), what is known of each model (latency
and memory profiles over one batch-latency table type), a placement as plain data, the traffic (arrival
processes, workloads, trace replay) and the live traffic window.

Imports nothing from the system packages (alpaserve, arlo, otas, tcb); they all build on it.
"""

from placement.core.latency_table import Beyond, check_latency_table, LatencyTable, table_latency_s
from placement.core.profiles import ParallelConfig, StageProfile, ConfigProfile, ModelProfile, ProfileSet
from placement.core.placement_plan import GroupPlacement, SearchStats, Placement
from placement.core.deployment_spec import (
    ModelSpec, ClusterSpec, PolicySpec, ServingSpec, ControllerSpec, DeploymentSpec, format_validation_error,
    parse_spec, spec_json_schema, is_valid_model_name,
)
from placement.core.arrivals import (
    ArrivalProcess, PoissonProcess, GammaProcess, MarkovModulatedProcess, poisson_arrivals,
)
from placement.core.workload import (
    uniform_popularity, power_law_popularity, LengthDistribution, FixedLength, ClippedNormalLength, EmpiricalLength,
    Workload, ModelTraffic, generate_workload, gamma_workload,
)
from placement.core.traces import (
    Trace, load_maf2019, load_maf2021, load_trace, FittedTrace, function_to_model, fit_gamma_windows, fit_arrivals,
    trace_workload,
)
from placement.core.traffic_window import Outcome, ObservedTraffic, RequestRecord, ModelWindowStats, TrafficWindow

__all__ = [
    "Beyond", "check_latency_table", "LatencyTable", "table_latency_s", "ParallelConfig", "StageProfile",
    "ConfigProfile", "ModelProfile", "ProfileSet", "GroupPlacement", "SearchStats", "Placement", "ModelSpec",
    "ClusterSpec", "PolicySpec", "ServingSpec", "ControllerSpec", "DeploymentSpec", "format_validation_error",
    "parse_spec", "spec_json_schema", "is_valid_model_name", "ArrivalProcess", "PoissonProcess", "GammaProcess",
    "MarkovModulatedProcess", "poisson_arrivals", "uniform_popularity", "power_law_popularity", "LengthDistribution",
    "FixedLength", "ClippedNormalLength", "EmpiricalLength", "Workload", "ModelTraffic", "generate_workload",
    "gamma_workload", "Trace", "load_maf2019", "load_maf2021", "load_trace", "FittedTrace", "function_to_model",
    "fit_gamma_windows", "fit_arrivals", "trace_workload", "Outcome", "ObservedTraffic", "RequestRecord",
    "ModelWindowStats", "TrafficWindow",
]
