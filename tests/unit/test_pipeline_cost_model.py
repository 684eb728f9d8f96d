"""The configuration cost model with the runtime's per-hop overhead and the shared-host CPU cap (no timing)."""

from __future__ import annotations

import json

import pytest

from parallel.comm_model import AlphaBeta, CommModel, HopOverhead
from parallel.configurations import RuntimeOverhead
from placement.core.profiles import (
    GPU_DEVICE_RESOURCE,
    ConfigProfile,
    ParallelConfig,
    ProfileSet,
    StageProfile,
    shared_host_cores,
)

STAGE_S = (0.020, 0.016)
HOP_S = 0.002
HOP_CPU_S = 0.005
REQUEST_CPU_S = 0.003
CORES = 2.0


def two_stage(hop_overhead_s: float = HOP_S, hop_cpu_s: float = HOP_CPU_S,
              request_cpu_s: float = REQUEST_CPU_S) -> ConfigProfile:
    return ConfigProfile(config=ParallelConfig(pipeline_stages=2),
                         stages=[StageProfile(latency_s={1: s, 2: 2 * s}, weight_bytes_per_device=1) for s in STAGE_S],
                         hop_overhead_s=hop_overhead_s, hop_cpu_s=hop_cpu_s, request_cpu_s=request_cpu_s)


def test_hop_overhead_adds_to_every_stage_and_the_latency():
    profile = two_stage()
    assert profile.stage_latencies(1) == pytest.approx([s + HOP_S for s in STAGE_S])
    assert profile.latency(1) == pytest.approx(sum(STAGE_S) + 2 * HOP_S)
    assert profile.max_stage_latency(1) == pytest.approx(max(STAGE_S) + HOP_S)


def test_independent_devices_keep_one_over_the_slowest_stage():
    profile = two_stage()
    assert profile.period_s(1) == pytest.approx(max(STAGE_S) + HOP_S)
    assert profile.throughput_rps(2) == pytest.approx(2 / (2 * max(STAGE_S) + HOP_S))


def test_shared_host_caps_throughput_by_cpu_per_request():
    profile = two_stage()
    cpu = sum(STAGE_S) + 2 * HOP_CPU_S + REQUEST_CPU_S
    assert profile.cpu_per_batch_s(1) == pytest.approx(cpu)
    # 49 ms of CPU on 2 cores: 24.5 ms per request, above the slowest stage (22 ms): the cap binds.
    assert profile.period_s(1, CORES) == pytest.approx(cpu / CORES)
    assert profile.throughput_rps(1, CORES) == pytest.approx(CORES / cpu)
    # Many cores: the slowest stage binds again.
    assert profile.period_s(1, 64.0) == pytest.approx(max(STAGE_S) + HOP_S)


def test_intra_op_cap_counts_what_shards_compute_not_their_waits():
    sharded = ConfigProfile(config=ParallelConfig(intra_op_degree=2),
                            stages=[StageProfile(latency_s={1: 0.030, 2: 0.050}, cpu_s={1: 0.020, 2: 0.036},
                                                 weight_bytes_per_device=1)])
    assert sharded.cpu_per_batch_s(1) == pytest.approx(2 * 0.020)
    assert sharded.cpu_per_batch_s(3) == pytest.approx(2 * 0.052)  # extrapolated as the latency is
    assert sharded.latency(1) == pytest.approx(0.030)
    assert sharded.period_s(1, CORES) == pytest.approx(0.030)  # 40 ms of CPU on 2 cores: the stage binds
    whole = sharded.model_copy(update={"stages": [StageProfile(latency_s={1: 0.030}, weight_bytes_per_device=1)]})
    assert whole.cpu_per_batch_s(1) == pytest.approx(2 * 0.030)  # no compute figure: the latency


def test_background_cpu_leaves_fewer_cores_to_requests():
    busy = two_stage().model_copy(update={"background_cpu_cores": 0.25})
    cpu = busy.cpu_per_batch_s(1)
    assert busy.period_s(1, CORES) == pytest.approx(cpu / (CORES - 0.25))
    assert busy.period_s(1) == pytest.approx(two_stage().period_s(1))  # independent devices: no shared host
    with pytest.raises(ValueError, match="background CPU"):
        busy.period_s(1, 0.25)
    hop = HopOverhead(payload_bytes=1, latency_s=0.0, cpu_s=0.0, request_cpu_s=0.0, host_cores=CORES,
                      background_cpu_cores=0.25)
    send = AlphaBeta(alpha_s=0.0, beta_s_per_byte=0.0)
    assert RuntimeOverhead.from_comm(CommModel(send=send, hop=hop)).background_cpu_cores == 0.25


def test_intra_op_shards_each_cost_cpu_and_a_call():
    profile = ConfigProfile(config=ParallelConfig(intra_op_degree=2), hop_cpu_s=HOP_CPU_S,
                            stages=[StageProfile(latency_s={1: 0.030}, weight_bytes_per_device=1)])
    assert profile.cpu_per_batch_s(1) == pytest.approx(2 * 0.030 + 2 * HOP_CPU_S)


def test_gpus_are_never_a_shared_host():
    assert shared_host_cores(GPU_DEVICE_RESOURCE, CORES) is None
    assert shared_host_cores("CPU", CORES) == CORES
    assert shared_host_cores("plex_device", CORES) == CORES
    assert shared_host_cores("CPU", None) is None
    with pytest.raises(ValueError, match="host_cores"):
        shared_host_cores("CPU", 0)
    with pytest.raises(ValueError, match="host_cores"):
        two_stage().period_s(1, 0)


def test_profiles_without_overhead_fields_load_as_zero_overhead(tmp_path):
    profile = two_stage()
    data = json.loads(ProfileSet(source="measured", device="cpu", models={
        "m": {"name": "m", "configs": [profile.model_dump(mode="json")]}}).model_dump_json())
    for config in data["models"]["m"]["configs"]:
        for key in ("hop_overhead_s", "hop_cpu_s", "request_cpu_s", "request_overhead_s", "co_run_slowdown",
                    "background_cpu_cores"):
            del config[key]
    del data["host_cores"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = ProfileSet.load(path).models["m"].configs[0]
    assert old.latency(1) == pytest.approx(sum(STAGE_S))
    assert old.period_s(1, CORES) == pytest.approx(max(STAGE_S))  # compute alone: 18 ms < 20 ms on 2 cores
    assert ProfileSet.load(path).host_cores is None


def test_runtime_overhead_counts_only_what_the_send_fit_leaves_out():
    send = AlphaBeta(alpha_s=0.001, beta_s_per_byte=1e-9)
    payload = 100_000
    hop = HopOverhead(payload_bytes=payload, latency_s=0.004, cpu_s=0.006, request_cpu_s=REQUEST_CPU_S,
                      host_cores=CORES)
    overhead = RuntimeOverhead.from_comm(CommModel(send=send, hop=hop))
    sent = send.cost_s(payload)
    assert overhead.hop_overhead_s == pytest.approx(0.004 - sent)
    assert overhead.hop_cpu_s == pytest.approx(0.006 - sent)
    assert overhead.request_cpu_s == REQUEST_CPU_S
    # A hop cheaper than the send fit adds nothing; no measured hop (a file without one) adds nothing.
    cheap = hop.model_copy(update={"latency_s": 0.0, "cpu_s": 0.0})
    assert RuntimeOverhead.from_comm(CommModel(send=send, hop=cheap)).hop_overhead_s == 0.0
    assert RuntimeOverhead.from_comm(CommModel(send=send)) == RuntimeOverhead()


def test_comm_merge_keeps_a_measured_hop():
    send = AlphaBeta(alpha_s=0.001, beta_s_per_byte=0.0)
    hop = HopOverhead(payload_bytes=1, latency_s=0.001, cpu_s=0.001, request_cpu_s=0.0, host_cores=CORES)
    assert CommModel(send=send, hop=hop).merge(CommModel(send=send)).hop == hop
    newer = hop.model_copy(update={"cpu_s": 0.002})
    assert CommModel(send=send, hop=hop).merge(CommModel(send=send, hop=newer)).hop == newer


def test_co_run_slowdown_scales_compute_cpu_only():
    slowed = two_stage().model_copy(update={"co_run_slowdown": 1.5})
    assert slowed.cpu_per_batch_s(1) == pytest.approx(1.5 * sum(STAGE_S) + 2 * HOP_CPU_S + REQUEST_CPU_S)
    assert slowed.latency(1) == pytest.approx(two_stage().latency(1))  # one request alone does not co-run
    assert slowed.period_s(1) == pytest.approx(two_stage().period_s(1))  # independent devices: no shared host
    with pytest.raises(ValueError, match="co_run_slowdown"):
        ConfigProfile.model_validate({**two_stage().model_dump(), "co_run_slowdown": 0.5})


def test_intra_op_shards_co_run_even_for_one_request():
    sharded = ConfigProfile(config=ParallelConfig(intra_op_degree=2), hop_overhead_s=HOP_S, co_run_slowdown=1.5,
                            stages=[StageProfile(latency_s={1: 0.030}, weight_bytes_per_device=1)])
    assert sharded.latency(1) == pytest.approx(1.5 * 0.030 + HOP_S)
    assert sharded.period_s(1) == pytest.approx(1.5 * 0.030 + HOP_S)
    assert sharded.model_copy(update={"co_run_slowdown": 1.0}).latency(1) == pytest.approx(0.030 + HOP_S)


def test_request_overhead_adds_once_to_latency_and_a_burst_fills_the_pipeline():
    profile = two_stage().model_copy(update={"request_overhead_s": 0.004})
    assert profile.latency(1) == pytest.approx(sum(STAGE_S) + 2 * HOP_S + 0.004)
    assert profile.period_s(1) == pytest.approx(max(STAGE_S) + HOP_S)  # not part of any stage's time
    assert profile.burst_s(1) == pytest.approx(profile.latency(1))
    assert profile.burst_s(10, 1, CORES) == pytest.approx(profile.latency(1) + 9 * profile.period_s(1, CORES))
    with pytest.raises(ValueError, match="num_batches"):
        profile.burst_s(0)


def test_process_tree_finds_children_and_counts_their_cpu():
    import os
    import subprocess
    import sys

    from parallel.profiler import process_tree, processes_cpu_s

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        tree = process_tree(os.getpid())
        assert {os.getpid(), child.pid} <= tree
        assert processes_cpu_s(tree) > 0  # this interpreter has run the tests so far
        assert processes_cpu_s({-1}) == 0.0  # a process that does not exist counts nothing
    finally:
        child.kill()
        child.wait()
