"""How long an engine's text batch takes, fitted on the batches it ran: seconds = fixed + per token x tokens.

The text former cuts each batch to what finishes by its deadlines (`placement.tcb.deadline_fit`); this is its
prediction. A batch's seconds run from its start to its answers (for a device group: through every stage, waits for
a busy stage included). The fit is Theil-Sen (the median of the pairwise slopes, the intercept the median
residual): one stalled batch (a neighbour loading a model, a rebuild) must not move it. Batches older than
`MAX_AGE_S` are forgotten: an estimate from a slow spell that predicts every request late would otherwise cut every
batch, so no batch would run to correct it and the model would starve; with no
recent batches there is no estimate and the scheduler's batch runs uncut.
"""

from __future__ import annotations

from collections import deque

import numpy as np

#: Recent batches the fit uses: enough for a stable median, few enough to follow a slowdown within seconds.
WINDOW_BATCHES = 24
#: Batches measured before the fit predicts anything (until then no batch is cut to its deadlines).
MIN_BATCHES = 4
#: Seconds after which a batch no longer counts (its model's batches stopped: the estimate may be what stopped them).
MAX_AGE_S = 5.0
#: Two batches whose token counts differ by less than this share of the larger give no slope.
MIN_TOKEN_SPREAD = 0.1


class BatchCostEstimate:
    """Predicted seconds of a batch of so many tokens, from the latest `WINDOW_BATCHES` batches of the last
    `MAX_AGE_S` seconds."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int, float]] = deque(maxlen=WINDOW_BATCHES)  # (ended at, tokens, seconds)
        self.fixed_s = 0.0
        self.per_token_s = 0.0

    def ready(self, now_s: float) -> bool:
        """Whether enough recent batches back a prediction at `now_s` (older ones are forgotten first)."""
        aged = False
        while self._samples and self._samples[0][0] < now_s - MAX_AGE_S:
            self._samples.popleft()
            aged = True
        if aged and len(self._samples) >= MIN_BATCHES:
            self._fit()
        return len(self._samples) >= MIN_BATCHES

    def add(self, tokens: int, seconds: float, ended_s: float) -> None:
        """One batch of `tokens` tokens that took `seconds` and ended at `ended_s` (the engine's clock)."""
        if tokens < 1 or not seconds > 0:
            return
        self._samples.append((ended_s, tokens, seconds))
        if len(self._samples) >= MIN_BATCHES:
            self._fit()

    def _fit(self) -> None:
        tokens = np.array([t for _, t, _ in self._samples], dtype=float)
        seconds = np.array([s for _, _, s in self._samples])
        i, j = np.triu_indices(len(tokens), k=1)
        apart = np.abs(tokens[i] - tokens[j]) >= MIN_TOKEN_SPREAD * np.maximum(tokens[i], tokens[j])
        slopes = (seconds[j] - seconds[i])[apart] / (tokens[j] - tokens[i])[apart]
        slope = float(np.median(slopes)) if slopes.size else 0.0
        if slope <= 0.0:  # batches of one size (or noise): all of a batch's time scales with its tokens
            self.fixed_s, self.per_token_s = 0.0, float(np.median(seconds / tokens))
            return
        self.per_token_s = slope
        self.fixed_s = max(0.0, float(np.median(seconds - slope * tokens)))

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens
