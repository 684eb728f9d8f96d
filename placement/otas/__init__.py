"""OTAS (token adaptation): the measured profile, adaptive batching (Alg. 1), token allocation (Alg. 2-3), the
replica scheduler, baseline allocators and a simulation of one replica.

Builds on :mod:`placement.core` and :mod:`placement.sim`; imports no other system package.
"""

from placement.otas.adaptive_batching import (
    AdaptiveBatcher,
    AdaptiveBatchingParams,
    OtasBatch,
    OtasRequest,
    parse_batching_params,
)
from placement.otas.baselines import FixedGammaAllocator, ModelSwitchingAllocator
from placement.otas.profile import OtasProfile
from placement.otas.replica_scheduler import Dispatch, OtasScheduler, Outcome, UtilityLedger
from placement.otas.simulation import (
    OtasEngine,
    QueryType,
    SimulationResult,
    TraceQuery,
    bursty_rates,
    fluctuating_poisson_trace,
    fluctuating_rates,
    simulate,
)
from placement.otas.token_allocation import (
    AllocationPlan,
    ArrivalRateEstimator,
    BatchEstimate,
    BatchEstimator,
    OtasTokenAllocator,
    RateToGamma,
    TokenAllocationParams,
    TokenAllocator,
    allocate_by_load,
    allocate_dp,
    parse_allocation_params,
    profile_estimator,
)

__all__ = [
    "OtasProfile", "OtasRequest", "OtasBatch", "AdaptiveBatchingParams", "parse_batching_params", "AdaptiveBatcher",
    "BatchEstimate", "BatchEstimator", "profile_estimator", "AllocationPlan", "allocate_dp", "RateToGamma",
    "allocate_by_load", "TokenAllocationParams", "parse_allocation_params", "ArrivalRateEstimator", "TokenAllocator",
    "OtasTokenAllocator", "Outcome", "UtilityLedger", "Dispatch", "OtasScheduler", "FixedGammaAllocator",
    "ModelSwitchingAllocator", "QueryType", "TraceQuery", "fluctuating_poisson_trace", "fluctuating_rates",
    "bursty_rates", "SimulationResult", "simulate", "OtasEngine",
]
