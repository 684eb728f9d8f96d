"""When a detected rate shift triggers a group decision (a plexserve addition, to react within one period).

The placement controller runs the two-window rate test (`placement.core.traffic_window.detect_rate_shifts`) at every
poll, within the cool-down after a decision too. The cool-down spaces the decisions; it must not blind the test. A
shift found within it is kept (`pending`) and triggers the decision as soon as the cool-down ends. Until 2026-11-25
the test did not run within the cool-down: a period decision taken just after a change kept on a window mostly
before it, by the end of the cool-down both of the test's windows held the new traffic, and the move waited for the
next period (seed 1 of the fidelity runs at 06:33 and 08:39 on 2026-11-25: reaction 15.3 and 15.2 s; the latter's
second half scored 0.046 below keeping the first placement).

A decision that falls due anyway (the period, a look after a kept shift decision) while a shift is found or pending
is taken as a shift decision: judged on the traffic since the shift, not on a window that straddles it.

Pausing or resuming the controller forgets the pending shifts (`forget`): a shift found before an operator froze the
placement is no reason for a decision when it resumes (in a fidelity run of 2026-11-25 12:03 the controller resumed
after a static run and a warm-up with a shift decision at 0.1 s on a shift found before them).

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

    def __post_init__(self) -> None:
        if self.cooldown_s < 0:
            raise ValueError(f"cooldown_s={self.cooldown_s}: must be >= 0")

    def poll(self, shifts: list[dict[str, Any]], now_s: float, due: bool = False) -> list[dict[str, Any]]:
        """The shifts a group decision at `now_s` should answer: those the test found now (`shifts`) or earlier
        within the cool-down, once the cool-down has ended, or at once when a decision is `due` anyway; empty: no
        shift decision now."""
        if shifts:
            self.pending = list(shifts)
        if self.pending and (due or now_s - self.last_decision_s >= self.cooldown_s):
            return self.pending
        return []

    def forget(self) -> None:
        """The controller was paused or resumed: the shifts found before trigger nothing."""
        self.pending = []

    def decided(self, now_s: float) -> None:
        """A group decision (of any trigger) was taken at `now_s`: it answers the pending shifts and starts the
        cool-down."""
        self.last_decision_s = now_s
        self.pending = []
