"""Polymorphing benchmark (Arlo): simulated latency of Arlo vs ST/DT/INFaaS-like/ILB/IG, allocation solve time,
dispatch throughput, and a small real run of MiniLM static runtimes on this machine.

1. Simulation at Arlo's scale with the paper-shaped Bert-Base profiles (placement.arlo.paper_profiles: a
   reproduction of Arlo Fig. 2, not a measurement), a synthetic Twitter-like length distribution recalibrated to
   512 tokens (median 21 / p98 72 of 125 in Arlo §2.1, scaled by 512/125, with a drifting 10 s scale for the
   short-term fluctuation of §3.2), stable Poisson and bursty MMPP arrivals. The load is the highest of a few
   levels at which ST still meets its SLO for >= 90% of requests on the bursty trace.
   Arlo Table 4's first setting (Bert-Large, 25 GPUs, 6k req/s, bursty) compares Alg. 1 with ILB and IG near capacity.
2. Runtime allocation (Eq. 1-7, exact DP) for 1000 devices x 16 runtimes (Bert-Large reproduction profiles).
3. Dispatch decisions per second of the Alg. 1 policy object with 1200 instances over 12 runtimes (Arlo §5.1.4).
4. Real MiniLM: the latency staircase of static runtimes measured here, runtime lengths chosen from it, backends
   compared at one shape, and the mean service latency of requests run on their ideal runtime vs on the single
   longest runtime (ST) vs the dynamic runtime (DT), executed for real, side by side; and the same request mix
   at saturation on runtimes of the same shapes executed padded (one request per row, Arlo) vs packed with
   ConcatBatching (several requests per row, TCB §4.1), as requests per CPU second (`packed_vs_padded_throughput`).

Usage: .venv/bin/python benchmarks/polymorphing.py --quick
"""

from __future__ import annotations

import random
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import emit_json, make_parser, out_dir, setup_logging  # noqa: E402
from placement.arlo.paper_profiles import dynamic_latency_s, paper_runtime_profiles  # noqa: E402
from placement.arlo.request_scheduler import ArloDispatch  # noqa: E402
from placement.arlo.runtime_allocation import allocation_lower_bounds, solve_allocation  # noqa: E402
from placement.arlo.runtimes import RuntimeProfile, RuntimeProfileSet, choose_runtime_lengths  # noqa: E402
from placement.arlo.simulation import SCHEMES, simulate  # noqa: E402
from placement.core.arrivals import MarkovModulatedProcess, PoissonProcess  # noqa: E402

log = setup_logging("polymorphing")

#: Arlo §2.1: Twitter lengths, median 21 and p98 72 tokens, longest about 125; recalibrated to 512 (§5).
TWITTER_MEDIAN_TOKENS, TWITTER_P98_TOKENS, TWITTER_MAX_TOKENS = 21, 72, 125
Z_98 = 2.054
#: Short-term drift of the length scale: a new lognormal factor every window (synthetic, after Arlo §3.2 Fig. 1).
DRIFT_WINDOW_S, DRIFT_SIGMA = 10.0, 0.15
#: MMPP: burst state at BURST_FACTOR x the quiet rate, dwell times in seconds (synthetic, after Arlo §5).
BURST_FACTOR, QUIET_DWELL_S, BURST_DWELL_S = 3.0, 4.0, 1.0
#: Arlo §5.2.2 runs Bert-Base at 8k req/s on 90 GPUs.
PAPER_DEVICES = 90
ST_ATTAINMENT_TARGET = 0.90
#: Load of the Table-4-like dispatch comparison, as a fraction of the ideal-runtime capacity.
TABLE4_LOAD = 0.85
LOAD_FRACTIONS_OF_ST_CAPACITY = (0.7, 0.65, 0.6, 0.55, 0.5, 0.45, 0.4)


def twitter_like_lengths(times_s: np.ndarray, max_tokens: int, rng: np.random.Generator) -> np.ndarray:
    """Lognormal lengths matching Twitter's median/p98, scaled to `max_tokens`, drifting every DRIFT_WINDOW_S."""
    sigma = np.log(TWITTER_P98_TOKENS / TWITTER_MEDIAN_TOKENS) / Z_98
    scale = max_tokens / TWITTER_MAX_TOKENS
    windows = np.floor((times_s - times_s.min()) / DRIFT_WINDOW_S).astype(int)
    drift = np.exp(rng.normal(0.0, DRIFT_SIGMA, windows.max() + 1))[windows]
    raw = np.exp(rng.normal(np.log(TWITTER_MEDIAN_TOKENS), sigma, len(times_s))) * scale * drift
    return np.clip(np.ceil(raw), 2, max_tokens).astype(int)


def make_trace(kind: str, rate: float, duration_s: float, max_tokens: int, seed: int):
    rng = np.random.default_rng(seed)
    if kind == "stable":
        arrivals = PoissonProcess(rate).generate(0.0, duration_s, rng)
    else:
        quiet = rate * (QUIET_DWELL_S + BURST_DWELL_S) / (QUIET_DWELL_S + BURST_FACTOR * BURST_DWELL_S)
        arrivals = MarkovModulatedProcess((quiet, quiet * BURST_FACTOR),
                                          (QUIET_DWELL_S, BURST_DWELL_S)).generate(0.0, duration_s, rng)
    return arrivals, twitter_like_lengths(arrivals, max_tokens, rng)


def simulated_comparison(args) -> dict:
    model = "bert-base"
    profiles = paper_runtime_profiles(model)
    duration = 30.0 if args.quick else 240.0
    period = 20.0 if args.quick else 120.0
    dt_latency = lambda length: dynamic_latency_s(model, length)  # noqa: E731
    chosen_rate = st_sustained_rate(profiles, duration)
    results: dict = {"model": f"{model} (paper-shaped reproduction profiles)", "devices": PAPER_DEVICES,
                     "rate_req_per_s": round(chosen_rate), "duration_s": duration, "period_s": period, "traces": {}}
    curves = {}
    for kind in ("stable", "bursty"):
        arrivals, lengths = make_trace(kind, chosen_rate, duration, 512, seed=1)
        history_arrivals, history = make_trace(kind, chosen_rate, period, 512, seed=2)
        per_scheme = {}
        for scheme in SCHEMES:
            started = time.perf_counter()
            result = simulate(scheme, profiles, arrivals, lengths, PAPER_DEVICES, initial_lengths_tokens=history,
                              period_s=period, dynamic_latency_s=dt_latency)
            per_scheme[scheme] = result.summary()
            curves[(kind, scheme)] = result.latencies_s
            log.info("%s %s: mean %.1f ms, p98 %.1f ms, SLO %.3f (%d requests, %.1fs)", kind, scheme,
                     result.mean_s * 1e3, result.p98_s * 1e3, result.slo_attainment, len(arrivals),
                     time.perf_counter() - started)
        results["traces"][kind] = per_scheme
    _plot(curves, profiles.runtimes[0].slo_s)
    return results


def st_sustained_rate(profiles: RuntimeProfileSet, duration_s: float, devices: int = PAPER_DEVICES) -> float:
    """The highest of LOAD_FRACTIONS_OF_ST_CAPACITY x ST's capacity at which ST still meets its SLO for
    ST_ATTAINMENT_TARGET of the bursty trace (seed 1); the lowest fraction if none does."""
    st_capacity = devices / (profiles.runtimes[-1].batch_latency(1) + 0.8e-3)
    for fraction in LOAD_FRACTIONS_OF_ST_CAPACITY:
        rate = fraction * st_capacity
        arrivals, lengths = make_trace("bursty", rate, duration_s, 512, seed=1)
        st = simulate("st", profiles, arrivals, lengths, devices)
        log.info("ST at %.0f req/s (%.2f of capacity): SLO attainment %.3f", rate, fraction, st.slo_attainment)
        if st.slo_attainment >= ST_ATTAINMENT_TARGET:
            return rate
    return LOAD_FRACTIONS_OF_ST_CAPACITY[-1] * st_capacity


def dispatch_under_load(args) -> dict:
    """Arlo Table 4's first setting (Bert-Large, 25 GPUs, bursty): Alg. 1 against ILB and IG near capacity.

    The paper's 6k req/s is relative to its GPUs; here the rate is TABLE4_LOAD of what 25 instances serve when every
    request runs on its ideal runtime (the reproduction profiles' absolute speed is an assumption).
    """
    model, devices = "bert-large", 25
    profiles = paper_runtime_profiles(model)
    sample = twitter_like_lengths(np.zeros(100_000), 512, np.random.default_rng(9))
    mean_service = (float(np.mean([profiles.runtimes[profiles.ideal_index(int(n))].batch_latency(1) for n in sample]))
                    + 0.8e-3)
    rate = TABLE4_LOAD * devices / mean_service
    duration = 30.0 if args.quick else 240.0
    period = 20.0 if args.quick else 120.0
    arrivals, lengths = make_trace("bursty", rate, duration, 512, seed=3)
    _, history = make_trace("bursty", rate, period, 512, seed=4)
    out = {"model": f"{model} (paper-shaped reproduction profiles)", "devices": devices, "rate_req_per_s": rate}
    for scheme in ("arlo", "ilb", "ig"):
        result = simulate(scheme, profiles, arrivals, lengths, devices, initial_lengths_tokens=history, period_s=period)
        out[scheme] = result.summary()
        log.info("Table-4 setting %s: mean %.1f ms, p98 %.1f ms, SLO %.3f", scheme, result.mean_s * 1e3,
                 result.p98_s * 1e3, result.slo_attainment)
    return out


def _plot(curves: dict, slo_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind in zip(axes, ("stable", "bursty")):
        for scheme in SCHEMES:
            data = np.sort(curves[(kind, scheme)]) * 1e3
            ax.plot(data, np.arange(1, len(data) + 1) / len(data), label=scheme)
        ax.axvline(slo_s * 1e3, color="grey", linestyle=":", label="SLO")
        ax.set_xscale("log")
        ax.set_xlabel("latency (ms)")
        ax.set_title(f"Bert-Base reproduction, Twitter-like {kind}")
        ax.legend(loc="lower right")
    axes[0].set_ylabel("CDF")
    fig.tight_layout()
    fig.savefig(out_dir() / "polymorphing_latency_cdf.png", dpi=120)
    plt.close(fig)


def allocation_solve_time(args) -> dict:
    profiles = paper_runtime_profiles("bert-large", list(range(32, 513, 32)))
    rng = np.random.default_rng(0)
    times = np.sort(rng.uniform(0, 10, 200_000))
    lengths = twitter_like_lengths(times, 512, rng)
    q = profiles.requests_per_bin(lengths, 200_000 / 100_000)  # 100k req/s, Arlo's 1000-GPU scale
    repeats = 3 if args.quick else 5
    cpu, wall = [], []
    for _ in range(repeats):
        started, started_cpu = time.perf_counter(), time.process_time()
        result = solve_allocation(profiles, q, 1000)
        wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    log.info("allocation 1000 devices x 16 runtimes: %.3f s CPU, %.3f s wall (min of %d; the machine is shared); "
             "floors need %d devices; N = %s", min(cpu), min(wall), repeats, sum(allocation_lower_bounds(profiles, q)),
             result.instances)
    # CPU time is this process's own work: on a shared 2-core machine the wall clock mostly measures the neighbours.
    return {"alloc_solve_s_1000x16": min(cpu), "alloc_solve_wall_s_1000x16": min(wall),
            "alloc_instances": result.instances}


def dispatch_throughput(args) -> dict:
    lengths_by_runtime = [round(512 * (k + 1) / 12) for k in range(12)]
    capacities = {length: max(10, 160 - 12 * k) for k, length in enumerate(lengths_by_runtime)}
    policy = ArloDispatch(capacities)
    instance = 0
    for length in lengths_by_runtime:
        for _ in range(100):  # 1200 instances
            policy.add_instance(instance, length)
            instance += 1
    rng = random.Random(0)
    count = 100_000 if args.quick else 500_000
    lengths = [min(max(int(rng.lognormvariate(4.4, 0.6)), 1), 512) for _ in range(count)]
    in_flight: deque = deque()
    concurrent = 2400  # Arlo §5.1.4: up to 2400 concurrent requests
    dispatch, complete = policy.dispatch, policy.complete
    started, started_cpu = time.perf_counter(), time.process_time()
    for length in lengths:
        in_flight.append(dispatch(length))
        if len(in_flight) > concurrent:
            complete(in_flight.popleft())
    wall, cpu = time.perf_counter() - started, time.process_time() - started_cpu
    # Each decision is timed together with the completion that keeps 2400 requests in flight (conservative).
    log.info("dispatch (Alg. 1, 1200 instances, 12 runtimes, 2400 in flight): %.0f decisions per CPU second, "
             "%.0f per wall second", count / cpu, count / wall)
    return {"dispatch_per_s": count / cpu, "dispatch_per_wall_s": count / wall}


def real_minilm_run(args) -> dict:
    import torch

    from models.runtimes.length_staircase import measure_runtime_latencies, measure_staircase
    from models.runtimes.static_runtime import (
        DynamicRuntime,
        StaticRuntime,
        compare_backends,
        fastest_exact_backend,
        time_call,
    )
    from models.text_encoder import load_text_encoder

    torch.set_num_threads(1)
    encoder = load_text_encoder()
    max_tokens = 128 if args.quick else encoder.max_length
    backends = ("eager", "trace") if args.quick else ("eager", "trace", "compile")
    # Thread CPU time: torch runs on this one thread, and the shared machine's neighbours do not count against it.
    clock = time.thread_time
    comparison = compare_backends(encoder, 64, 1, backends=backends, repeats=5, clock=clock)
    backend = fastest_exact_backend(comparison)
    step = 16 if args.quick else 16
    staircase = measure_staircase(encoder, list(range(step, max_tokens + 1, step)), backend=backend, repeats=5,
                                  clock=clock)
    runtime_lengths = choose_runtime_lengths(staircase.lengths_tokens, staircase.latencies_s, max_runtimes=4)
    log.info("MiniLM staircase (%s): %s -> runtimes %s", backend,
             [f"{n}:{s * 1e3:.1f}ms" for n, s in zip(staircase.lengths_tokens, staircase.latencies_s)], runtime_lengths)
    slo_s = 0.2
    profiles = RuntimeProfileSet(model="all-minilm-l6-v2", source="measured:this-machine-cpu", runtimes=[
        RuntimeProfile(max_length_tokens=length,
                       batch_latency_s=measure_runtime_latencies(encoder, length, [1], backend, 3, clock),
                       max_batch_size=1, slo_s=slo_s) for length in runtime_lengths])
    runtimes = {length: StaticRuntime(encoder, length, 1, backend=backend) for length in runtime_lengths}
    dynamic = DynamicRuntime(encoder)
    rng = np.random.default_rng(5)
    lengths = twitter_like_lengths(np.zeros(30 if args.quick else 100), max_tokens, rng)
    requests = [[101] + [2000 + k for k in range(n - 2)] + [102] for n in lengths]
    ideal = {}
    served = {"arlo_ideal_runtime": [], "st_longest_runtime": [], "dt_dynamic": []}
    for ids in requests:  # interleaved, so machine noise hits all three alike
        length = runtime_lengths[profiles.ideal_index(len(ids))]
        ideal[length] = ideal.get(length, 0) + 1
        served["arlo_ideal_runtime"].append(time_call(lambda: runtimes[length].run_tokens([ids]), 3, 0, "min", clock))
        served["st_longest_runtime"].append(time_call(lambda: runtimes[runtime_lengths[-1]].run_tokens([ids]), 3, 0,
                                                      "min", clock))
        served["dt_dynamic"].append(time_call(lambda: dynamic.run_tokens([ids]), 3, 0, "min", clock))
    means = {k: float(np.mean(v)) for k, v in served.items()}
    log.info("real MiniLM mean service latency: %s", {k: f"{v * 1e3:.2f} ms" for k, v in means.items()})
    packing = packed_vs_padded(encoder, requests, runtime_lengths, profiles, served, backend, clock)
    return {
        "clock": "thread CPU time, min of repeats (shared machine)",
        "backends": {c.backend: {"latency_ms": c.latency_s * 1e3, "build_s": c.build_s, "max_abs_diff": c.max_abs_diff}
                     for c in comparison},
        "backend_used": backend,
        "staircase_ms": {n: s * 1e3 for n, s in zip(staircase.lengths_tokens, staircase.latencies_s)},
        "runtime_lengths": runtime_lengths,
        "capacity_within_slo": {r.max_length_tokens: r.capacity_requests for r in profiles.runtimes},
        "requests_per_ideal_runtime": ideal,
        "mean_service_ms": {k: v * 1e3 for k, v in means.items()},
        "real_mean_ratio_arlo_vs_st": means["arlo_ideal_runtime"] / means["st_longest_runtime"],
        "packing": packing,
        "packed_vs_padded_throughput": packing["packed_vs_padded_throughput"],
    }


#: Rows of every runtime in the padded-vs-packed comparison: the batch size of the padded runtimes above.
PACKED_ROWS = 1
#: Repeats of each timed group run (the minimum counts, as for the padded per-request timings).
PACKED_REPEATS = 3


def packed_vs_padded(encoder, requests, runtime_lengths, profiles, served, backend, clock) -> dict:
    """The request mix at saturation: every request waits at its runtime, padded runs one per row, packed fills rows.

    Padded figures are the per-request timings already taken (one [1, L] pass each); packed runtimes have the same
    [PACKED_ROWS, L] shapes and run each runtime's whole backlog with ConcatBatching. Arlo routing (each request on
    its ideal runtime) and ST (all on the longest) are both measured; the headline ratio is Arlo's.
    """
    from models.runtimes.static_runtime import PackedStaticRuntime, time_call

    packed = {length: PackedStaticRuntime(encoder, length, PACKED_ROWS, backend=backend) for length in runtime_lengths}
    backlog: dict[int, list] = {}
    for ids in requests:
        backlog.setdefault(runtime_lengths[profiles.ideal_index(len(ids))], []).append(ids)
    longest = runtime_lengths[-1]
    schemes = {"arlo_ideal_runtime": list(backlog.items()), "st_longest_runtime": [(longest, requests)]}
    count = len(requests)
    out: dict = {"rows": PACKED_ROWS, "requests": count, "throughput_req_per_cpu_s": {}, "forward_passes": {}}
    for scheme, groups in schemes.items():
        packed_s = sum(time_call(lambda: packed[length].run_tokens(group), PACKED_REPEATS, 0, "min", clock)
                       for length, group in groups)
        passes = sum(packed[length].num_passes([len(ids) for ids in group]) for length, group in groups)
        padded_s = float(np.sum(served[scheme]))
        out["throughput_req_per_cpu_s"][f"padded_{scheme}"] = count / padded_s
        out["throughput_req_per_cpu_s"][f"packed_{scheme}"] = count / packed_s
        out["forward_passes"][f"padded_{scheme}"] = count
        out["forward_passes"][f"packed_{scheme}"] = passes
        log.info("%s: padded %.1f req/s (%d passes), packed %.1f req/s (%d passes)", scheme, count / padded_s, count,
                 count / packed_s, passes)
    throughput = out["throughput_req_per_cpu_s"]
    out["packed_vs_padded_throughput"] = (throughput["packed_arlo_ideal_runtime"]
                                          / throughput["padded_arlo_ideal_runtime"])
    out["st_packed_vs_padded_throughput"] = (throughput["packed_st_longest_runtime"]
                                             / throughput["padded_st_longest_runtime"])
    return out


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--skip-real", action="store_true", help="skip the real MiniLM run")
    parser.add_argument("--only-real", action="store_true", help="only the real MiniLM run")
    args = parser.parse_args()
    figures: dict = {}
    if args.only_real:
        real = real_minilm_run(args)
        emit_json({"packed_vs_padded_throughput": real["packed_vs_padded_throughput"], "real_minilm": real})
        return
    log.info("1/4 allocation solve time")
    figures.update(allocation_solve_time(args))
    log.info("2/4 dispatch throughput")
    figures.update(dispatch_throughput(args))
    log.info("3/4 simulation at Arlo's scale")
    sim = simulated_comparison(args)
    bursty = sim["traces"]["bursty"]
    figures["mean_latency_ratio_vs_st"] = bursty["arlo"]["mean_ms"] / bursty["st"]["mean_ms"]
    figures["p98_ratio_vs_ilb"] = bursty["arlo"]["p98_ms"] / bursty["ilb"]["p98_ms"]
    figures["p98_ratio_vs_ig"] = bursty["arlo"]["p98_ms"] / bursty["ig"]["p98_ms"]
    figures["mean_latency_ratio_vs_dt"] = bursty["arlo"]["mean_ms"] / bursty["dt"]["mean_ms"]
    figures["mean_latency_ratio_vs_infaas"] = bursty["arlo"]["mean_ms"] / bursty["infaas"]["mean_ms"]
    figures["simulation"] = sim
    log.info("3b/4 dispatch policies near capacity (Arlo Table 4 setting)")
    table4 = dispatch_under_load(args)
    figures["table4_p98_ratio_vs_ilb"] = table4["arlo"]["p98_ms"] / table4["ilb"]["p98_ms"]
    figures["table4_p98_ratio_vs_ig"] = table4["arlo"]["p98_ms"] / table4["ig"]["p98_ms"]
    figures["table4_setting"] = table4
    if not args.skip_real:
        log.info("4/4 real MiniLM runtimes")
        figures["real_minilm"] = real_minilm_run(args)
        figures["packed_vs_padded_throughput"] = figures["real_minilm"]["packed_vs_padded_throughput"]
    emit_json(figures)


if __name__ == "__main__":
    main()
