"""SLO attainment as plexserve reports it: requests answered within the *model's* SLO over *all* requests of a
recent window, refused ones included (shed with 503: overloaded, no group can finish in time, not hosted, evicted,
or failed), so the figure falls when traffic is being shed instead of reading about 1.0. A client's own `slo_ms`
only sets its request's deadline; it never changes what counts as met. Requests refused for bad input are the
client's error and not counted.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

#: Seconds of requests the attainment gauge covers.
ATTAINMENT_WINDOW_S = 60.0


class SloAttainment:
    """Per model, met / all requests recorded in the last `window_s` seconds."""

    def __init__(self, window_s: float = ATTAINMENT_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.clock = clock
        self._records: dict[str, deque[tuple[float, bool]]] = {}
        self._met: dict[str, int] = {}

    def record(self, model: str, met: bool) -> float:
        """Count one request of `model` (met its SLO or not) and return the model's attainment now."""
        records = self._records.setdefault(model, deque())
        records.append((self.clock(), met))
        self._met[model] = self._met.get(model, 0) + int(met)
        return self.value(model) or 0.0

    def value(self, model: str) -> float | None:
        """met / all over the window, or None when the window holds no request of `model`."""
        records = self._records.get(model)
        if not records:
            return None
        horizon = self.clock() - self.window_s
        while records and records[0][0] < horizon:
            _, met = records.popleft()
            self._met[model] -= int(met)
        return self._met[model] / len(records) if records else None
