"""How long an engine's text batch takes, fitted on the batches it ran: seconds = fixed + per token x tokens.

The text former cuts each batch to what finishes by its deadlines (`placement.tcb.deadline_fit`); this is its
prediction. A batch's seconds run from its start to its answers (for a device group: through every stage, waits for
a busy stage included). The fit is Theil-Sen (the median of the pairwise slopes, the intercept the median
residual): one stalled batch (a neighbour loading a model, a rebuild) must not move it.
"""

from __future__ import annotations

from collections import deque

import numpy as np

#: Recent batches the fit uses: enough for a stable median, few enough to follow a slowdown within seconds.
WINDOW_BATCHES = 24
#: Batches measured before the fit predicts anything (until then no batch is cut to its deadlines).
MIN_BATCHES = 4
#: Two batches whose token counts differ by less than this share of the larger give no slope.
MIN_TOKEN_SPREAD = 0.1


class BatchCostEstimate:
    """Predicted seconds of a batch of so many tokens, from the latest `WINDOW_BATCHES` batches."""

    def __init__(self) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=WINDOW_BATCHES)
        self.fixed_s = 0.0
        self.per_token_s = 0.0

    @property
    def ready(self) -> bool:
        return len(self._samples) >= MIN_BATCHES

    def add(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or not seconds > 0:
            return
        self._samples.append((tokens, seconds))
        if self.ready:
            self._fit()

    def _fit(self) -> None:
        tokens = np.array([t for t, _ in self._samples], dtype=float)
        seconds = np.array([s for _, s in self._samples])
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
