"""TCB (ConcatBatching): which waiting text requests run in the next packed batch (FCFS, SJF, EDF, DAS and Slotted
DAS, §5) and a replay of a trace through such a scheduler on a simulated clock.

Builds on :mod:`placement.sim`; imports no other system package.
"""

from placement.tcb.batch_scheduler import (
    BatchDecision,
    BatchingParams,
    BatchScheduler,
    DasRows,
    DasScheduler,
    EdfScheduler,
    FcfsScheduler,
    OrderedFirstFitScheduler,
    SjfScheduler,
    SlottedDasScheduler,
    TextRequest,
    das_rows,
    make_batch_scheduler,
    parse_batching_params,
)
from placement.tcb.trace_replay import ReplayEngine, ReplayResult, replay

__all__ = [
    "TextRequest", "BatchDecision", "BatchingParams", "BatchScheduler", "OrderedFirstFitScheduler", "FcfsScheduler",
    "SjfScheduler", "EdfScheduler", "DasRows", "das_rows", "DasScheduler", "SlottedDasScheduler",
    "parse_batching_params", "make_batch_scheduler", "ReplayResult", "replay", "ReplayEngine",
]
