"""When a detected rate shift triggers a group decision (a plexserve addition, to react within one period).

The placement controller runs the two-window rate test (`placement.core.traffic_window.detect_rate_shifts`) at every
poll, within the cool-down after a decision too. The cool-down spaces the decisions; it must not blind the test. A
shift found within it is kept (`pending`) and triggers the decision as soon as the cool-down ends. Were the test
blind within the cool-down, a period decision taken just after a change would keep the placement on a window mostly
before it, by the end of the cool-down both of the test's windows would hold the new traffic, and the move would
wait for the next period.

A decision that falls due anyway (the period, a look after a kept shift decision) while a shift is found or pending
is taken as a shift decision: judged on the traffic since the shift, not on a window that straddles it.

Pausing or resuming the controller forgets the pending shifts (`forget`): a shift found before an operator froze the
placement is no reason for a decision when it resumes (e.g. after a static run and a warm-up, a shift found before
them must not trigger a decision the moment the controller resumes).

**The decision fits the traffic since the change**. With each shift found, the controller passes when
the rates changed (`change_s`: `placement.core.traffic_window.estimate_change_s`); the shift triggers no decision
before `min_fit_s` seconds of traffic since that change exist (unless a decision is due anyway), and the decision
and the looks after it fit the seconds since the change (`fit_window_s`). A fixed window (the test's later one)
would, for a decision shortly after the change, hold traffic from before it, keep the placement, and leave the move
to the next decision. The cool-down still applies to a change newer than the last decision: skipping it would decide
earlier on average, but later in some traces and miss the move in others.

Plain data, no clock of its own: the controller passes the times (`time.monotonic()` seconds, as to
`shift_looks.ShiftLooks`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ShiftTrigger:
    """The shifts found since the last group decision, and whether they trigger one now."""

    cooldown_s: float  # seconds after a decision before a shift may trigger another (`controller.cooldown_s`)
    last_decision_s: float  # when the last group decision was taken
    pending: list[dict[str, Any]] = field(default_factory=list)  # shifts found since then, not yet answered
    #: Seconds of traffic since the change before a shift triggers a decision (`controller.shift_min_fit_s`).
    min_fit_s: float = 0.0
    #: When the rates last changed, as estimated with the last shift found; None: unknown (kept after the decision
    #: that answers it: the looks after that decision fit the seconds since it too).
    change_s: float | None = None

    def __post_init__(self) -> None:
        if self.cooldown_s < 0:
            raise ValueError(f"cooldown_s={self.cooldown_s}: must be >= 0")
        if self.min_fit_s < 0:
            raise ValueError(f"min_fit_s={self.min_fit_s}: must be >= 0")

    def poll(self, shifts: list[dict[str, Any]], now_s: float, due: bool = False,
             change_s: float | None = None) -> list[dict[str, Any]]:
        """The shifts a group decision at `now_s` should answer: those the test found now (`shifts`, the rates having
        changed at `change_s` if known) or earlier within the cool-down, once the cool-down has ended and `min_fit_s`
        seconds have passed since the change, or at once when a decision is `due` anyway; empty: no shift decision
        now."""
        if shifts:
            self.pending, self.change_s = list(shifts), change_s
        if not self.pending:
            return []
        settled = self.change_s is None or now_s - self.change_s >= self.min_fit_s
        if due or (settled and now_s - self.last_decision_s >= self.cooldown_s):
            return self.pending
        return []

    def fit_window_s(self, now_s: float, longest_s: float) -> float:
        """Seconds of traffic a decision at `now_s` fits: those since the change, at least `min_fit_s` and at most
        `longest_s` (the decision's own window, all of it when no change is known)."""
        if self.change_s is None:
            return longest_s
        return min(max(now_s - self.change_s, self.min_fit_s), longest_s)

    def forget(self) -> None:
        """The controller was paused or resumed: the shifts found before (and their change) trigger nothing."""
        self.pending = []
        self.change_s = None

    def decided(self, now_s: float) -> None:
        """A group decision (of any trigger) was taken at `now_s`: it answers the pending shifts and starts the
        cool-down."""
        self.last_decision_s = now_s
        self.pending = []
