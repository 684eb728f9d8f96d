"""Batch latency tables: batch size -> seconds one batch takes, the one form every profile kind stores.

AlpaServe's stage profiles (`placement.core.profiles.StageProfile`, §4.1), Arlo's runtime profiles
(`placement.arlo.runtimes.RuntimeProfile`, §3.3) and OTAS's per-gamma profile (`placement.otas.profile`, §III-A)
each measure a few batch sizes. `LatencyTable` is their field type (one validation: at least one size, sizes
>= 1, latencies > 0; JSON unchanged, a plain object of size -> seconds) and `table_latency_s` their lookup: the
measured value at a measured size, the smallest size's below it, linear interpolation between sizes, and past
the largest size the profile's own rule (`Beyond`).
"""

from __future__ import annotations

import bisect
from itertools import accumulate
from typing import Annotated, Literal, Mapping

from pydantic import AfterValidator

#: Past the largest measured size: continue the last segment's slope (a single size scales per sample), scale
#: per sample (latency x size / largest size), or stay at the largest size's latency.
Beyond = Literal["last_slope", "per_sample", "flat"]


def check_latency_table(table: dict[int, float]) -> dict[int, float]:
    """ValueError unless the table has a size, every size is >= 1 and every latency > 0."""
    if not table:
        raise ValueError("needs at least one batch size")
    for batch, seconds in table.items():
        if batch < 1 or not seconds > 0:
            raise ValueError(f"[{batch}]={seconds}: batch sizes >= 1 and latencies > 0")
    return table


#: Batch size -> seconds of one batch, validated by `check_latency_table`.
LatencyTable = Annotated[dict[int, float], AfterValidator(check_latency_table)]


def table_latency_s(table: Mapping[int, float], batch_size: float, beyond: Beyond = "last_slope",
                    monotone: bool = False) -> float:
    """Latency of one batch of `batch_size` from a latency table (see the module docstring). With `monotone`, a
    size's latency is the largest measured at or below it (measurement noise never makes a bigger batch faster)."""
    sizes = sorted(table)
    values = [table[size] for size in sizes]
    if monotone:
        values = list(accumulate(values, max))
    if batch_size <= sizes[0]:
        return values[0]
    last = sizes[-1]
    if batch_size >= last:
        if batch_size == last or beyond == "flat":
            return values[-1]
        if beyond == "per_sample" or len(sizes) == 1:
            return values[-1] * batch_size / last
        slope = (values[-1] - values[-2]) / (last - sizes[-2])
        return values[-1] + slope * (batch_size - last)
    high = bisect.bisect_left(sizes, batch_size)
    if sizes[high] == batch_size:
        return values[high]
    low = high - 1
    frac = (batch_size - sizes[low]) / (sizes[high] - sizes[low])
    return values[low] + frac * (values[high] - values[low])
