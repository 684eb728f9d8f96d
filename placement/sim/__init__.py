"""The simulation contract every simulator in placement/ implements: an engine (`SimulationEngine.run()`) and one
per-request result type (`RequestOutcomes`, reached through each run's `outcomes`). Imports nothing else of
placement/."""

from placement.sim.engine import SimulationEngine, SimulationRun
from placement.sim.outcomes import (
    LATE,
    REJECTED,
    SERVED,
    STATUS_NAMES,
    UNPLACED,
    UNSERVED,
    RequestOutcomes,
)

__all__ = [
    "SimulationEngine", "SimulationRun", "RequestOutcomes",
    "SERVED", "LATE", "REJECTED", "UNPLACED", "UNSERVED", "STATUS_NAMES",
]
