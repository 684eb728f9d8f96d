"""ConcatBatching (TCB) on the real all-MiniLM-L6-v2: engine throughput, scheduler utility, end to end.

1. Engine throughput at saturation (TCB §6.2.2, FCFS): the same requests through naive batching (pad to the
   longest of each arrival-order batch), length-sorted batching split by TurboTransformers' DP, pure ConcatBatching
   and slotted ConcatBatching, interleaved and repeated; plus a zero-padding oracle (dense equal-length requests with
   the same total tokens). Lengths as TCB §6.2: a normal distribution of mean 20 and variance 20 (and 100), clipped
   to [3, 100] tokens. Token ids are drawn at random from the tokenizer's vocabulary (generated data).
2. Utility at increasing Poisson arrival rates (TCB §6.2.4) for DAS, Slotted DAS, FCFS, SJF and EDF, replayed on
   a simulated clock (placement/tcb/trace_replay.py) with a batch-latency model measured on the real engine above.
3. End to end through Ray Serve (only when the plexserve text replica runs ConcatBatching): the text replica vs a
   plain `@serve.batch` deployment that pads per batch, same model, same load, same CPUs.

4. Long texts (`--long-texts`, its own result file concat_batching_long_texts.json): texts of 100 +- 50 words drawn
   from the tokenizer's whole-word vocabulary, tokenized once, then embedded end to end (batch forming, packing or
   padding, forward, pooling) by the text replica's path (DAS batches of the replica's rows, packed, attention per
   text: `sdpa_segments`), the same path with one block-diagonal mask over each row (`sdpa`), length-sorted padded
   batches of 32 (sentence-transformers' order) and arrival-order padded batches of 32; interleaved, each run's best
   of the repeats. Final JSON line: texts_per_s of each, ratio_packed_vs_sorted, ratio_packed_vs_padded.

Final JSON line: ratio_vs_naive, ratio_vs_sorted (concat requests/s over the baseline's), oracle_ratio (concat
time / oracle time), all at length variance 20 (the same with suffix _variance_100), e2e_ratio_vs_serve_batch,
max_abs_diff (packed vs per-request embeddings), and more. Engine times are forward passes only (packing and
padding are built beforehand), each pass's best of the interleaved repeats.

    .venv/bin/python benchmarks/concat_batching.py --quick
"""

from __future__ import annotations

import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks._common` when run as a script
from benchmarks._common import emit_json, make_parser, out_dir, setup_logging
from models.batching_baselines import NaiveBatchingEngine, SortedBatchingEngine
from models.packed_text import ConcatBatchingEngine, PackedTextEncoder
from models.text_encoder import load_text_encoder
from placement.core.arrivals import poisson_arrivals
from placement.tcb.batch_scheduler import BatchDecision, TextRequest, make_batch_scheduler
from placement.tcb.trace_replay import replay

log = setup_logging("concat_batching")

#: TCB §6.2: request lengths 3-100 tokens, normal with mean 20.
MIN_TOKENS, MAX_TOKENS, MEAN_TOKENS = 3, 100, 20
VARIANCES = (20, 100)
#: TCB §6.2: batch size 64 for the padded baselines.
PADDED_BATCH_SIZE = 64
#: ConcatBatching batch: B rows of L tokens (TCB §5.1), and the slot size z of the slotted variant (TCB §4.2).
NUM_ROWS, ROW_LENGTH_TOKENS, SLOT_SIZE_TOKENS = 16, 128, 64
#: First wordpiece id of the BERT vocabulary past [unused]/special tokens and single characters.
FIRST_WORD_ID = 1996
#: Slot-size grid of the latency model (Slotted DAS rounds its slot size up to it).
SLOT_GRANULARITY_TOKENS = 16
#: Tokens of each batch the latency model times (rows of the width at hand).
LATENCY_BATCH_TOKENS = 1024
#: Deadline of a request in the utility replay, in full-batch latencies.
SLO_IN_BATCH_LATENCIES = 2.0
#: Length of the replayed trace, in full-batch latencies (many deadlines long).
TRACE_IN_BATCH_LATENCIES = 40.0
#: Arrival rates of the utility replay, as multiples of the measured concat capacity.
RATE_MULTIPLES = (0.5, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0)


@dataclass
class EngineTiming:
    name: str
    seconds: float  #: median time for all requests
    requests_per_s: float
    padding_fraction: float
    num_forward_passes: int


def clipped_normal_lengths(count: int, variance: float, rng: random.Random) -> list[int]:
    """TCB §6.2: lengths ~ Normal(20, variance), rounded and clipped to [3, 100]."""
    sigma = math.sqrt(variance)
    return [min(MAX_TOKENS, max(MIN_TOKENS, round(rng.gauss(MEAN_TOKENS, sigma)))) for _ in range(count)]


def make_token_ids(lengths: Sequence[int], cls_id: int, sep_id: int, vocab_size: int,
                   rng: random.Random) -> list[list[int]]:
    """Generated requests: [CLS] random wordpieces [SEP], each of the given total length."""
    return [[cls_id] + [rng.randrange(FIRST_WORD_ID, vocab_size) for _ in range(n - 2)] + [sep_id] for n in lengths]


def time_engines(steps: dict[str, list[Callable[[], object]]], repeats: int) -> dict[str, float]:
    """Seconds per engine: the sum over its forward passes of each pass's best time over the repeats.

    Every repeat runs the engines one after the other (interleaved), timing each forward pass alone. The machine is
    shared and noisy (a neighbour's burst can double a run), so each pass keeps its least disturbed time.
    """
    best: dict[str, list[float]] = {name: [math.inf] * len(passes) for name, passes in steps.items()}
    for repeat in range(repeats):
        for name, passes in steps.items():
            for index, run in enumerate(passes):
                start = time.perf_counter()
                run()
                best[name][index] = min(best[name][index], time.perf_counter() - start)
        log.info("repeat %d/%d: %s", repeat + 1, repeats, {k: round(sum(v), 3) for k, v in best.items()})
    return {name: sum(values) for name, values in best.items()}


def padded_steps(engine, token_ids: list[list[int]]) -> list[Callable[[], object]]:
    """The forward passes of a padded baseline, tensors built beforehand (only the forward is timed)."""
    batches = [engine.padded_batch([token_ids[i] for i in batch])
               for batch in engine.batches([len(t) for t in token_ids])]
    return [lambda b=b: engine.encoder.embed_tokens(b) for b in batches]


def concat_steps(engine: ConcatBatchingEngine, token_ids: list[list[int]]) -> list[Callable[[], object]]:
    """The forward passes of ConcatBatching (packed forward and per-request pooling), packed beforehand."""
    packed = [engine.packed.pack([token_ids[i] for i in group], engine.row_length_tokens, engine.num_rows,
                                 engine.slot_size_tokens) for group in engine.groups([len(t) for t in token_ids])]
    return [lambda b=b: engine.packed.embed_packed(b) for b in packed]


def oracle_steps(encoder, total_tokens: int, tokens_per_batch: int) -> list[Callable[[], object]]:
    """Zero-padding oracle: dense [n, 20] batches of equal-length requests, the same total tokens as the requests."""
    per_batch = max(1, tokens_per_batch // MEAN_TOKENS)
    num_requests = max(1, round(total_tokens / MEAN_TOKENS))
    steps = []
    for start in range(0, num_requests, per_batch):
        ids = torch.randint(FIRST_WORD_ID, encoder.tokenizer.vocab_size,
                            (min(per_batch, num_requests - start), MEAN_TOKENS))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
        steps.append(lambda b=batch: encoder.embed_tokens(b))
    return steps


def engine_throughput(encoder, token_ids: list[list[int]], repeats: int) -> dict[str, EngineTiming]:
    engines = {
        "naive": NaiveBatchingEngine(encoder, PADDED_BATCH_SIZE),
        "sorted": SortedBatchingEngine(encoder, PADDED_BATCH_SIZE),
        "concat": ConcatBatchingEngine(encoder, ROW_LENGTH_TOKENS, NUM_ROWS),
        "slotted_concat": ConcatBatchingEngine(encoder, ROW_LENGTH_TOKENS, NUM_ROWS,
                                               slot_size_tokens=max(SLOT_SIZE_TOKENS, max(map(len, token_ids)))),
    }
    stats = {name: engine.embed(token_ids).stats for name, engine in engines.items()}  # warm-up and statistics
    total_tokens = sum(map(len, token_ids))
    steps = {name: (concat_steps(engine, token_ids) if isinstance(engine, ConcatBatchingEngine)
                    else padded_steps(engine, token_ids))
             for name, engine in engines.items()}
    steps["oracle"] = oracle_steps(encoder, total_tokens, NUM_ROWS * ROW_LENGTH_TOKENS)
    seconds_by_engine = time_engines(steps, repeats)
    timings = {}
    for name, seconds in seconds_by_engine.items():
        s = stats.get(name)
        timings[name] = EngineTiming(name=name, seconds=seconds, requests_per_s=len(token_ids) / seconds,
                                     padding_fraction=s.padding_fraction if s else 0.0,
                                     num_forward_passes=s.num_forward_passes if s else len(steps[name]))
    return timings


def max_abs_diff(encoder, token_ids: list[list[int]]) -> float:
    """Packed (both variants) vs one-request-at-a-time embeddings."""
    sample = token_ids[:48]
    reference = torch.cat([encoder.embed_tokens({"input_ids": torch.tensor([ids]),
                                                 "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                                                 "token_type_ids": torch.zeros(1, len(ids),
                                                                               dtype=torch.long)}) for ids in sample])
    packed = PackedTextEncoder(encoder)
    worst = 0.0
    for slot in (None, max(SLOT_SIZE_TOKENS, max(map(len, sample)))):
        out = packed.embed_packed(packed.pack(sample, ROW_LENGTH_TOKENS, slot_size_tokens=slot)).embeddings
        worst = max(worst, float((out - reference).abs().max()))
    return worst


@dataclass
class LatencyModel:
    """Batch latency from measured full batches: seconds per computed token at each executed width."""

    seconds_per_token: dict[int, float]

    def __call__(self, decision: BatchDecision) -> float:
        bins = decision.bins()
        return self.rows_s(len(bins), max(sum(r.length_tokens for r in b) for b in bins))

    def rows_s(self, rows: int, width: int) -> float:
        """Seconds of one pass over `rows` rows of `width` tokens (the measured width at or above it)."""
        key = min((w for w in self.seconds_per_token if w >= width), default=max(self.seconds_per_token))
        return self.seconds_per_token[key] * rows * width


def measure_latency_model(encoder, repeats: int, granularity_tokens: int) -> LatencyModel:
    """Time full batches of LATENCY_BATCH_TOKENS tokens cut into rows of each width on the grid."""
    packed = PackedTextEncoder(encoder)
    batches = {}
    for width in range(granularity_tokens, ROW_LENGTH_TOKENS + 1, granularity_tokens):
        rows = max(1, LATENCY_BATCH_TOKENS // width)
        lengths = [width // 2, width - width // 2] * rows  # two requests per row, every row full
        ids = [[101] + [FIRST_WORD_ID] * (n - 2) + [102] if n >= 2 else [101] for n in lengths]
        batches[width] = packed.pack(ids, width)
        packed.forward_packed(batches[width])
    best = {width: math.inf for width in batches}
    for _ in range(repeats):  # widths interleaved in every repeat: a neighbour's burst cannot hit one width only
        for width, batch in batches.items():
            start = time.perf_counter()
            packed.forward_packed(batch)
            best[width] = min(best[width], time.perf_counter() - start)
    per_token = {width: best[width] / batch.computed_tokens for width, batch in batches.items()}
    log.info("latency model: %s", {w: f"{1e6 * s:.1f}us/token" for w, s in per_token.items()})
    return LatencyModel(per_token)


def poisson_trace(rate_per_s: float, duration_s: float, slo_s: float, variance: float,
                  rng: random.Random) -> list[TextRequest]:
    trace = []
    for index, now in enumerate(poisson_arrivals(rate_per_s, 0.0, duration_s, rng)):
        length = clipped_normal_lengths(1, variance, rng)[0]
        trace.append(TextRequest(request_id=index, length_tokens=length, arrival_s=now, deadline_s=now + slo_s))
    return trace


def utility_curves(latency: LatencyModel, variance: float, granularity_tokens: int) -> dict:
    """Utility per second of each scheduler at arrival rates around the capacity the latency model gives."""
    full_batch_s = latency.seconds_per_token[ROW_LENGTH_TOKENS] * NUM_ROWS * ROW_LENGTH_TOKENS
    capacity_per_s = 1.0 / (latency.seconds_per_token[ROW_LENGTH_TOKENS] * MEAN_TOKENS)
    duration_s = TRACE_IN_BATCH_LATENCIES * full_batch_s
    slo_s = SLO_IN_BATCH_LATENCIES * full_batch_s
    params = {"row_length_tokens": ROW_LENGTH_TOKENS, "num_rows": NUM_ROWS, "start_allowance_ms": 1000 * full_batch_s,
              "slot_granularity_tokens": granularity_tokens}
    curves: dict[str, list[float]] = {name: [] for name in ("das", "slotted_das", "fcfs", "sjf", "edf")}
    dropped: dict[str, list[int]] = {name: [] for name in curves}
    rates = [m * capacity_per_s for m in RATE_MULTIPLES]
    for rate in rates:
        trace = poisson_trace(rate, duration_s, slo_s, variance, random.Random(int(rate)))
        for name in curves:
            result = replay(trace, make_batch_scheduler(name, params), latency)
            curves[name].append(result.utility_per_s(duration_s))
            dropped[name].append(result.dropped + result.late)
        log.info("rate %.0f req/s (%d requests): %s", rate, len(trace), {k: round(v[-1], 1) for k, v in curves.items()})
    return {"rates_per_s": rates, "utility_per_s": curves, "missed": dropped, "slo_s": slo_s, "duration_s": duration_s}


#: End to end: closed-loop clients kept in flight against each deployment, and logical CPUs of each replica.
E2E_CONCURRENCY = 64
E2E_REPLICA_CPUS = 1.0
#: End to end: ConcatBatching rows of the plexserve replica; the baseline's token budget per batch is the same.
E2E_NUM_ROWS, E2E_ROW_LENGTH_TOKENS = 8, 128
E2E_BATCH_WAIT_MS = 10.0


def _serve_batch_baseline(max_batch_tokens: int, wait_s: float):
    """A plain Ray Serve deployment: `@serve.batch` with `batch_size_fn` counting tokens, padding per batch."""
    import asyncio

    from ray import serve

    @serve.deployment(max_ongoing_requests=4 * E2E_CONCURRENCY, ray_actor_options={"num_cpus": E2E_REPLICA_CPUS})
    class ServeBatchBaseline:
        def __init__(self):
            from rayserve_apps._threads import set_torch_threads_for
            set_torch_threads_for(E2E_REPLICA_CPUS)
            self.encoder = load_text_encoder()

        async def embed_token_ids(self, token_ids: list[list[int]]) -> list[list[float]]:
            return await self._batch(token_ids)

        @serve.batch(max_batch_size=max_batch_tokens, batch_wait_timeout_s=wait_s,
                     batch_size_fn=lambda calls: sum(len(ids) for call in calls for ids in call))
        async def _batch(self, calls: list[list[list[int]]]) -> list[list[list[float]]]:
            flat = [ids for call in calls for ids in call]
            embeddings = (await asyncio.to_thread(self.encoder.embed_token_ids, flat)).tolist()
            out, start = [], 0
            for call in calls:
                out.append(embeddings[start:start + len(call)])
                start += len(call)
            return out

    return ServeBatchBaseline


async def _drive(handle, token_ids: list[list[int]], concurrency: int) -> dict:
    """Closed loop: `concurrency` clients, each sends its next one-text call when the last one returns."""
    import asyncio

    latencies: list[float] = []
    next_index = 0

    async def client() -> None:
        nonlocal next_index
        while next_index < len(token_ids):
            ids = token_ids[next_index]
            next_index += 1
            start = time.perf_counter()
            await handle.embed_token_ids.remote([ids])
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    latencies.sort()
    return {"requests_per_s": len(token_ids) / elapsed, "p50_ms": 1000 * latencies[len(latencies) // 2],
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]}


def run_e2e(quick: bool, token_ids: list[list[int]]) -> dict:
    """plexserve's text replica (DAS + ConcatBatching) vs a plain `@serve.batch` deployment, same load and CPUs."""
    import asyncio
    import os
    import socket

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from rayserve_apps.app import build_app

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        spec = {"models": [{"name": "minilm", "kind": "text", "source": "package:all-minilm-l6-v2",
                            "num_cpus_per_replica": E2E_REPLICA_CPUS, "slo_ms": 600000,
                            "batch_wait_timeout_ms": E2E_BATCH_WAIT_MS,
                            "policies": {"batching": {"name": "das", "params": {
                                "num_rows": E2E_NUM_ROWS, "row_length_tokens": E2E_ROW_LENGTH_TOKENS}}}}]}
        serve.run(build_app(spec), name="plexserve-bench", route_prefix="/plexserve-bench")
        plex = serve.get_deployment_handle("model-minilm", app_name="plexserve-bench")
        baseline = serve.run(_serve_batch_baseline(E2E_NUM_ROWS * E2E_ROW_LENGTH_TOKENS,
                                                   E2E_BATCH_WAIT_MS / 1000).bind(),
                             name="serve-batch-bench", route_prefix="/serve-batch-bench")
        warm = token_ids[:8]
        for handle in (plex, baseline):
            asyncio.run(_drive(handle, warm, 4))
        results: dict[str, list[dict]] = {"plexserve": [], "serve_batch": []}
        rounds = 2 if quick else 3
        for round_index in range(rounds):  # interleaved: the machine is shared and noisy
            for name, handle in (("plexserve", plex), ("serve_batch", baseline)):
                results[name].append(asyncio.run(_drive(handle, token_ids, E2E_CONCURRENCY)))
                log.info("e2e round %d %s: %s", round_index + 1, name,
                         {k: round(v, 1) for k, v in results[name][-1].items()})
        summary = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                   for name, runs in results.items()}
        summary["ratio"] = summary["plexserve"]["requests_per_s"] / summary["serve_batch"]["requests_per_s"]
        summary["concurrency"] = E2E_CONCURRENCY
        return summary
    finally:
        serve.shutdown()
        ray.shutdown()


def plot(throughputs: dict[int, dict[str, EngineTiming]], utility: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = ["naive", "sorted", "concat", "slotted_concat", "oracle"]
    width = 0.8 / len(throughputs)
    for i, (variance, timings) in enumerate(throughputs.items()):
        axes[0].bar([x + i * width for x in range(len(names))], [timings[n].requests_per_s for n in names], width,
                    label=f"length variance {variance}")
    axes[0].set_xticks([x + width / 2 for x in range(len(names))], names, rotation=20)
    axes[0].set_ylabel("requests/s (FCFS, saturated)")
    axes[0].set_title("MiniLM engine throughput (CPU)")
    axes[0].legend()
    for name, values in utility["utility_per_s"].items():
        axes[1].plot(utility["rates_per_s"], values, marker="o", label=name)
    axes[1].set_xlabel("arrival rate (requests/s)")
    axes[1].set_ylabel("utility/s (sum of 1/length on time)")
    axes[1].set_title("Scheduler utility (simulated clock, measured latency)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


#: Long texts: words per text, uniform in [mean - spread, mean + spread].
LONG_WORDS_MEAN, LONG_WORDS_SPREAD = 100, 50
#: Padded baselines of the long-text part: sentence-transformers' default batch size.
LONG_PADDED_BATCH_SIZE = 32


def long_texts(count: int, tokenizer, rng: random.Random) -> list[str]:
    """Generated texts of 100 +- 50 words drawn from the tokenizer's whole-word vocabulary."""
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) >= 3)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(LONG_WORDS_MEAN - LONG_WORDS_SPREAD,
                                                                   LONG_WORDS_MEAN + LONG_WORDS_SPREAD)))
            for _ in range(count)]


@dataclass
class _Text:
    payload: list[int]


def replica_path(packed: PackedTextEncoder, token_ids: list[list[int]], limit_tokens: int) -> Callable[[], object]:
    """The text replica's path for all texts queued at once: DAS batches of its rows, packed, forward, pooled."""
    from placement.core.deployment_spec import ModelSpec
    from rayserve_apps.engine import FormedBatch
    from rayserve_apps.engine.text_batches import batching_scheduler_for, pack_text_batch

    spec = ModelSpec.model_validate({"name": "minilm", "kind": "text", "source": "package:all-minilm-l6-v2"})
    scheduler = batching_scheduler_for(spec, None, limit_tokens)

    def run() -> list:
        queue = [TextRequest(request_id=_Text(ids), length_tokens=len(ids), arrival_s=0.0, deadline_s=1e9)
                 for ids in token_ids]
        out = []
        while queue:
            decision = scheduler.form_batch(0.0, queue)
            queue = decision.remaining(queue)
            batch = FormedBatch(items=[r.request_id for r in decision.requests], plan=decision, refused=[])
            out.append(packed.embed_packed(pack_text_batch(batch, scheduler, packed.pad_token_id)).embeddings)
        return out

    return run


def long_text_throughput(count: int, repeats: int) -> dict:
    """Texts/s of the replica's packed path (per-text and whole-row attention) vs sorted and arrival-order padding."""
    segments = load_text_encoder(attn_implementation="sdpa_segments")
    dense = load_text_encoder(attn_implementation="sdpa")
    texts = long_texts(count, segments.tokenizer, random.Random(1))
    token_ids = segments.text_tokenizer.encode(texts, truncate_to=segments.max_length)
    runs = {
        "replica_packed": replica_path(PackedTextEncoder(segments), token_ids, segments.max_length),
        "replica_packed_row_mask": replica_path(PackedTextEncoder(dense), token_ids, dense.max_length),
        "sorted": lambda: SortedBatchingEngine(dense, LONG_PADDED_BATCH_SIZE).embed(token_ids),
        "padded": lambda: NaiveBatchingEngine(dense, LONG_PADDED_BATCH_SIZE).embed(token_ids),
    }
    for run in runs.values():  # warm-up
        run()
    seconds = time_engines({name: [run] for name, run in runs.items()}, repeats)
    texts_per_s = {name: count / s for name, s in seconds.items()}
    lengths = [len(ids) for ids in token_ids]
    return {"texts": count, "mean_tokens": statistics.mean(lengths), "max_tokens": max(lengths),
            "threads": torch.get_num_threads(), "texts_per_s": texts_per_s,
            "ratio_packed_vs_sorted": texts_per_s["replica_packed"] / texts_per_s["sorted"],
            "ratio_packed_vs_padded": texts_per_s["replica_packed"] / texts_per_s["padded"],
            "ratio_segments_vs_row_mask": texts_per_s["replica_packed"] / texts_per_s["replica_packed_row_mask"]}


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--requests", type=int, default=None, help="requests per engine run")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the engine part (1: no OpenMP spinning on a shared machine)")
    parser.add_argument("--skip-e2e", action="store_true", help="skip the Ray Serve end-to-end part")
    parser.add_argument("--long-texts", action="store_true",
                        help="only the long-text part (100 +- 50 words): replica path vs sorted vs padded")
    args = parser.parse_args()
    if args.long_texts:
        torch.set_num_threads(args.threads)
        figures = long_text_throughput(96 if args.quick else 384, 3 if args.quick else 5)
        log.info("long texts: %s", {k: round(v, 1) for k, v in figures["texts_per_s"].items()})
        emit_json({**figures, "quick": args.quick}, name="concat_batching_long_texts")
        return
    num_requests = args.requests or (128 if args.quick else 1024)
    repeats = 5 if args.quick else 9
    granularity = 2 * SLOT_GRANULARITY_TOKENS if args.quick else SLOT_GRANULARITY_TOKENS
    torch.set_num_threads(args.threads)
    encoder = load_text_encoder()
    tokenizer = encoder.tokenizer
    rng = random.Random(0)

    throughputs: dict[int, dict[str, EngineTiming]] = {}
    for variance in VARIANCES:
        lengths = clipped_normal_lengths(num_requests, variance, rng)
        token_ids = make_token_ids(lengths, tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.vocab_size, rng)
        log.info("engine throughput, variance %d: %d requests, %d tokens", variance, num_requests, sum(lengths))
        throughputs[variance] = engine_throughput(encoder, token_ids, repeats)
        log.info("variance %d: %s", variance, {k: f"{t.requests_per_s:.0f} req/s pad {t.padding_fraction:.2f}"
                                               for k, t in throughputs[variance].items()})
    diff = max_abs_diff(encoder, token_ids)
    log.info("max abs diff packed vs per request: %.2e", diff)

    latency = measure_latency_model(encoder, repeats, granularity)
    main_timings = throughputs[VARIANCES[0]]
    utility = utility_curves(latency, VARIANCES[0], granularity)
    past_saturation = [i for i, m in enumerate(RATE_MULTIPLES) if m > 1.0]
    das_wins = all(utility["utility_per_s"]["das"][i] > max(utility["utility_per_s"][n][i]
                                                            for n in ("fcfs", "sjf", "edf"))
                   for i in past_saturation)

    e2e = None
    if not args.skip_e2e:
        e2e_lengths = [min(n, E2E_ROW_LENGTH_TOKENS)
                       for n in clipped_normal_lengths(256 if args.quick else 1024, VARIANCES[0], rng)]
        e2e_ids = make_token_ids(e2e_lengths, tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.vocab_size, rng)
        e2e = run_e2e(args.quick, e2e_ids)

    path = out_dir() / "concat_batching.png"
    plot(throughputs, utility, path)
    figures = {
        "ratio_vs_naive": main_timings["concat"].requests_per_s / main_timings["naive"].requests_per_s,
        "ratio_vs_sorted": main_timings["concat"].requests_per_s / main_timings["sorted"].requests_per_s,
        "oracle_ratio": main_timings["concat"].seconds / main_timings["oracle"].seconds,
        "slotted_ratio_vs_concat": (main_timings["slotted_concat"].requests_per_s
                                    / main_timings["concat"].requests_per_s),
        "e2e_ratio_vs_serve_batch": None if e2e is None else e2e.get("ratio"),
        "e2e": e2e,
        "max_abs_diff": diff,
        "requests_per_s": {str(v): {k: t.requests_per_s for k, t in timings.items()}
                           for v, timings in throughputs.items()},
        "padding_fraction": {str(v): {k: t.padding_fraction for k, t in timings.items()}
                             for v, timings in throughputs.items()},
        "ratio_vs_naive_variance_100": (throughputs[VARIANCES[1]]["concat"].requests_per_s
                                        / throughputs[VARIANCES[1]]["naive"].requests_per_s),
        "ratio_vs_sorted_variance_100": (throughputs[VARIANCES[1]]["concat"].requests_per_s
                                         / throughputs[VARIANCES[1]]["sorted"].requests_per_s),
        "oracle_ratio_variance_100": (throughputs[VARIANCES[1]]["concat"].seconds
                                      / throughputs[VARIANCES[1]]["oracle"].seconds),
        "utility": utility,
        "das_beats_fcfs_sjf_edf_past_saturation": das_wins,
        "png": str(path),
        "quick": args.quick,
    }
    emit_json(figures)


if __name__ == "__main__":
    main()
