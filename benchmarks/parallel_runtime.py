"""Model-parallel runtime on Ray actors vs the auto-parallelizer's prediction (AlpaServe §3, §4.1).

For all-MiniLM-L6-v2 (real weights) and a ViT (timm vit_small_patch16 with random weights: a stand-in, its
speed does not depend on the weights), this benchmark profiles the layers (whole, and each block Megatron-sharded
over 2 actors, `parallel.sharded_profile`) and the actor-to-actor communication on this machine, plans three
configurations with the passes of `parallel/` -- one stage on one actor, two pipeline stages (inter-op DP), one
stage split 2-way (Megatron intra-op sharding) -- runs each on real Ray actors with one thread per actor, and
measures side by side:

* single-request latency (requests one after another) and saturated throughput (a burst of requests in flight;
  throughput is its steady state, answers per second from its first answer to its last, and the whole burst's rate
  is reported beside it), all three groups alive at once and measured in interleaved rounds, every other round in
  reverse order (medians over rounds);
* the profile's prediction (`placement.core.profiles.ConfigProfile`'s cost model, AlpaServe §3.3 plus the runtime's
  per-hop overhead the profiler measures), the plans cut from a profile taken before the rounds and priced by the
  mean of it and one taken after them (the shared VM's speed drifts over a minute): latency = sum of stage latencies
  plus each stage call's overhead; throughput = 1 / the slowest stage, capped, since the "devices" here are CPU
  shares of one host, by the host's cores / the CPU a request costs (compute of every shard, slowed by the model's
  measured co-run slowdown, plus every call's overhead CPU); for the whole burst, the first answer after the latency
  and each next one a period later (`max_burst_throughput_error`); `max_prediction_error_slowest_stage_only` is the
  error of the former prediction (latency = sum of stages, throughput = 1 / slowest stage);
* the largest difference of any output from the unsplit model's.

Then, on a stand-in ViT whose layers have deliberately unequal cost (`parallel.tiny_models.make_unequal_vit`: a
head as dear as all its blocks), the 2-stage pipeline with the DP plan's cut and with `ParallelPlan.even`'s, both
alive at once, throughput measured in interleaved rounds: `planned_vs_even_throughput` (planned over even, median
of the per-round ratios; >= 1 by construction of the DP when the profile is right).

Every pipeline stage actor reports its resident memory around loading its layers (it reads only its layers' tensors)
against its planned weight share: `stage_memory_vs_planned` per model, configuration and stage, and
`max_stage_memory_error` = the largest |resident / (planned share + runtime overhead) - 1| (goal <= 0.15), and
`max_stage_weights_rss_error` = the largest |RSS its tensors added / planned share - 1|.

`hop_1mb_s`: what one more pipeline hop adds to a request carrying a 1 MB activation over the stage transport
(`parallel.stage_transport`) and, side by side, over pickled frames on TCP sockets (a relay kept in this benchmark
for the comparison), and their ratio.

Final JSON line: `pipeline2_throughput_ratio` (2 stages vs 1 in steady state: median over rounds, the smaller of the
two models; `pipeline2_burst_throughput_ratio_per_model` with the fill),
`max_prediction_error` (relative, over latency and throughput of every configuration), `max_abs_diff`,
the CPU scaling of 2 processes vs 1 measured before and after (the ceiling of any 2-actor speed-up on this
machine at that time; with `--device cpu` only), and the figures per model and configuration. A PNG of measured vs
predicted throughput goes to benchmarks/out/.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray  # noqa: E402
import torch  # noqa: E402

from benchmarks._common import emit_json, make_parser, out_dir, setup_logging  # noqa: E402
from benchmarks._pickle_socket_baseline import PickleSocketLinks, PickleSocketRelay  # noqa: E402
from models.device import CPU_RESOURCE, GPU_RESOURCE  # noqa: E402
from models.layers import run_layers  # noqa: E402
from parallel.configurations import ModelPlanner  # noqa: E402
from parallel.group_runtime import ModelParallelGroup  # noqa: E402
from parallel.plan import ParallelPlan, StagePlan  # noqa: E402
from parallel.profiler import (  # noqa: E402
    CommProbe,
    ForeignLoadMeter,
    LayerProfileSet,
    ModelLayerProfile,
    device_description,
    interleaved_relay_latency_s,
    measure_co_run_slowdown,
    profile_comm,
    profile_layers,
    shape_key,
)
from parallel.sharded_profile import profile_sharded_blocks  # noqa: E402
from parallel.stage_layers import ModelSource, example_input, load_model  # noqa: E402
from parallel.stage_transport import PipelineTransport  # noqa: E402
from parallel.tensor_parallel import BlockShardingPlan  # noqa: E402
from parallel.tiny_models import make_tiny_vit, make_unequal_vit  # noqa: E402
from placement.core.profiles import ParallelConfig, shared_host_cores  # noqa: E402

log = setup_logging("parallel_runtime")

RAY_NUM_CPUS = 4
#: The CPU-scaling probe: single-thread matmuls of this size for this many seconds, in 1 then 2 processes.
CEILING_MATRIX_SIZE = 256
CEILING_SECONDS = 3.0
BATCH_SIZE = 1
TEXT_SEQ_LEN_TOKENS = 64
VIT_ARCH = "vit_small_patch16_224"
VIT_IMAGE_PX = 128
VIT_CLASSES = 10
#: The unequal-cost stand-in at a size where stage compute outweighs the per-request actor-call overhead: vit_small
#: width with a 64k-class head (at 128 px on one thread the head costs a few blocks' compute).
UNEQUAL_ARCH = VIT_ARCH
UNEQUAL_CLASSES = 64_000
#: Timed passes per layer in the profile (--quick, full): whole-model passes, so 30 spread MiniLM's profile over about
#: a second; a profile of a few passes (0.2 s) catches whatever speed the shared VM has in that instant, and every
#: prediction inherits it.
QUICK_LAYER_REPEATS = 30
FULL_LAYER_REPEATS = 60
#: Timed repeats of each collective size in the communication profile (--quick, full).
QUICK_COMM_REPEATS = 5
FULL_COMM_REPEATS = 20
#: Requests of the throughput burst (--quick, full): its steady state spans n - 1 answers. A 2-stage pipeline spends
#: one stage time filling and one draining per burst, so the whole burst runs at most n / (n + 1) of the steady
#: throughput: 0.96 at 24 (the burst's prediction, `ConfigProfile.burst_s`, holds the same fill).
QUICK_BURST_REQUESTS = 24
FULL_BURST_REQUESTS = 40
#: Measured rounds per model (--quick, full): each round measures every configuration once.
QUICK_ROUNDS = 9
FULL_ROUNDS = 11
#: Requests per round and extra rounds of the planned-vs-even comparison (a round of 12 requests lasts
#: ~0.2 s, too short for a stable ratio on a shared VM).
PLANNED_VS_EVEN_REQUESTS = 40
PLANNED_VS_EVEN_EXTRA_ROUNDS = 2
#: The hop comparison: a 1 MB activation relayed through chains of 1 and 2 actors, sequential requests (median) per
#: chain and round, rounds alternating the two transports.
HOP_COMPARISON_BYTES = 1 << 20
HOP_COMPARISON_REQUESTS = 30
HOP_COMPARISON_ROUNDS = 5
#: The fewest cores the prediction leaves the stages beyond the cluster's background when other processes load the
#: host (a floor that keeps the price finite under any foreign load).
MIN_CORES_LEFT = 0.25
CONFIGS = {
    "1-stage": ParallelConfig(intra_op_degree=1, pipeline_stages=1),
    "2-stage": ParallelConfig(intra_op_degree=1, pipeline_stages=2),
    "2-way-intra-op": ParallelConfig(intra_op_degree=2, pipeline_stages=1),
}


def megatron_plan(planner: ModelPlanner) -> ParallelPlan:
    """One stage, every block Megatron-sharded 2 ways."""
    layers = planner.profile.layers
    blocks = [m.index for m in layers if m.kind == "block"]
    sharding = BlockShardingPlan.megatron().as_dict()
    return ParallelPlan(intra_op_degree=2, stages=[StagePlan(start_layer=0, end_layer=len(layers),
                                                             block_shardings={i: dict(sharding) for i in blocks})])


def _lone_request(group: ModelParallelGroup, state, expected) -> tuple[float, float]:
    """(latency, max |diff| from the unsplit model) of one request with nothing else in flight."""
    start = time.perf_counter()
    out = group.infer(state)
    return time.perf_counter() - start, (out.hidden - expected).abs().max().item()


def _burst(group: ModelParallelGroup, states, expected, requests: int) -> dict:
    """A burst of `requests` in flight. Throughput is its steady state: answers per second between its first answer
    and its last (the pipeline's fill before the first answer is latency, which lone requests measure); the whole
    burst's rate is kept beside it, and the CPU load of processes other than this benchmark's (`ForeignLoadMeter`)
    over the burst."""
    answered_at: list[float] = []
    meter = ForeignLoadMeter()
    meter.start()
    start = time.perf_counter()
    pending = [group.submit(states[i % len(states)]) for i in range(requests)]
    for future in pending:
        future.add_done_callback(lambda _: answered_at.append(time.perf_counter()))
    outputs = [group.result(future) for future in pending]
    elapsed = time.perf_counter() - start
    foreign = meter.stop()
    return {"throughput_rps": (len(answered_at) - 1) / (max(answered_at) - min(answered_at)),
            "burst_throughput_rps": requests / elapsed, "foreign_cpu_cores": foreign or 0.0,
            "max_abs_diff": max((o.hidden - expected[i % len(states)]).abs().max().item()
                                for i, o in enumerate(outputs))}


def measure_side_by_side(source: ModelSource, plans: dict[str, ParallelPlan], profile: ModelLayerProfile, states,
                         expected, args, latency_requests: int) -> tuple[dict, dict, dict]:
    """Start one group per plan, all alive at once, and measure them in interleaved rounds, every other round in
    reverse order (the machine is shared: a load spike then hits every plan alike, and a drift favours none). In a
    round each plan gets its lone requests one after another, then its burst: a plan's stage actors idle for
    another plan's turn, and on a shared VM a core that idled for a while computes its next tens of milliseconds
    slower, so requests interleaved across plans would each pay that once per stage (the first lone request
    of a turn does; the median of them does not). Returns the rounds, the stage memory of the pipeline-only groups
    and the weight bytes of every actor, by plan label."""
    groups = {label: ModelParallelGroup(source, plan, num_gpus_per_actor=args.gpus_per_actor)
              for label, plan in plans.items()}
    rounds: dict[str, list[dict]] = {label: [] for label in plans}
    try:
        for group in groups.values():
            group.infer_many(states[:2])  # warm-up
        for number in range(args.rounds):
            order = list(groups) if number % 2 == 0 else list(reversed(groups))
            for label in order:
                lone = [_lone_request(groups[label], states[i % len(states)], expected[i % len(states)])
                        for i in range(latency_requests)]
                burst = _burst(groups[label], states, expected, args.throughput_requests)
                rounds[label].append({**burst, "latency_s": statistics.median(t for t, _ in lone),
                                      "max_abs_diff": max(burst["max_abs_diff"], *(d for _, d in lone))})
            log.info("%s round %d/%d: %s req/s", source.name, number + 1, args.rounds,
                     {label: round(r[-1]["throughput_rps"], 2) for label, r in rounds.items()})
        memory = {label: stage_memory(group, profile) for label, group in groups.items()
                  if group.plan.intra_op_degree == 1}
        weight_bytes = {label: group.weight_bytes for label, group in groups.items()}
    finally:
        for group in groups.values():
            group.shutdown()
    return rounds, memory, weight_bytes


def measure_profile(source: ModelSource, seq: int | None, args, model=None) -> ModelLayerProfile:
    """Every measurement the cost model reads for one model: its layers whole, its co-run slowdown, its blocks
    Megatron-sharded over 2 actors."""
    log.info("%s: profiling layers", source.name)
    on_cpu = args.device == "cpu"  # on a GPU the profile loads its own copy (the layers move there)
    profile = profile_layers(source, [BATCH_SIZE], [seq] if seq else [], repeats=args.repeats,
                             model=model if on_cpu else None, device=args.device)
    if on_cpu:  # the co-run slowdown prices CPU shares of one host
        profile.co_run_slowdown = measure_co_run_slowdown(source, BATCH_SIZE, seq)
    if "2-way-intra-op" not in args.configs:
        return profile
    return profile_sharded_blocks(profile, (CONFIGS["2-way-intra-op"].intra_op_degree,), repeats=args.repeats)


def bench_model(source: ModelSource, comm, args, figures: dict) -> None:
    """Plan the three configurations, start all three groups, and measure them side by side; predict them from the
    mean of the profiles taken before and after."""
    torch.set_num_threads(1)
    model = load_model(source)
    seq = TEXT_SEQ_LEN_TOKENS if source.kind == "text" else None
    profile = measure_profile(source, seq, args, model)
    planner = ModelPlanner(profile, comm, seq)
    states = [example_input(model, BATCH_SIZE, seq, seed=i) for i in range(4)]
    with torch.inference_mode():
        expected = [run_layers(model.layers(), s).hidden for s in states]
    del model
    plans, ilp_choice = {}, {}
    for label, config in args.configs.items():
        planned = planner.plan(config, BATCH_SIZE)
        if config.intra_op_degree > 1:
            sharded = any(v != "replicated" for st in planned.plan.stages for b in st.block_shardings.values()
                          for v in b.values())
            ilp_choice[label] = "sharded" if sharded else "replicated"
            plans[label] = megatron_plan(planner)
        else:
            plans[label] = planned.plan
        log.info("%s %s: stages %s", source.name, label, [(s.start_layer, s.end_layer) for s in plans[label].stages])
    rounds, memory, weight_bytes = measure_side_by_side(source, plans, profile, states, expected, args,
                                                        args.latency_requests)
    # The mean of the profiles taken before and after the measured rounds (`ModelLayerProfile.merge`, weighted by
    # their timed runs, equal here): the shared VM's speed drifts by some 10% over a minute, and a prediction from one
    # profile inherits whatever speed it had in that instant.
    profile = profile.merge(measure_profile(source, seq, args))
    predictor = ModelPlanner(profile, comm, seq)
    # The groups' devices are CPU shares of this host: throughput is capped by its cores / CPU per request.
    host_cores = shared_host_cores(GPU_RESOURCE if args.device == "cuda" else CPU_RESOURCE,
                                   comm.hop.host_cores if comm.hop is not None else None)
    predictions = {label: predictor.price(plan).to_profile() for label, plan in plans.items()}
    results = {}
    for label, measured in rounds.items():
        latency = statistics.median(r["latency_s"] for r in measured)
        throughput = statistics.median(r["throughput_rps"] for r in measured)
        burst_throughput = statistics.median(r["burst_throughput_rps"] for r in measured)
        foreign = statistics.median(r["foreign_cpu_cores"] for r in measured)
        predicted = predictions[label]
        predicted_latency = predicted.latency(BATCH_SIZE)
        # The stages share the host's cores with whatever else runs on it: throughput is priced on the cores the
        # other processes left during the bursts, and beside it on all of them.
        left = None
        if host_cores is not None:
            left = max(host_cores - foreign, predicted.background_cpu_cores + MIN_CORES_LEFT)
        predicted_throughput = predicted.throughput_rps(BATCH_SIZE, left)  # steady state, as measured
        predicted_throughput_all_cores = predicted.throughput_rps(BATCH_SIZE, host_cores)
        # The whole burst of `throughput_requests` submitted at once: the first after the latency, then a period each.
        burst = args.throughput_requests
        predicted_burst_throughput = burst * BATCH_SIZE / predicted.burst_s(burst, BATCH_SIZE, left)
        uncapped_throughput = predicted.throughput_rps(BATCH_SIZE)  # the former prediction: 1 / slowest stage
        results[label] = {
            "latency_s": latency, "throughput_rps": throughput, "burst_throughput_rps": burst_throughput,
            "predicted_burst_throughput_rps": predicted_burst_throughput,
            "burst_throughput_error": abs(predicted_burst_throughput - burst_throughput) / burst_throughput,
            "max_abs_diff": max(r["max_abs_diff"] for r in measured),
            "weight_bytes_per_actor": weight_bytes[label],
            **({"stage_memory_vs_planned": memory[label]} if label in memory else {}),
            "predicted_latency_s": predicted_latency, "predicted_throughput_rps": predicted_throughput,
            "foreign_cpu_cores": foreign, "host_cores_left": left,
            "predicted_throughput_rps_all_cores": predicted_throughput_all_cores,
            "throughput_error_all_cores": abs(predicted_throughput_all_cores - throughput) / throughput,
            "predicted_throughput_rps_slowest_stage_only": uncapped_throughput,
            "predicted_cpu_per_request_s": predicted.cpu_per_batch_s(BATCH_SIZE) / BATCH_SIZE,
            "throughput_error_slowest_stage_only": abs(uncapped_throughput - throughput) / throughput,
            "latency_error_stages_only": abs(sum(st.latency(BATCH_SIZE) for st in predicted.stages) - latency)
            / latency,
            "latency_error": abs(predicted_latency - latency) / latency,
            "throughput_error": abs(predicted_throughput - throughput) / throughput,
            "stages": [[s.start_layer, s.end_layer] for s in plans[label].stages],
            "co_run_slowdown": predicted.co_run_slowdown,
            **({"ilp_choice_at_this_comm_cost": ilp_choice[label]} if label in ilp_choice else {}),
        }
        log.info("%s %s: measured %.2f ms, %.2f req/s (predicted %.2f ms, %.2f req/s), max |diff| %.2e", source.name,
                 label, 1e3 * latency, throughput, 1e3 * predicted_latency, predicted_throughput,
                 results[label]["max_abs_diff"])
    per_round = [b["throughput_rps"] / a["throughput_rps"] for a, b in zip(rounds["1-stage"], rounds["2-stage"])]
    results["pipeline2_throughput_ratio_median_of_rounds"] = statistics.median(per_round)
    per_round_burst = [b["burst_throughput_rps"] / a["burst_throughput_rps"]
                       for a, b in zip(rounds["1-stage"], rounds["2-stage"])]
    results["pipeline2_burst_throughput_ratio_median_of_rounds"] = statistics.median(per_round_burst)
    figures[source.name] = results


def stage_memory(group: ModelParallelGroup, profile: ModelLayerProfile) -> list[dict]:
    """Each stage actor's resident memory against its planned weight share (the profile's weight bytes of its layers;
    pipeline-only plans). Reading its tensors must add about its share (`weights_rss_over_planned`); beyond it the
    actor holds a runtime overhead: the weightless model skeleton plus what serving requests added since
    (activations, allocator caches). `resident_over_planned_plus_overhead` is the issue's check (goal within 15%);
    `peak_load_delta_bytes` shows the load never held more than the stage's share."""
    if group.plan.intra_op_degree != 1:
        raise ValueError("stage_memory prices pipeline-only plans (intra_op_degree 1)")
    reports = ray.get([row[0].memory_report.remote() for row in group.actors])
    figures = []
    for stage, report in zip(group.plan.stages, reports, strict=True):
        if report["rss_before_load_bytes"] is None or report["rss_after_skeleton_bytes"] is None:
            return []  # no /proc on this OS, or a model loaded whole
        planned = sum(m.weight_bytes for m in profile.layers[stage.start_layer:stage.end_layer])
        base, skeleton = report["rss_before_load_bytes"], report["rss_after_skeleton_bytes"]
        weights = report["rss_after_load_bytes"] - skeleton
        overhead = (skeleton - base) + max(0, report["rss_now_bytes"] - report["rss_after_load_bytes"])
        resident = report["rss_now_bytes"] - base
        figures.append({
            "stage": [stage.start_layer, stage.end_layer], "planned_weight_bytes": planned,
            "held_weight_bytes": report["weight_bytes"], "weights_rss_bytes": weights,
            "weights_rss_over_planned": weights / planned, "skeleton_rss_bytes": skeleton - base,
            "peak_load_delta_bytes": report["peak_rss_after_load_bytes"] - base,
            "runtime_overhead_bytes": overhead, "resident_bytes": resident,
            "resident_over_planned_plus_overhead": resident / (planned + overhead),
        })
    return figures


def gpu_share_per_actor(num_gpus: int, actors_alive: int) -> float:
    """The share of a GPU each of `actors_alive` stage actors reserves so that all of them hold their shares on
    `num_gpus` GPUs at once (a share sized for fewer actors leaves the last ones waiting for a GPU that never
    frees): Ray never splits a fractional share across GPUs, so each GPU holds a whole number of shares, 1 / the
    actors per GPU (5 actors on 2 GPUs: 3 per GPU, a third each; 0.4 each would leave the fifth without a GPU);
    at most one GPU each, and none without GPUs."""
    if num_gpus <= 0:
        return 0.0
    return 1.0 / math.ceil(actors_alive / num_gpus)


def planned_vs_even(directory: str, comm, args) -> dict:
    """The DP's 2-stage cut against the even cut on the unequal-cost stand-in, measured side by side."""
    torch.set_num_threads(1)
    source = make_unequal_vit(directory, image_size_px=VIT_IMAGE_PX, arch=UNEQUAL_ARCH, num_classes=UNEQUAL_CLASSES)
    model = load_model(source)
    log.info("%s: profiling layers", source.name)
    profile = profile_layers(source, [BATCH_SIZE], repeats=args.repeats,
                             model=model if args.device == "cpu" else None, device=args.device)
    planned = ModelPlanner(profile, comm, None).plan(CONFIGS["2-stage"], BATCH_SIZE)
    plans = {"planned": planned.plan, "even": ParallelPlan.even(len(profile.layers), pipeline_stages=2)}
    states = [example_input(model, BATCH_SIZE, seed=i) for i in range(4)]
    with torch.inference_mode():
        expected = [run_layers(model.layers(), s).hidden for s in states]
    del model
    # Both groups are alive at once: their 2 x 2 stage actors share the GPUs.
    longer = argparse.Namespace(rounds=args.rounds + PLANNED_VS_EVEN_EXTRA_ROUNDS,
                                throughput_requests=PLANNED_VS_EVEN_REQUESTS,
                                gpus_per_actor=gpu_share_per_actor(args.num_gpus, len(plans) * 2))
    rounds, memory, _ = measure_side_by_side(source, plans, profile, states, expected, longer, latency_requests=1)
    per_round = [p["throughput_rps"] / e["throughput_rps"] for p, e in zip(rounds["planned"], rounds["even"])]
    layer_s = [m.latency_s[shape_key(BATCH_SIZE, profile.tokens_per_sequence)] for m in profile.layers]
    result = {
        "planned_vs_even_throughput": statistics.median(per_round),
        "per_round": per_round,
        "cuts_differ": plans["planned"] != plans["even"],
        "layer_latency_s": layer_s,
        "max_abs_diff": max(r["max_abs_diff"] for measured in rounds.values() for r in measured),
        "stage_memory_vs_planned": memory,
    }
    for label, plan in plans.items():
        stage_s = [sum(layer_s[s.start_layer:s.end_layer]) for s in plan.stages]
        result[label] = {"stages": [[s.start_layer, s.end_layer] for s in plan.stages],
                         "throughput_rps": statistics.median(r["throughput_rps"] for r in rounds[label]),
                         "predicted_throughput_rps_from_layers": 1.0 / max(stage_s)}
    log.info("%s: planned %s %.1f req/s vs even %s %.1f req/s: ratio %.2f", source.name, result["planned"]["stages"],
             result["planned"]["throughput_rps"], result["even"]["stages"], result["even"]["throughput_rps"],
             result["planned_vs_even_throughput"])
    return result


# ---- the hop comparison: the stage transport against the former pickled-socket links ----


def hop_comparison(payload_bytes: int = HOP_COMPARISON_BYTES) -> dict:
    """Seconds one more hop adds to a request carrying `payload_bytes` of activation, over the stage transport and
    over the former pickled-socket links (`benchmarks._pickle_socket_baseline`): the slope of sequential latency
    between chains of 1 and 2 relaying actors (zero compute; the chains take turns request by request), the two
    transports measured in alternating rounds (medians over rounds)."""
    from models.layers import ActivationState

    state = ActivationState(hidden=torch.ones(payload_bytes // 4))
    probes = [ray.remote(CommProbe).options(num_cpus=0.5).remote() for _ in range(2)]
    relays = [ray.remote(PickleSocketRelay).options(num_cpus=0.5).remote() for _ in range(2)]
    chains = {"stage_transport": {n: PipelineTransport([[actor] for actor in probes[:n]]) for n in (1, 2)},
              "pickle_socket": {n: PickleSocketLinks(relays[:n]) for n in (1, 2)}}
    hops: dict[str, list[float]] = {name: [] for name in chains}
    try:
        for number in range(HOP_COMPARISON_ROUNDS):
            for name in (list(chains) if number % 2 == 0 else list(reversed(chains))):
                latency = interleaved_relay_latency_s(chains[name], state, 1, HOP_COMPARISON_REQUESTS)
                hops[name].append(max(0.0, latency[2] - latency[1]))
    finally:
        for per_length in chains.values():
            for chain in per_length.values():
                chain.close()
        for actor in probes + relays:
            ray.kill(actor)
    result = {f"{name}_s": statistics.median(values) for name, values in hops.items()}
    result["payload_bytes"] = payload_bytes
    result["stage_transport_over_pickle_socket"] = result["stage_transport_s"] / result["pickle_socket_s"]
    log.info("one more hop with %d bytes: stage transport %.3f ms, pickled socket frames %.3f ms", payload_bytes,
             1e3 * result["stage_transport_s"], 1e3 * result["pickle_socket_s"])
    return result


def _matmul_loop(seconds: float, queue) -> None:
    torch.set_num_threads(1)
    a = torch.randn(CEILING_MATRIX_SIZE, CEILING_MATRIX_SIZE)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ a
        count += 1
    queue.put(count)


def two_process_cpu_scaling(seconds: float = CEILING_SECONDS) -> float:
    """Aggregate single-thread matmul throughput of 2 concurrent processes over that of 1: the most any 2-actor
    pipeline can gain on this machine right now (2.0 on two idle cores; ~1.0 when others hold one core)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    totals = []
    for count in (1, 2):
        queue = context.Queue()
        processes = [context.Process(target=_matmul_loop, args=(seconds, queue)) for _ in range(count)]
        for process in processes:
            process.start()
        totals.append(sum(queue.get() for _ in processes))
        for process in processes:
            process.join()
    return totals[1] / totals[0]


def plot(figures: dict, labels: list[str]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(figures), figsize=(5 * len(figures), 4), squeeze=False)
    for ax, (name, results) in zip(axes[0], figures.items()):
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], [results[k]["throughput_rps"] for k in labels], width=0.4, label="measured")
        ax.bar([i + 0.2 for i in x], [results[k]["predicted_throughput_rps"] for k in labels], width=0.4,
               label="predicted")
        ax.set_xticks(list(x), labels)
        ax.set_ylabel("requests / s (batch 1)")
        ax.set_title(name)
        ax.legend()
    fig.tight_layout()
    path = out_dir() / "parallel_runtime.png"
    fig.savefig(path)
    return path


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per layer in the profile")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the stage actors compute: cpu (1 thread each) or cuda (this machine's GPUs "
                             "shared among the groups' actors; the 2-way intra-op configuration needs 2 GPUs)")
    args = parser.parse_args()
    args.configs, args.gpus_per_actor, args.num_gpus = dict(CONFIGS), 0.0, 0
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no GPU on this machine")
        num_gpus = args.num_gpus = torch.cuda.device_count()
        if num_gpus < CONFIGS["2-way-intra-op"].intra_op_degree:  # NCCL refuses two shards on one GPU
            del args.configs["2-way-intra-op"]
        # Every group of a round is alive at once: 1 + 2 (+ 2) actors share the GPUs.
        args.gpus_per_actor = gpu_share_per_actor(num_gpus, sum(c.intra_op_degree * c.pipeline_stages
                                                                for c in args.configs.values()))
    args.repeats = args.repeats or (QUICK_LAYER_REPEATS if args.quick else FULL_LAYER_REPEATS)
    args.latency_requests = 5 if args.quick else 20
    args.throughput_requests = QUICK_BURST_REQUESTS if args.quick else FULL_BURST_REQUESTS
    args.rounds = QUICK_ROUNDS if args.quick else FULL_ROUNDS
    torch.set_num_threads(1)
    # The CPU-scaling ceiling bounds CPU-share "devices" only; with --device cuda the stages compute on GPUs.
    scaling_before = two_process_cpu_scaling() if args.device == "cpu" else None
    if scaling_before is not None:
        log.info("2 processes vs 1 on this machine now: %.2fx aggregate matmul throughput", scaling_before)
    ray.init(address="local", num_cpus=RAY_NUM_CPUS, include_dashboard=False, log_to_driver=False,
             **({"num_gpus": args.num_gpus} if args.num_gpus else {}))
    figures: dict = {}
    try:
        log.info("profiling sends and 2-way collectives between actors")
        comm = profile_comm((2,), repeats=QUICK_COMM_REPEATS if args.quick else FULL_COMM_REPEATS)
        log.info("comparing the per-hop cost of a %d-byte activation: stage transport vs pickled socket frames",
                 HOP_COMPARISON_BYTES)
        hop_1mb = hop_comparison()
        with tempfile.TemporaryDirectory() as tmp:
            vit = make_tiny_vit(tmp, arch=VIT_ARCH, image_size_px=VIT_IMAGE_PX, num_classes=VIT_CLASSES,
                                name=f"{VIT_ARCH}-{VIT_IMAGE_PX}px-random-weights", timm_kwargs={})
            minilm = ModelSource(name="all-minilm-l6-v2", kind="text", source="package:all-minilm-l6-v2")
            for source in (minilm, vit):
                bench_model(source, comm, args, figures)
            unequal = planned_vs_even(tmp, comm, args)
    finally:
        ray.shutdown()
    scaling_after = two_process_cpu_scaling() if args.device == "cpu" else None
    if scaling_after is not None:
        log.info("2 processes vs 1 after the runs: %.2fx", scaling_after)
    png = plot(figures, list(args.configs))
    configs = [r[label] for r in figures.values() for label in args.configs]
    errors = [c[k] for c in configs for k in ("latency_error", "throughput_error")]
    errors_all_cores = [c[k] for c in configs for k in ("latency_error", "throughput_error_all_cores")]
    errors_uncapped = [c[k] for c in configs for k in ("latency_error_stages_only",
                                                        "throughput_error_slowest_stage_only")]
    ratios = {name: r["pipeline2_throughput_ratio_median_of_rounds"] for name, r in figures.items()}
    burst_ratios = {name: r["pipeline2_burst_throughput_ratio_median_of_rounds"] for name, r in figures.items()}
    memory = {name: {label: r[label]["stage_memory_vs_planned"] for label in args.configs if "stage_memory_vs_planned"
                     in r[label]} for name, r in figures.items()}
    memory["unequal-vit"] = unequal["stage_memory_vs_planned"]
    stages = [stage for per_model in memory.values() for per_config in per_model.values() for stage in per_config]
    emit_json({
        "pipeline2_throughput_ratio": min(ratios.values()),
        "pipeline2_throughput_ratio_per_model": ratios,
        "pipeline2_burst_throughput_ratio_per_model": burst_ratios,
        "max_burst_throughput_error": max(c["burst_throughput_error"] for c in configs),
        "max_prediction_error": max(errors),
        "max_prediction_error_all_cores": max(errors_all_cores),
        "foreign_cpu_cores_max": max(c["foreign_cpu_cores"] for c in configs),
        "max_prediction_error_slowest_stage_only": max(errors_uncapped),
        "max_abs_diff": max(c["max_abs_diff"] for c in configs + [unequal]),
        "planned_vs_even_throughput": unequal["planned_vs_even_throughput"],
        "hop_1mb_s": hop_1mb,
        "planned_vs_even": unequal,
        "max_stage_memory_error": max((abs(s["resident_over_planned_plus_overhead"] - 1) for s in stages),
                                      default=None),
        "max_stage_weights_rss_error": max((abs(s["weights_rss_over_planned"] - 1) for s in stages), default=None),
        "stage_memory_vs_planned": memory,
        "two_process_cpu_scaling_before_after": [scaling_before, scaling_after],
        "device": device_description() if args.device == "cpu" else f"cuda: {torch.cuda.get_device_name(0)}",
        "comm": LayerProfileSet(device=device_description(), comm=comm).comm.model_dump(),
        "models": figures,
        "png": str(png),
        "quick": args.quick,
    })


if __name__ == "__main__":
    main()
