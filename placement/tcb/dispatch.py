"""When a text batch forms, and which arrivals are refused at once: pure policy shared by the engine and simulators.

`batch_ready_at_s`: TCB §5.2 forms a batch at the start of each time slot; plexserve's engine forms one when the
rows are full or the oldest text has waited the batch wait, and (`dispatch_when_idle`) at once when no batch of the
model runs: waiting only helps while the device is busy, and a text that finds it idle gains nothing by waiting.

`admits`: a call whose texts cannot finish by their deadline behind the tokens queued ahead of it is refused on
arrival (AlpaServe §6.5's rule, applied at admission rather than at batch time): past saturation the queue then holds
only work that can still meet its SLO, so the answers within SLO stay at the peak's level instead of every answer
arriving late.
"""

from __future__ import annotations

import math
from typing import Callable

#: batch_seconds(tokens) -> predicted seconds of one batch of that many tokens.
BatchSeconds = Callable[[int], float]


def batch_ready_at_s(now_s: float, oldest_arrival_s: float, queued_tokens: int, capacity_tokens: int,
                     batch_wait_s: float, batches_running: int, dispatch_when_idle: bool) -> float:
    """When the next batch should form: `now_s` when the rows are full or (dispatch_when_idle) nothing runs,
    else the oldest text's arrival plus the batch wait."""
    if queued_tokens >= capacity_tokens or (dispatch_when_idle and batches_running == 0):
        return now_s
    return oldest_arrival_s + batch_wait_s


def predicted_finish_s(now_s: float, tokens_ahead: int, tokens: int, capacity_tokens: int,
                       batch_seconds: BatchSeconds) -> float:
    """Finish of a call of `tokens` queued behind `tokens_ahead`, run in full batches of `capacity_tokens` then
    one for the rest, the first starting at `now_s` (the caller passes when the batch running now ends)."""
    if capacity_tokens < 1:
        raise ValueError(f"capacity_tokens must be >= 1, got {capacity_tokens}")
    total = tokens_ahead + tokens
    full = math.floor(total / capacity_tokens)
    rest = total - full * capacity_tokens
    return now_s + full * batch_seconds(capacity_tokens) + (batch_seconds(rest) if rest else 0.0)


def admits(now_s: float, deadline_s: float, tokens_ahead: int, tokens: int, capacity_tokens: int,
           batch_seconds: BatchSeconds) -> bool:
    """Whether a call can still finish by `deadline_s` behind the queued tokens."""
    return predicted_finish_s(now_s, tokens_ahead, tokens, capacity_tokens, batch_seconds) <= deadline_s
