"""Azure Functions trace replay: parsing both published formats (tiny files written here), fitting Gamma
processes per window, scaling and resampling (AlpaServe §6.2)."""

import numpy as np
import pytest

from placement.core.arrivals import GammaProcess
from placement.core.traces import (
    fit_gamma_windows,
    function_to_model,
    load_maf2019,
    load_maf2021,
    load_trace,
    trace_workload,
)


def write_maf2019(path, counts):
    minutes = counts.shape[1]
    lines = ["HashOwner,HashApp,HashFunction,Trigger," + ",".join(str(i) for i in range(1, minutes + 1))]
    for f, row in enumerate(counts):
        lines.append(f"o{f},a{f},f{f},http," + ",".join(str(int(c)) for c in row))
    path.write_text("\n".join(lines) + "\n")


def write_maf2021(path, per_function_arrivals, duration_s=0.05):
    lines = ["app,func,end_timestamp,duration"]
    for f, arrivals in enumerate(per_function_arrivals):
        for t in arrivals:
            lines.append(f"app{f},func{f},{t + duration_s:.6f},{duration_s}")
    path.write_text("\n".join(lines) + "\n")


def test_maf2019_parse_and_fit(tmp_path):
    rng = np.random.default_rng(0)
    counts = np.stack([rng.poisson(120, 10), rng.poisson(30, 10), np.r_[np.zeros(5), np.full(5, 60)]])
    path = tmp_path / "invocations_per_function_md.anon.d01.csv"
    write_maf2019(path, counts)
    trace = load_maf2019(path)
    assert trace.format == "maf2019" and len(trace.functions) == 3 and trace.duration_s == 600
    assert np.array_equal(trace.counts_per_minute, counts)
    fitted = fit_gamma_windows(trace, ["m0", "m1"], window_s=300)
    # Round robin: functions 0 and 2 -> m0, function 1 -> m1.
    assert list(function_to_model(3, 2)) == [0, 1, 0]
    expected_m0 = (counts[0, :5].sum() + counts[2, :5].sum()) / 300
    assert fitted.rates.shape == (2, 2)
    assert fitted.rates[0, 0] == pytest.approx(expected_m0)
    assert fitted.rates[1, 1] == pytest.approx(counts[1, 5:].sum() / 300)
    assert np.all(fitted.cvs > 0)
    with pytest.raises(ValueError, match="whole minutes"):
        fit_gamma_windows(trace, ["m0"], window_s=90)


def test_maf2021_parse_fit_scale_resample(tmp_path):
    rng = np.random.default_rng(1)
    bursty = GammaProcess(5.0, 3.0).generate(0, 2000, rng)
    steady = GammaProcess(2.0, 0.5).generate(0, 2000, rng)
    path = tmp_path / "AzureFunctionsInvocationTraceForTwoWeeksJan2021.txt"
    write_maf2021(path, [bursty, steady])
    trace = load_trace(path, "maf2021")
    assert trace.format == "maf2021" and len(trace.functions) == 2
    np.testing.assert_allclose(trace.timestamps_s[0], bursty, atol=1e-5)  # arrival = end - duration
    fitted = fit_gamma_windows(trace, ["bursty", "steady"], window_s=1000)
    assert fitted.rates[0].mean() == pytest.approx(5.0, rel=0.15)
    assert fitted.rates[1].mean() == pytest.approx(2.0, rel=0.1)
    assert fitted.cvs[0].mean() == pytest.approx(3.0, rel=0.25)
    assert fitted.cvs[1].mean() == pytest.approx(0.5, rel=0.2)
    workload = trace_workload(trace, ["bursty", "steady"], [1.0, 2.0], window_s=1000, rate_scale=2.0, cv_scale=1.0,
                              seed=3)
    rates = workload.rates()
    assert rates[0] == pytest.approx(10.0, rel=0.2) and rates[1] == pytest.approx(4.0, rel=0.15)
    assert np.all(workload.slo_s[workload.model == 1] == 2.0)
    again = trace_workload(trace, ["bursty", "steady"], [1.0, 2.0], window_s=1000, rate_scale=2.0, seed=3)
    assert np.array_equal(workload.arrival_s, again.arrival_s)
    calmer = trace_workload(trace, ["bursty", "steady"], [1.0, 2.0], window_s=1000, cv_scale=0.25, seed=3)
    gaps = np.diff(calmer.arrival_s[calmer.model == 0])
    assert gaps.std() / gaps.mean() < 1.5


def test_bad_trace_files_are_named(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(ValueError, match="MAF 2019"):
        load_maf2019(bad)
    with pytest.raises(ValueError, match="MAF 2021"):
        load_maf2021(bad)
    short = tmp_path / "short.txt"
    short.write_text("app,func,end_timestamp,duration\nx,y,notanumber,1\n")
    with pytest.raises(ValueError, match="short.txt:2"):
        load_maf2021(short)
    with pytest.raises(ValueError, match="trace_format"):
        load_trace(short, "maf2030")
