"""Waiting for a state in tests: poll a predicate until it holds, fail with what was last seen.

A fixed sleep either waits longer than needed or, on a busy machine, not long enough; `wait_until` returns as soon as
the state is reached and fails with a message and the last value when it is not reached in time. Sleeps that pace
what a test sends (a load's rate, traffic flowing while something happens) are not waits for a state and stay sleeps.

Import it as `from waiting import wait_until` (`tests/conftest.py` puts `tests/` on `sys.path`, so this works from
test files in `tests/` and in its subfolders).
"""

from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")

#: Seconds between two polls unless the caller says otherwise.
DEFAULT_INTERVAL_S = 0.5
#: Characters of the last value shown in the failure message.
MAX_SHOWN_CHARS = 2000


def wait_until(predicate: Callable[[], T], timeout_s: float, interval_s: float = DEFAULT_INTERVAL_S,
               message: str | Callable[[], str] = "condition not reached",
               ignore: tuple[type[BaseException], ...] = ()) -> T:
    """Call `predicate` every `interval_s` seconds until it returns a truthy value, and return that value.

    `ignore`: exception types that count as "not yet" (e.g. a replica that is still starting); the last one is
    reported if time runs out. `message` may be a callable, called only on failure (to show what the predicate saw
    besides its return value). Raises `AssertionError` naming `message`, the seconds waited and the last value (or
    exception) once `timeout_s` has passed; the predicate is always called at least once, and once more at the
    deadline."""
    if timeout_s < 0:
        raise ValueError(f"timeout_s={timeout_s}: must be >= 0")
    if interval_s <= 0:
        raise ValueError(f"interval_s={interval_s}: must be > 0")
    started = time.monotonic()
    deadline = started + timeout_s
    last: Any = None
    while True:
        try:
            last = predicate()
        except ignore as error:
            last = error
        else:
            if last:
                return last
        now = time.monotonic()
        if now >= deadline:
            shown = repr(last)
            if len(shown) > MAX_SHOWN_CHARS:
                shown = shown[:MAX_SHOWN_CHARS] + "..."
            said = message() if callable(message) else message
            raise AssertionError(f"{said} (after {now - started:.1f} s of {timeout_s:g} s; last: {shown})")
        time.sleep(min(interval_s, deadline - now))
