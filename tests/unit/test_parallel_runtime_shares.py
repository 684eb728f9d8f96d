"""benchmarks/parallel_runtime.py's GPU shares: every stage actor alive at once holds its share on the GPUs."""

from __future__ import annotations

import pytest

from benchmarks.parallel_runtime import gpu_share_per_actor


@pytest.mark.parametrize("num_gpus, actors", [(1, 3), (1, 4), (2, 5), (8, 4)])
def test_the_actors_alive_at_once_fit_on_the_gpus(num_gpus, actors):
    share = gpu_share_per_actor(num_gpus, actors)
    assert 0 < share <= 1.0
    # Ray places a fractional share on one GPU: each GPU holds floor(1 / share) of them.
    assert num_gpus * int(1.0 / share + 1e-9) >= actors


def test_five_actors_on_two_gpus_take_a_third_each():
    assert gpu_share_per_actor(2, 5) == pytest.approx(1 / 3)


def test_a_share_sized_for_fewer_actors_would_not_fit_the_planned_vs_even_groups():
    # The 1- and 2-stage groups' share (3 actors) given to the planned and even 2-stage groups (4 actors).
    assert 4 * gpu_share_per_actor(1, 3) > 1
    assert gpu_share_per_actor(1, 4) == pytest.approx(0.25)


def test_no_gpus_no_share():
    assert gpu_share_per_actor(0, 4) == 0.0
