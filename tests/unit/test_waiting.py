"""The tests' wait-until helper: returns as soon as the state holds, fails with the message and the last value."""

from __future__ import annotations

import itertools

import pytest
from waiting import wait_until


def test_returns_the_first_truthy_value():
    counter = itertools.count()
    assert wait_until(lambda: next(counter) >= 3 and "reached", 10, interval_s=0.001) == "reached"
    assert next(counter) == 4  # polled until it held, not beyond


def test_fails_with_the_message_and_the_last_value():
    with pytest.raises(AssertionError, match=r"replicas not up \(after .* of 0.05 s; last: \[\]\)"):
        wait_until(lambda: [], 0.05, interval_s=0.01, message="replicas not up")


def test_shows_the_last_falsy_value_and_a_message_built_on_failure():
    seen = {"running": 0}

    def two_running() -> int:
        seen["running"] = 1
        return 0

    with pytest.raises(AssertionError, match=r"1 of 2 running \(after .*; last: 0\)"):
        wait_until(two_running, 0.02, interval_s=0.005, message=lambda: f"{seen['running']} of 2 running")


def test_ignored_exceptions_mean_not_yet_and_the_last_is_reported():
    attempts = iter(range(1000))

    def starting() -> str:
        if next(attempts) < 2:
            raise ConnectionError("replica starting")
        return "up"

    assert wait_until(starting, 10, interval_s=0.001, ignore=(ConnectionError,)) == "up"
    with pytest.raises(AssertionError, match="ConnectionError"):
        wait_until(lambda: (_ for _ in ()).throw(ConnectionError("down")), 0.02, interval_s=0.005,
                   ignore=(ConnectionError,))
    with pytest.raises(KeyError):  # not ignored: raised at once
        wait_until(lambda: {}["missing"], 10, interval_s=0.001, ignore=(ConnectionError,))


def test_polls_at_least_once_and_rejects_bad_intervals():
    assert wait_until(lambda: 1, 0) == 1
    with pytest.raises(ValueError, match="interval_s"):
        wait_until(lambda: 1, 1, interval_s=0)
    with pytest.raises(ValueError, match="timeout_s"):
        wait_until(lambda: 1, -1)
