"""The looks the placement controller takes after a rate-shift decision that keeps (a plexserve addition).

A decision triggered by a detected rate shift judges the candidates on the few seconds since the shift; right after
a real shift those seconds may not yet show a move worth `min_gain`, or only a small one that the longer fit does
not confirm (`replanning.py`, "A burst is not a shift"). Such a decision gets up to `looks` further decisions, one
shift window apart, each on the last two shift windows (`ReplanDecision.recheck_window_s`), instead of waiting for
the next period. A shift test that fires a little before the change leaves the first look's window half before it;
the second look's window is then all after it. Any other group decision (a period one, `replan_now`) or a move ends
the looks.

Plain data, no clock of its own: the controller passes the times (`time.monotonic()` seconds).
"""

from __future__ import annotations

from dataclasses import dataclass

from placement.alpaserve.replanning import ReplanDecision


@dataclass
class ShiftLooks:
    """When the next look after a kept shift decision is due, on how many seconds, and how many are left."""

    looks: int  # decisions after a kept shift decision (the spec's `controller.shift_looks`)
    due_s: float | None = None  # when the next look is due; None: none pending
    window_s: float | None = None  # seconds of traffic the next look fits
    left: int = 0  # looks left after the pending one

    def __post_init__(self) -> None:
        if self.looks < 0:
            raise ValueError(f"looks={self.looks}: must be >= 0")

    def after_shift(self, decision: ReplanDecision, shift_window_s: float, now_s: float) -> None:
        """A shift decision was taken at `now_s` on the last `shift_window_s`: a kept one opens the looks."""
        self.left = self.looks
        self._next(decision, shift_window_s, now_s)

    def after_look(self, decision: ReplanDecision, shift_window_s: float, now_s: float) -> None:
        """A look was taken at `now_s`: if it kept, the next one is due a shift window later while any is left."""
        self._next(decision, shift_window_s, now_s)

    def cancel(self) -> None:
        """Any other decision answers the pending looks."""
        self.due_s, self.window_s, self.left = None, None, 0

    def take_due(self, now_s: float) -> float | None:
        """The window of the look due at `now_s` (and it is taken: a failed look is not retried); None: none due."""
        if self.due_s is None or now_s < self.due_s:
            return None
        window_s = self.window_s
        self.due_s, self.window_s = None, None
        return window_s

    def _next(self, decision: ReplanDecision, shift_window_s: float, now_s: float) -> None:
        window_s = decision.recheck_window_s(shift_window_s) if self.left > 0 else None
        if window_s is None:
            self.cancel()
            return
        self.left -= 1
        self.due_s, self.window_s = now_s + shift_window_s, window_s
