"""The one batch-latency table every profile kind stores: shared validation, and each kind's rule past the
largest measured batch size."""

import pytest
from pydantic import ValidationError

from placement.arlo.runtimes import RuntimeProfile
from placement.core.latency_table import table_latency_s
from placement.core.profiles import StageProfile
from placement.otas.profile import OtasProfile

TABLE = {1: 1.0, 4: 2.5, 8: 4.0}


def test_lookup_inside_the_table_is_measured_or_linear():
    assert table_latency_s(TABLE, 4) == 2.5
    assert table_latency_s(TABLE, 2) == pytest.approx(1.5)  # a third of the way from 1 to 4
    assert table_latency_s(TABLE, 6) == pytest.approx(3.25)
    assert table_latency_s(TABLE, 0.5) == 1.0  # below the smallest size: its latency


@pytest.mark.parametrize("beyond, expected", [("last_slope", 5.5), ("per_sample", 6.0), ("flat", 4.0)])
def test_past_the_largest_size_each_rule(beyond, expected):
    assert table_latency_s(TABLE, 12, beyond=beyond) == pytest.approx(expected)


def test_a_single_size_scales_per_sample_even_with_last_slope():
    assert table_latency_s({2: 1.0}, 6, beyond="last_slope") == pytest.approx(3.0)


def test_monotone_never_lets_a_bigger_batch_be_faster():
    noisy = {1: 1.0, 2: 3.0, 4: 2.0}
    assert table_latency_s(noisy, 4) == 2.0
    assert table_latency_s(noisy, 4, monotone=True) == 3.0
    assert table_latency_s(noisy, 3, monotone=True) == 3.0


def test_every_profile_kind_reads_through_the_table_with_its_rule():
    stage = StageProfile(latency_s=TABLE, weight_bytes_per_device=0)
    runtime = RuntimeProfile(max_length_tokens=64, batch_latency_s=TABLE, max_batch_size=8, slo_s=1.0)
    otas = OtasProfile(source="t", device="cpu", gamma_list=[0], batch_sizes=[1, 4, 8], latency_s={0: TABLE},
                       accuracy={"task": {0: 0.9}})
    assert stage.latency(12) == pytest.approx(5.5)
    assert runtime.batch_latency(12) == pytest.approx(4.0)
    assert otas.batch_latency_s(0, 12) == pytest.approx(6.0)


@pytest.mark.parametrize("table", [{}, {0: 1.0}, {2: 0.0}, {2: -1.0}])
def test_every_profile_kind_refuses_a_bad_table_naming_its_field(table):
    with pytest.raises(ValidationError, match="latency_s"):
        StageProfile(latency_s=table, weight_bytes_per_device=0)
    with pytest.raises(ValidationError, match="batch_latency_s"):
        RuntimeProfile(max_length_tokens=64, batch_latency_s=table, max_batch_size=1, slo_s=1.0)
    with pytest.raises(ValidationError, match="latency_s"):
        OtasProfile(source="t", device="cpu", gamma_list=[0], batch_sizes=[1], latency_s={0: table},
                    accuracy={"task": {0: 0.9}})
