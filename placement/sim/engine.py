"""The simulation contract: an engine runs requests on a simulated clock and returns a run with outcomes.

Every simulator in placement/ is an engine: `placement.alpaserve.simulator.AlpaServeEngine` (AlpaServe §5: a
placement serving a workload), `placement.arlo.simulation.ArloEngine` (Arlo §5.2: one polymorphing request
stream), `placement.otas.simulation.OtasEngine` (OTAS §V: one replica on a trace) and
`placement.tcb.trace_replay.ReplayEngine` (TCB §5.1: a batch scheduler on a trace). An engine is built with its
inputs and `run()` returns the system's own result, which also offers the shared per-request `outcomes`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from placement.sim.outcomes import RequestOutcomes


@runtime_checkable
class SimulationRun(Protocol):
    """A simulator's result: its own figures, plus the per-request outcomes every simulator reports."""

    @property
    def outcomes(self) -> RequestOutcomes: ...


@runtime_checkable
class SimulationEngine(Protocol):
    """A simulator with its inputs bound: `run()` simulates them once, deterministically."""

    def run(self) -> SimulationRun: ...
