"""The simulation contract: AlpaServe's, Arlo's, OTAS's and TCB's simulators are engines whose runs report the
same per-request outcomes, and those outcomes agree with each simulator's own figures."""

import math

import numpy as np
import pytest

from placement.alpaserve.simulator import AlpaServeEngine
from placement.arlo.paper_profiles import paper_runtime_profiles
from placement.arlo.simulation import ArloEngine
from placement.core.arrivals import PoissonProcess
from placement.core.placement_plan import GroupPlacement, Placement
from placement.core.profiles import ConfigProfile, ModelProfile, ParallelConfig, ProfileSet, StageProfile
from placement.core.workload import ModelTraffic, generate_workload
from placement.otas.adaptive_batching import AdaptiveBatchingParams
from placement.otas.baselines import FixedGammaAllocator
from placement.otas.profile import OtasProfile
from placement.otas.replica_scheduler import OtasScheduler
from placement.otas.simulation import OtasEngine, QueryType, fluctuating_poisson_trace
from placement.sim import LATE, REJECTED, SERVED, UNPLACED, UNSERVED, RequestOutcomes, SimulationEngine, SimulationRun
from placement.tcb.batch_scheduler import TextRequest, make_batch_scheduler
from placement.tcb.trace_replay import ReplayEngine


def alpaserve_engine() -> AlpaServeEngine:
    stage = StageProfile(latency_s={1: 0.05}, weight_bytes_per_device=1)
    profile = ModelProfile(name="a", configs=[ConfigProfile(config=ParallelConfig(), stages=[stage])])
    models = {"a": profile, "b": profile.model_copy(update={"name": "b"})}
    profiles = ProfileSet(source="synthetic", device="test", models=models)
    traffic = [ModelTraffic(PoissonProcess(30.0), 0.1), ModelTraffic(PoissonProcess(5.0), 0.1)]
    workload = generate_workload(["a", "b"], traffic, 20.0, seed=0)
    placement = Placement(groups=[GroupPlacement(num_devices=1, config=ParallelConfig(), models=["a"])])
    return AlpaServeEngine(placement, profiles, workload)


def arlo_engine() -> ArloEngine:
    rng = np.random.default_rng(0)
    arrivals = np.sort(rng.uniform(0.0, 30.0, 20000))
    lengths = rng.integers(8, 500, len(arrivals))
    return ArloEngine("arlo", paper_runtime_profiles("bert-base"), arrivals, lengths, num_devices=2,
                      options={"period_s": 10.0})


def otas_engine() -> OtasEngine:
    latency = {0: {1: 0.01, 8: 0.03}}
    profile = OtasProfile(source="synthetic test stand-in", device="none", gamma_list=[0], batch_sizes=[1, 8],
                          latency_s=latency, accuracy={"t": {0: 0.7}})
    trace = fluctuating_poisson_trace([100.0, 600.0, 300.0], [QueryType("t", 0.03, 1.0)], seed=1)
    return OtasEngine(trace, OtasScheduler(FixedGammaAllocator(profile, 0), AdaptiveBatchingParams(epsilon=8)), profile)


def tcb_engine() -> ReplayEngine:
    requests = [TextRequest(request_id=k, length_tokens=10 + (7 * k) % 60, arrival_s=0.0005 * k,
                            deadline_s=0.0005 * k + 0.02) for k in range(400)]
    return ReplayEngine(requests, make_batch_scheduler("fcfs", {"row_length_tokens": 100, "num_rows": 2}),
                        lambda decision: 0.004)


ENGINES = {"alpaserve": alpaserve_engine, "arlo": arlo_engine, "otas": otas_engine, "tcb": tcb_engine}


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_simulator_is_an_engine_reporting_request_outcomes(name):
    engine = ENGINES[name]()
    assert isinstance(engine, SimulationEngine)
    run = engine.run()
    assert isinstance(run, SimulationRun)
    outcomes = run.outcomes
    assert isinstance(outcomes, RequestOutcomes) and len(outcomes) > 100
    ran = np.isin(outcomes.status, [SERVED, LATE])
    assert np.all(np.isfinite(outcomes.finish_s[ran])) and np.all(np.isnan(outcomes.finish_s[~ran]))
    assert np.all(outcomes.finish_s[ran] >= outcomes.arrival_s[ran])
    met = outcomes.finish_s[ran] <= outcomes.deadline_s[ran]
    assert np.array_equal(met, outcomes.status[ran] == SERVED)
    assert 0.0 < outcomes.slo_attainment() < 1.0  # every case overloads its system a little


def test_outcomes_agree_with_each_simulators_own_figures():
    alpaserve = alpaserve_engine().run()
    assert alpaserve.outcomes.slo_attainment() == alpaserve.slo_attainment()
    assert alpaserve.outcomes.counts()["unplaced"] == int(np.sum(alpaserve.workload.model == 1)) > 0

    arlo = arlo_engine().run()
    assert arlo.outcomes.slo_attainment() == pytest.approx(arlo.slo_attainment)
    assert arlo.outcomes.latency_percentile_s(98) == pytest.approx(arlo.p98_s)

    otas = otas_engine().run()
    counts = otas.outcomes.counts()
    assert counts["served"] == otas.ledger.counts["correct"] + otas.ledger.counts["wrong"]
    assert counts["late"] == otas.ledger.counts["late"] and counts["rejected"] == otas.ledger.counts["evicted"] > 0
    assert otas.outcomes.total_utility() == pytest.approx(otas.ledger.utility)

    tcb = tcb_engine().run()
    counts = tcb.outcomes.counts()
    assert (counts["served"], counts["late"], counts["rejected"], counts["unserved"]) == (
        tcb.completed, tcb.late, tcb.dropped, tcb.unserved)
    assert tcb.outcomes.total_utility() == pytest.approx(tcb.utility)


def test_request_outcomes_check_their_lengths_and_summarise():
    with pytest.raises(ValueError, match="finish_s"):
        RequestOutcomes(np.zeros(2), np.ones(2), np.zeros(3), np.zeros(2, np.int8))
    outcomes = RequestOutcomes(np.zeros(5), np.ones(5), np.array([0.5, 2.0, np.nan, np.nan, np.nan]),
                               np.array([SERVED, LATE, REJECTED, UNPLACED, UNSERVED], np.int8))
    assert outcomes.counts() == {"served": 1, "late": 1, "rejected": 1, "unplaced": 1, "unserved": 1}
    assert outcomes.slo_attainment() == pytest.approx(0.2)
    assert list(outcomes.latency_s()) == [0.5, 2.0]
    assert math.isnan(outcomes.total_utility())
