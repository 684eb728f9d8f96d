"""Ingress-side dispatch over group slots: routes per slot, SLO admission, and stale estimates re-probed."""

import pytest

from placement.alpaserve.dispatch import make_dispatch
from rayserve_apps.ingress.group_dispatch import (
    MIN_LATENCY_SAMPLES,
    PROBE_AFTER_S,
    PROVEN_DEPTH_WINDOW_S,
    GroupDispatcher,
)


def test_requests_go_only_to_slots_that_route_the_model():
    dispatcher = GroupDispatcher([["a"], [], ["a", "b"]], make_dispatch("shortest_queue"))
    assert dispatcher.hosts("a") == [0, 2] and dispatcher.hosts("b") == [2]
    dispatcher.started(0)
    assert dispatcher.choose("a", now_s=0.0, deadline_s=10.0) == 2  # the shorter queue
    dispatcher.set_routes([["a"], ["b"], []])
    assert dispatcher.hosts("b") == [1] and dispatcher.choose("b", 0.0, 10.0) == 1


def test_a_slow_estimate_refuses_until_it_is_stale_then_one_probe_goes_through():
    dispatcher = GroupDispatcher([["a"]], make_dispatch("shortest_queue"))
    for _ in range(MIN_LATENCY_SAMPLES):
        dispatcher.finished(0, "a", latency_s=5.0, ahead=dispatcher.started(0))  # a slow spell: 5 s per request
    measured = dispatcher.groups[0].measured_at_s["a"]
    assert dispatcher.choose("a", now_s=measured + 0.1, deadline_s=measured + 1.1) is None  # SLO 1 s: refused
    later = measured + PROBE_AFTER_S + 0.1
    assert dispatcher.choose("a", now_s=later, deadline_s=later + 1.0) == 0  # idle and stale: probe
    dispatcher.started(0)
    assert dispatcher.choose("a", now_s=later, deadline_s=later + 1.0) is None  # busy again: the estimate holds


def test_routes_of_another_length_are_refused():
    dispatcher = GroupDispatcher([["a"], ["b"]], make_dispatch("shortest_queue"))
    with pytest.raises(ValueError, match="runs 2"):
        dispatcher.set_routes([["a"]])


def test_one_stall_does_not_inflate_the_estimate():
    dispatcher = GroupDispatcher([["a"]], make_dispatch("shortest_queue"))
    for latency in (0.01, 0.01, 30.0, 0.01, 0.01):  # one request stuck behind a replica being replaced
        dispatcher.finished(0, "a", latency, ahead=dispatcher.started(0))
    assert dispatcher.groups[0].service_s["a"] == 0.01
    now = dispatcher.groups[0].measured_at_s["a"]
    assert dispatcher.choose("a", now_s=now, deadline_s=now + 1.0) == 0


def test_a_cold_first_answer_alone_refuses_nothing():
    dispatcher = GroupDispatcher([["a"]], make_dispatch("shortest_queue"))
    dispatcher.finished(0, "a", latency_s=5.0, ahead=dispatcher.started(0))  # the first answer: warm-up included
    now = dispatcher.groups[0].measured_at_s["a"]
    for _ in range(8):
        dispatcher.started(0)  # a burst in flight behind it
    assert dispatcher.choose("a", now_s=now, deadline_s=now + 1.0) == 0
    for _ in range(MIN_LATENCY_SAMPLES - 1):
        dispatcher.finished(0, "a", latency_s=0.5, ahead=0)
    assert dispatcher.choose("a", now_s=now, deadline_s=now + 1.0) is None  # measured now: 6 ahead x 0.5 s > 1 s


def test_a_depth_that_met_its_deadlines_is_admitted_although_the_estimate_says_late():
    """Load rises: the estimate (measured at smaller batches) says 17 queued requests miss 1 s, but answers sent at
    depth 20 came back in time a moment ago; past that depth, or once that evidence is older than the window, the
    estimate decides again."""
    dispatcher = GroupDispatcher([["a"]], make_dispatch("shortest_queue"))
    for _ in range(MIN_LATENCY_SAMPLES):
        dispatcher.finished(0, "a", latency_s=0.1, ahead=dispatcher.started(0))  # 0.1 s per request alone
    for _ in range(16):
        dispatcher.started(0)
    now = dispatcher.groups[0].measured_at_s["a"]
    assert dispatcher.choose("a", now_s=now, deadline_s=now + 1.0) is None  # 17 x 0.1 s > 1 s
    dispatcher.finished(0, "a", latency_s=None, ahead=19, met=True)  # sent at depth 20, answered in time
    proven_at = dispatcher.groups[0].proven["a"][0][0]
    assert dispatcher.choose("a", now_s=proven_at, deadline_s=proven_at + 1.0) == 0
    for _ in range(5):
        dispatcher.started(0)  # 20 in flight: the next one would be the 21st
    assert dispatcher.choose("a", now_s=proven_at, deadline_s=proven_at + 1.0) is None
    for _ in range(5):
        dispatcher.finished(0, "a", latency_s=None)
    later = proven_at + PROVEN_DEPTH_WINDOW_S + 0.1
    assert dispatcher.choose("a", now_s=later, deadline_s=later + 1.0) is None  # the evidence expired
