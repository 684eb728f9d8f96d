"""serve_e2e: plexserve's main path against what a user would run instead, end to end, on the texts users send.

Three sides, driven over HTTP by one asyncio load generator (aiohttp, keep-alive connections) in this process, on
the same CPUs, one side at a time:

* plexserve: `configs/local.yaml` exactly as `make serve` deploys it (Serve's fast ingress: HAProxy in front, HTTP
  served by the ingress replica; ingress, device groups, vision model, placement controller), requests
  `POST /v1/models/minilm/embed {"texts": [text]}`;
* plain: the Ray Serve app a user writes instead, run as users run it (Serve's defaults, its Python proxy in front):
  one deployment, sentence-transformers all-MiniLM-L6-v2 with `@serve.batch(max_batch_size=32)`, the replica owning
  the two CPUs, requests `POST /plain {"texts": [text]}`;
* infinity-emb: a dedicated embedding server (infinity-emb 0.0.78, `--engine torch --device cpu --batch-size 32`) on
  the same all-MiniLM-L6-v2 files, in a virtual environment of its own (`.venv-infinity`, made by the benchmark when
  missing; the side is skipped with a line saying why when it cannot be made), requests `POST /embeddings
  {"model": "minilm", "input": [text]}` (OpenAI's body).

Serve's HTTP path is switched when Ray starts, so plexserve and the plain app each run in a Ray of their own (a
child process per ingress mode); infinity-emb runs with no Ray up.

Text mixes (`--mixes`): `short` queries of N(20, 8) words, `long` passages of N(100, 50) words, `mixed` (each text
short or long with even odds). Per mix: closed loop at 1, 16 and 64 clients (each client sends its next request
when the last one is answered); then an open-loop overload (Poisson arrivals) on plexserve at 2x and 4x the peak it
sustained on that mix; `goodput` counts 200 answers within the model's SLO. Then a soak (`--soak-s`) on the mixed
texts at 70 % of plexserve's peak on them, with the resident memory of every plexserve replica and the p99 of the
first and last fifth of the soak. Every point reports the load generator's own CPU (share of one core), which shows
that it is not the bottleneck.

Figures per mix (under the mix's name): `ratio_vs_infinity_C` and `ratio_vs_plain_C` (plexserve's answers/s over
the other side's at C clients), `p50_ms_1_client_plexserve` / `_infinity`, `goodput_ratio_overload_4x`; and the soak's
`rss_growth` (the largest relative growth of one replica's resident memory) and `p99_growth`. `--merge` keeps the
mixes of the result file that this run did not measure (one mix per invocation keeps each run short).
`--median-of N` measures every side N times, in the reverse order on every other run, and reports each figure as the
median over the runs, with the values per run beside it (`per_run`).

    .venv/bin/python -m benchmarks.serve_e2e --quick --median-of 3
    .venv/bin/python -m benchmarks.serve_e2e --quick --mixes long --soak-s 0 --merge
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import yaml  # noqa: E402

from benchmarks._common import (  # noqa: E402
    cpu_seconds_by_role,
    emit_json,
    machine_description,
    make_parser,
    out_dir,
    setup_logging,
)

#: Client counts of the closed-loop runs.
CLIENT_COUNTS = (1, 16, 64)
#: Multiples of the measured peak for the open-loop overload runs.
OVERLOAD_FACTORS = (2.0, 4.0)
#: Text mixes: (mean, std) of the words per text of each kind a text is drawn from with even odds (at least one word).
MIXES = {"short": ((20.0, 8.0),), "long": ((100.0, 50.0),), "mixed": ((20.0, 8.0), (100.0, 50.0))}
#: Words per text at most: the texts' words are single tokens of MiniLM's vocabulary, and its limit is 256 tokens
#: (every side then embeds every text whole).
MAX_WORDS_PER_TEXT = 250
#: The mix the soak runs on.
SOAK_MIX = "mixed"
#: Soak: seconds (full run, --quick), the share of plexserve's peak it offers, and the share of its duration at each
#: end whose p99 is compared.
SOAK_S, QUICK_SOAK_S = 600.0, 60.0
SOAK_RATE_FRACTION = 0.7
SOAK_WINDOW_FRACTION = 0.2
#: Distinct texts the load generator cycles through.
NUM_TEXTS = 2000
#: Logical CPUs declared to the benchmark's Ray: both applications fit side by side (they share the 2 cores).
RAY_NUM_CPUS = 6
#: The plain app's replica reserves the machine's cores (its torch uses as many threads).
PLAIN_NUM_CPUS = 2
#: The plain app's `@serve.batch` settings.
PLAIN_MAX_BATCH_SIZE = 32
PLAIN_BATCH_WAIT_S = 0.01
#: Seconds a client waits for one answer before counting it as a timeout.
REQUEST_TIMEOUT_S = 30.0
#: Open-loop requests allowed in flight at once; arrivals past it count as client-side drops.
MAX_OPEN_LOOP_IN_FLIGHT = 2048
#: (warm-up, measured) seconds per point.
QUICK_DURATIONS_S = (1.0, 8.0)
FULL_DURATIONS_S = (4.0, 25.0)
#: Characters of a plain-text error body kept as its error type.
UNPARSED_PREFIX_CHARS = 40
#: Batch sizes tried for the in-process compute bound.
COMPUTE_BOUND_BATCH_SIZES = (8, 16, 32, 64)
#: Texts of the in-process compute bound's sample (the first of the mix's texts, drawn in random order).
COMPUTE_BOUND_TEXTS = 64

PLEXSERVE_CONFIG = REPO / "configs" / "local.yaml"
#: How Serve's HTTP path runs, each in a Ray of its own (the switches are read when Ray's processes start).
INGRESS_MODES = {"serve_proxy": "Serve's defaults: its Python HTTP proxy in front of every application",
                 "fast_ingress": "plexserve's serving mode (make serve): Serve's HAProxy ingress, "
                                 "rayserve_apps/fast_ingress.py"}
#: plexserve as shipped, and the plain app as a user writes and runs it (the issue's bar).
PLEXSERVE_INGRESS = "fast_ingress"
BASELINE_INGRESS = "serve_proxy"
PLEXSERVE_MODEL = "minilm"
#: The sides measured, and the ingress mode each runs behind (infinity-emb: its own server, no Ray).
SIDES = {"plexserve": PLEXSERVE_INGRESS, "plain": BASELINE_INGRESS, "infinity": None}

#: infinity-emb's virtual environment (git-ignored), what goes in it, and how its server runs. The torch and
#: torchvision pins are the project's (pyproject.toml): those releases lie on the machine's disk.
INFINITY_VENV = REPO / ".venv-infinity"
INFINITY_REQUIREMENTS = ("infinity-emb[server,torch]==0.0.78", "torch==2.14.1", "torchvision==0.29.1")
INFINITY_ARGS = ("--engine", "torch", "--device", "cpu", "--batch-size", "32")
INFINITY_MODEL_NAME = "minilm"
#: Seconds allowed to make the environment, and for the server to answer its first request.
INFINITY_INSTALL_TIMEOUT_S = 1800.0
INFINITY_START_TIMEOUT_S = 180.0

log = setup_logging("serve_e2e")


def word_counts(count: int, mix: str, seed: int = 0) -> list[int]:
    """Words per text of `count` texts of `mix` (a key of MIXES): each text's kind drawn with even odds, its words
    from that kind's N(mean, std), at least one. Raises ValueError naming the mix when it is unknown."""
    if mix not in MIXES:
        raise ValueError(f"unknown text mix {mix!r}; known: {', '.join(MIXES)}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    rng = random.Random(seed)
    kinds = MIXES[mix]
    return [min(MAX_WORDS_PER_TEXT, max(1, round(rng.gauss(*kinds[rng.randrange(len(kinds))]))))
            for _ in range(count)]


def make_texts(count: int, mix: str = "short", seed: int = 0, vocab: list[str] | None = None) -> list[str]:
    """`count` texts of `mix`, words drawn from the tokenizer's whole-word vocabulary (or `vocab`)."""
    if vocab is None:
        from models.text_encoder import load_text_tokenizer

        vocab = sorted(w for w in load_text_tokenizer().tokenizer.get_vocab()
                       if w.isalpha() and w.isascii() and len(w) > 2)
    rng = random.Random(seed + 1)
    return [" ".join(rng.choice(vocab) for _ in range(words)) for words in word_counts(count, mix, seed)]


# ---- the plain Ray Serve app (what a user would write instead) ----

#: The share of a GPU the plain app reserves with `--device cuda` (it runs beside plexserve's replicas).
PLAIN_GPU_SHARE = 0.1
#: With `--device cuda`, the share of a GPU each of plexserve's single-model replicas reserves where the config
#: names none (`device_share_per_replica`): the config's three models, the ingress (with minilm's engine, `in_ingress`)
#: and the plain app fit on one GPU.
PLEXSERVE_GPU_SHARE = 0.2
DEVICES = ("cpu", "cuda")


def plain_app(device: str = "cpu"):
    from ray import serve
    from starlette.requests import Request

    from models.text_encoder import resolve_text_source

    path = str(resolve_text_source("package:all-minilm-l6-v2"))

    options = {"num_cpus": PLAIN_NUM_CPUS, **({"num_gpus": PLAIN_GPU_SHARE} if device == "cuda" else {})}

    @serve.deployment(max_ongoing_requests=2 * PLAIN_MAX_BATCH_SIZE, ray_actor_options=options)
    class PlainMiniLM:
        def __init__(self):
            from sentence_transformers import SentenceTransformer

            self.model = SentenceTransformer(path, device=device)

        @serve.batch(max_batch_size=PLAIN_MAX_BATCH_SIZE, batch_wait_timeout_s=PLAIN_BATCH_WAIT_S)
        async def embed(self, texts: list[str]) -> list[list[float]]:
            return self.model.encode(texts, normalize_embeddings=True).tolist()

        async def __call__(self, request: Request) -> dict:
            texts = (await request.json())["texts"]
            return {"embeddings": await asyncio.gather(*(self.embed(text) for text in texts))}

    return PlainMiniLM.bind()


# ---- the load generator ----

@dataclass
class Point:
    """One measured load point of one system."""

    system: str
    mode: str  # closed | open
    load: float  # clients, or offered requests/s
    duration_s: float
    latencies_ms: list[float] = field(default_factory=list)  # of 200 answers
    sent_at_s: list[float] = field(default_factory=list)  # of 200 answers, seconds after the point's start
    statuses: dict[int, int] = field(default_factory=dict)
    error_types: dict[str, int] = field(default_factory=dict)  # error.type of non-200 JSON answers
    errors: int = 0  # timeouts and connection errors
    dropped: int = 0  # open loop: arrivals past MAX_OPEN_LOOP_IN_FLIGHT
    slo_ms: float = 1000.0
    mix: str = "short"
    load_generator_cpu_s: float = 0.0  # CPU seconds of this process over the point (warm-up included)
    wall_s: float = 0.0  # its wall-clock seconds

    def summary(self) -> dict:
        ok = self.statuses.get(200, 0)
        lat = np.asarray(self.latencies_ms) if self.latencies_ms else np.asarray([np.nan])
        good = int((lat <= self.slo_ms).sum()) if self.latencies_ms else 0
        return {"system": self.system, "mode": self.mode, "load": self.load, "mix": self.mix,
                "ok_per_s": ok / self.duration_s,
                "goodput_per_s": good / self.duration_s, "p50_ms": float(np.percentile(lat, 50)),
                "p99_ms": float(np.percentile(lat, 99)),
                "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "error_types": dict(self.error_types),
                "errors": self.errors, "dropped": self.dropped,
                "load_generator_cpu_share": self.load_generator_cpu_s / max(self.wall_s, 1e-9)}


def percentile_of_window(point: Point, start_s: float, end_s: float, q: float = 99.0) -> float:
    """The `q`th percentile latency (ms) of the 200 answers to requests sent between `start_s` and `end_s` seconds
    after the point's start; NaN when there are none."""
    window = [lat for lat, at in zip(point.latencies_ms, point.sent_at_s) if start_s <= at < end_s]
    return float(np.percentile(window, q)) if window else float("nan")


#: Request bodies of one text per side: plexserve's and the plain app's `{"texts": [...]}`, OpenAI's for infinity.
BODY_FORMATS = ("texts", "openai")


def request_body(text: str, body_format: str = "texts") -> bytes:
    """One request's JSON body for `text` in `body_format` (one of BODY_FORMATS)."""
    import json

    if body_format == "texts":
        return json.dumps({"texts": [text]}).encode()
    if body_format == "openai":
        return json.dumps({"model": INFINITY_MODEL_NAME, "input": [text]}).encode()
    raise ValueError(f"unknown body format {body_format!r}; known: {', '.join(BODY_FORMATS)}")


class LoadGenerator:
    def __init__(self, texts: list[str], body_format: str = "texts"):
        import aiohttp

        self.aiohttp = aiohttp
        self.bodies = [request_body(t, body_format) for t in texts]
        self.next = 0

    def _body(self) -> bytes:
        self.next = (self.next + 1) % len(self.bodies)
        return self.bodies[self.next]

    async def _send(self, session, url: str, point: Point, record: bool, origin: float = 0.0) -> None:
        started = time.perf_counter()
        try:
            async with session.post(url, data=self._body(), headers={"content-type": "application/json"}) as response:
                body = await response.read()
                status = response.status
        except (asyncio.TimeoutError, self.aiohttp.ClientError):
            if record:
                point.errors += 1
            return
        if record:
            point.statuses[status] = point.statuses.get(status, 0) + 1
            if status == 200:
                point.latencies_ms.append((time.perf_counter() - started) * 1000.0)
                point.sent_at_s.append(started - origin)
            else:
                kind = _error_type(body)
                point.error_types[kind] = point.error_types.get(kind, 0) + 1

    def _session(self):
        connector = self.aiohttp.TCPConnector(limit=0, force_close=False)
        return self.aiohttp.ClientSession(connector=connector,
                                          timeout=self.aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))

    async def closed_loop(self, url: str, point: Point, clients: int, warmup_s: float) -> Point:
        cpu_start = time.process_time()
        async with self._session() as session:
            start = time.perf_counter()
            measure_from, stop_at = start + warmup_s, start + warmup_s + point.duration_s

            async def client() -> None:
                while True:
                    now = time.perf_counter()
                    if now >= stop_at:
                        return
                    await self._send(session, url, point, record=now >= measure_from, origin=measure_from)

            await asyncio.gather(*(client() for _ in range(clients)))
        point.load_generator_cpu_s, point.wall_s = time.process_time() - cpu_start, time.perf_counter() - start
        return point

    async def open_loop(self, url: str, point: Point, rate_per_s: float, seed: int) -> Point:
        rng = random.Random(seed)
        cpu_start = time.process_time()
        async with self._session() as session:
            tasks: set[asyncio.Task] = set()
            start = time.perf_counter()
            next_at = start
            while next_at < start + point.duration_s:
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if len(tasks) >= MAX_OPEN_LOOP_IN_FLIGHT:
                    point.dropped += 1
                else:
                    task = asyncio.ensure_future(self._send(session, url, point, record=True, origin=start))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                next_at += rng.expovariate(rate_per_s)
            if tasks:
                await asyncio.wait(tasks)
        point.load_generator_cpu_s, point.wall_s = time.process_time() - cpu_start, time.perf_counter() - start
        return point


#: Processes whose CPU time the overload runs attribute, by a fragment of their command line (Ray's process titles);
#: the first matching role counts, so the ingress before plexserve's other replicas.
CPU_ROLES = {"haproxy": ("bin/haproxy",), "proxy": ("ProxyActor",), "ingress": ("plexserve:Ingress",),
             "replicas": ("ServeReplica:plexserve:",), "stage_actors": ("StageShard",)}


def _error_type(body: bytes) -> str:
    import json

    try:
        return str(json.loads(body)["error"]["type"])
    except (ValueError, KeyError, TypeError):  # not plexserve's JSON error: Serve's or HAProxy's plain-text answer
        return "text: " + body[:UNPARSED_PREFIX_CHARS].decode(errors="replace").strip()


def free_port() -> int:
    """A free loopback port that is none of Ray's default ports."""
    from rayserve_apps.control.live_update import free_port as free_loopback_port

    return free_loopback_port("127.0.0.1")


# ---- in-process compute bound ----

def _texts_per_s_in_whole_passes(chunks: list[list], run, seconds: float) -> float:
    """Texts/s of `run` over every chunk in turn, in whole passes until `seconds` have passed (one pass at least),
    so that every length of the sample counts as often as it occurs."""
    done, start = 0, time.perf_counter()
    while done == 0 or time.perf_counter() - start < seconds:
        for chunk in chunks:
            run(chunk)
            done += len(chunk)
    return done / (time.perf_counter() - start)


def compute_bound(texts: list[str], seconds: float, device: str = "cpu") -> dict:
    """Texts/s of MiniLM in this process on `COMPUTE_BOUND_TEXTS` of the same texts, on `device`: the best of
    length-sorted padded batches and ConcatBatching packs at each batch size, with as many torch threads as the
    machine has cores, each batch's embeddings brought back to the CPU as a replica answers them. Each figure runs
    whole passes over the sample (`_texts_per_s_in_whole_passes`): a window that ends within a pass over sorted
    batches would count only the shortest texts."""
    import torch

    from models.packed_text import ConcatBatchingEngine
    from models.text_encoder import load_text_encoder

    torch.set_num_threads(os.cpu_count() or 1)
    encoder = load_text_encoder()
    encoder.model.to(device)
    token_ids = encoder.text_tokenizer.encode(texts[:COMPUTE_BOUND_TEXTS])
    longest = max(len(ids) for ids in token_ids)
    ordered = sorted(token_ids, key=len)
    results = {}
    for batch in COMPUTE_BOUND_BATCH_SIZES:
        results[f"sorted_padded_{batch}"] = _texts_per_s_in_whole_passes(
            [ordered[i:i + batch] for i in range(0, len(ordered), batch)],
            lambda chunk: encoder.embed_token_ids(chunk).cpu(), seconds)
    for batch in COMPUTE_BOUND_BATCH_SIZES:
        engine = ConcatBatchingEngine(encoder, row_length_tokens=max(longest, 64), num_rows=max(1, batch // 4))
        results[f"packed_{batch}"] = _texts_per_s_in_whole_passes(
            [token_ids[i:i + batch] for i in range(0, len(token_ids), batch)], engine.embed, seconds)
    best = max(results, key=results.get)
    log.info("in-process compute bound: %s", {k: round(v, 1) for k, v in results.items()})
    return {"best": best, "texts_per_s": results[best], "all": results}


# ---- the run ----

def plexserve_args(path: Path = PLEXSERVE_CONFIG, device: str = "cpu") -> dict:
    """The application args of a Serve config; with `device` 'cuda' its cluster's devices are this machine's GPUs
    (device resource 'GPU', one device per GPU, each GPU's memory), every model's single-model replicas reserve a
    GPU share (`PLEXSERVE_GPU_SHARE` where the config names none), and a placement group over more devices than
    there are GPUs is left out (its models then get replicas of their own)."""
    config = yaml.safe_load(path.read_text())
    (application,) = config["applications"]
    spec = application["args"]
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no GPU on this machine")
        gpus = torch.cuda.device_count()
        spec["cluster"].update(device_resource="GPU", num_devices=gpus,
                               device_memory_bytes=torch.cuda.get_device_properties(0).total_memory)
        for model in spec["models"]:
            if model.get("device_share_per_replica") is None:
                model["device_share_per_replica"] = PLEXSERVE_GPU_SHARE
        placement = spec.get("placement") or {}
        if placement.get("groups"):
            kept = [group for group in placement["groups"] if group["num_devices"] <= gpus]
            if len(kept) < len(placement["groups"]):
                log.info("--device cuda: %d placement group(s) over more than %d GPU(s) left out",
                         len(placement["groups"]) - len(kept), gpus)
            placement["groups"] = kept
    return spec


def plot(points: list[dict], path: Path) -> None:
    """Answers/s and p99 against closed-loop clients, one line per side, one pair of panels per mix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixes = [mix for mix in MIXES if any(p["mix"] == mix and p["mode"] == "closed" for p in points)]
    if not mixes:
        return
    fig, axes = plt.subplots(len(mixes), 2, figsize=(10, 3.6 * len(mixes)), squeeze=False)
    styles = {"plexserve": "o-", "plain": "s--", "infinity": "^-."}
    for (ax_tp, ax_p99), mix in zip(axes, mixes):
        for side, style in styles.items():
            rows = [p for p in points if p["system"] == side and p["mode"] == "closed" and p["mix"] == mix]
            if not rows:
                continue
            clients = sorted({p["load"] for p in rows})  # the median over runs at each client count
            ax_tp.plot(clients, [float(np.median([p["ok_per_s"] for p in rows if p["load"] == count]))
                                 for count in clients], style, label=side)
            ax_p99.plot(clients, [float(np.median([p["p99_ms"] for p in rows if p["load"] == count]))
                                  for count in clients], style, label=side)
        for ax, label in ((ax_tp, "answers/s (200)"), (ax_p99, "p99 of 200 answers (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel(f"closed-loop clients, {mix} texts")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend()
    fig.suptitle("MiniLM over HTTP: plexserve (make serve) vs plain Ray Serve @serve.batch vs infinity-emb")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def replica_rss_mb(app: str = "plexserve") -> dict[str, float]:
    """Resident memory (MB) of every Serve replica of `app` on this machine, by its process title and pid (/proc)."""
    from parallel.profiler import PROC_ROOT

    found = {}
    fragment = f"ServeReplica:{app}:".encode()
    for entry in PROC_ROOT.glob("[0-9]*"):
        try:
            command = (entry / "cmdline").read_bytes()
            if fragment not in command:
                continue
            status = (entry / "status").read_text()
        except OSError:
            continue
        rss_kb = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), None)
        if rss_kb is not None:
            title = command.split(b"\0")[0].decode(errors="replace").strip()
            found[f"{title} [{entry.name}]"] = rss_kb / 1024.0
    return found


def soak_figures(rss_start_mb: dict[str, float], rss_end_mb: dict[str, float], p99_start_ms: float,
                 p99_end_ms: float) -> dict:
    """The soak's growth figures: `rss_growth`, the largest relative growth of one replica's resident memory between
    start and end (replicas present at both), and `p99_growth`, the relative change of the p99 latency."""
    common = sorted(set(rss_start_mb) & set(rss_end_mb))
    growths = {name: rss_end_mb[name] / rss_start_mb[name] - 1.0 for name in common if rss_start_mb[name] > 0}
    return {"rss_growth": max(growths.values()) if growths else float("nan"),
            "rss_growth_by_replica": growths,
            "p99_growth": p99_end_ms / p99_start_ms - 1.0 if p99_start_ms > 0 else float("nan"),
            "p99_ms_start": p99_start_ms, "p99_ms_end": p99_end_ms,
            "rss_mb_start": rss_start_mb, "rss_mb_end": rss_end_mb}


def run_soak(loop, url: str, peak_per_s: float, soak_s: float, slo_ms: float) -> dict:
    """Open loop on the soak mix's texts at SOAK_RATE_FRACTION of `peak_per_s` for `soak_s`; every plexserve
    replica's resident memory before and after, the p99 of the first and last SOAK_WINDOW_FRACTION of the run."""
    generator = LoadGenerator(make_texts(NUM_TEXTS, SOAK_MIX, seed=7))
    rate = SOAK_RATE_FRACTION * peak_per_s
    rss_start = replica_rss_mb()
    point = loop.run_until_complete(generator.open_loop(
        url, Point("plexserve", "soak", rate, soak_s, slo_ms=slo_ms, mix=SOAK_MIX), rate, seed=70))
    rss_end = replica_rss_mb()
    window = SOAK_WINDOW_FRACTION * soak_s
    figures = soak_figures(rss_start, rss_end, percentile_of_window(point, 0.0, window),
                           percentile_of_window(point, soak_s - window, soak_s))
    return {**point.summary(), **figures, "rate_fraction_of_peak": SOAK_RATE_FRACTION}


def session_systems(ingress: str, args) -> list[str]:
    """The sides measured behind `ingress` in this run (each side runs behind one ingress mode, SIDES)."""
    skipped = {"plain": args.skip_plain, "plexserve": False}
    return [side for side, mode in SIDES.items() if mode == ingress and not skipped.get(side, True)]


def run_session(ingress: str, args, out: Path) -> None:
    """One Ray with one ingress mode (its switches are in this process's environment, set by `main`) and the sides
    that run behind it: per mix, the closed loop; for plexserve, the open-loop overload per mix and the soak. Writes
    the points as JSON to `out`."""
    import json

    import ray
    from ray import serve

    from rayserve_apps.app import build_app

    warmup_s, duration_s = QUICK_DURATIONS_S if args.quick else FULL_DURATIONS_S
    systems = session_systems(ingress, args)
    spec = plexserve_args(args.config, args.device)
    slo_ms = next(m["slo_ms"] for m in spec["models"] if m["name"] == PLEXSERVE_MODEL)
    ray.init(address="local", num_cpus=RAY_NUM_CPUS, include_dashboard=False, log_to_driver=False,
             **({"num_gpus": spec["cluster"]["num_devices"]} if args.device == "cuda" else {}))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    urls = {"plexserve": f"{base}/v1/models/{PLEXSERVE_MODEL}/embed", "plain": f"{base}/plain"}
    points: list[dict] = []
    try:
        if "plexserve" in systems:
            log.info("[%s] deploying plexserve (%s)", ingress, args.config.name)
            serve.run(build_app(spec), name="plexserve", route_prefix="/")
        if "plain" in systems:
            log.info("[%s] deploying the plain app", ingress)
            serve.run(plain_app(args.device), name="plain", route_prefix="/plain")
        loop = asyncio.new_event_loop()
        for mix in args.mixes:
            generator = LoadGenerator(make_texts(NUM_TEXTS, mix))
            for system in systems:  # one warm-up request each: first calls load lazily initialised parts
                loop.run_until_complete(generator.closed_loop(urls[system], Point(system, "closed", 1, 1.0), 1, 0.0))
            for index, clients in enumerate(args.clients):
                for system in systems if index % 2 == 0 else systems[::-1]:
                    point = loop.run_until_complete(generator.closed_loop(
                        urls[system], Point(system, "closed", clients, duration_s, slo_ms=slo_ms, mix=mix), clients,
                        warmup_s))
                    points.append({**point.summary(), "ingress": ingress})
                    log.info("[%s] %s %-9s %3d clients: %s", ingress, mix, system, clients, _brief(points[-1]))
            if "plexserve" in systems and not args.skip_overload:
                peak = max(p["goodput_per_s"] for p in points if p["system"] == "plexserve" and p["mix"] == mix)
                for factor in OVERLOAD_FACTORS:
                    cpu_before = cpu_seconds_by_role(CPU_ROLES)
                    point = loop.run_until_complete(generator.open_loop(
                        urls["plexserve"], Point("plexserve", "open", factor * peak, duration_s, slo_ms=slo_ms,
                                                 mix=mix), factor * peak, seed=int(factor * 10)))
                    cpu_s = {role: round(s - cpu_before[role], 2)
                             for role, s in cpu_seconds_by_role(CPU_ROLES).items() if role in cpu_before}
                    points.append({**point.summary(), "ingress": ingress, "factor": factor, "peak_per_s": peak,
                                   "cpu_s_by_process": cpu_s})
                    log.info("[%s] %s plexserve open loop at %.1fx peak (%.0f/s): %s; CPU s by process %s", ingress,
                             mix, factor, factor * peak, _brief(points[-1]), cpu_s)
        if "plexserve" in systems and args.soak_s > 0:
            soak_peak = [p["goodput_per_s"] for p in points
                         if p["system"] == "plexserve" and p["mode"] == "closed" and p["mix"] == SOAK_MIX]
            if not soak_peak:  # the soak's mix was not measured in this run: its peak at the most clients
                point = loop.run_until_complete(LoadGenerator(make_texts(NUM_TEXTS, SOAK_MIX)).closed_loop(
                    urls["plexserve"], Point("plexserve", "closed", max(args.clients), duration_s, slo_ms=slo_ms,
                                             mix=SOAK_MIX), max(args.clients), warmup_s))
                soak_peak = [point.summary()["goodput_per_s"]]
            log.info("[%s] soak: %s texts at %.0f%% of %.1f/s for %.0f s", ingress, SOAK_MIX,
                     100 * SOAK_RATE_FRACTION, max(soak_peak), args.soak_s)
            soak = run_soak(loop, urls["plexserve"], max(soak_peak), args.soak_s, slo_ms)
            points.append({**soak, "ingress": ingress})
            log.info("[%s] soak: %s; rss_growth %.3f p99 %.0f -> %.0f ms", ingress, _brief(soak),
                     soak["rss_growth"], soak["p99_ms_start"], soak["p99_ms_end"])
        loop.close()
    finally:
        serve.shutdown()
        ray.shutdown()
    out.write_text(json.dumps(points))


def session_env(ingress: str) -> dict[str, str]:
    """The environment of a session's process: Serve's defaults, or plexserve's fast ingress as `make serve` runs it
    (HAProxy capped at the config's ingress turns; free ports for HAProxy's stats and metrics so that the run can go
    on beside `make serve`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    if ingress == "fast_ingress":
        from rayserve_apps.fast_ingress import ingress_queue_timeout_ms, ingress_turns, local_env

        env.update(local_env(stats_port=free_port(), metrics_port=free_port(),
                             server_maxconn=ingress_turns(PLEXSERVE_CONFIG),
                             queue_timeout_ms=ingress_queue_timeout_ms(PLEXSERVE_CONFIG)))
    return env


def session_argv(args: argparse.Namespace, ingress: str, out: Path) -> list[str]:
    """The command line of one session's child process: this run's options, its ingress mode and its output."""
    argv = ["--clients", *map(str, args.clients), "--config", str(args.config), "--session", ingress,
            "--session-out", str(out), "--device", args.device, "--mixes", *args.mixes, "--soak-s", str(args.soak_s)]
    flags = {"--quick": args.quick, "--skip-plain": args.skip_plain, "--skip-overload": args.skip_overload}
    return argv + [flag for flag, on in flags.items() if on]


# ---- infinity-emb ----

def infinity_python(venv: Path = INFINITY_VENV) -> Path:
    return venv / "bin" / "python"


def ensure_infinity_venv(venv: Path = INFINITY_VENV) -> tuple[Path | None, str]:
    """infinity-emb's environment: `venv` when it imports infinity_emb, else made there (`python -m venv`, then pip
    with INFINITY_REQUIREMENTS). Returns (its infinity_emb command, "") or (None, why it cannot be made)."""
    import subprocess

    command = venv / "bin" / "infinity_emb"

    def works() -> bool:
        return command.exists() and subprocess.run([str(infinity_python(venv)), "-c", "import infinity_emb"],
                                                   capture_output=True, timeout=300).returncode == 0

    if works():
        return command, ""
    log.info("making infinity-emb's environment %s (%s)", venv, " ".join(INFINITY_REQUIREMENTS))
    try:
        if not infinity_python(venv).exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
        done = subprocess.run([str(infinity_python(venv)), "-m", "pip", "install", *INFINITY_REQUIREMENTS],
                              capture_output=True, text=True, timeout=INFINITY_INSTALL_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"{type(error).__name__}: {error}"
    if done.returncode != 0:
        return None, "pip install failed: " + (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    return (command, "") if works() else (None, "infinity_emb does not import after the install")


def infinity_command(binary: Path, model_dir: Path, port: int) -> list[str]:
    """The infinity-emb server on MiniLM's files, as the comparison runs it (INFINITY_ARGS)."""
    return [str(binary), "v2", "--model-id", str(model_dir), "--served-model-name", INFINITY_MODEL_NAME,
            *INFINITY_ARGS, "--host", "127.0.0.1", "--port", str(port)]


def run_infinity(binary: Path, args, log_path: Path) -> list[dict]:
    """infinity-emb's closed-loop points per mix (no Ray running), its server started and stopped here."""
    import signal
    import subprocess
    import urllib.request

    from models.text_encoder import resolve_text_source

    warmup_s, duration_s = QUICK_DURATIONS_S if args.quick else FULL_DURATIONS_S
    port = free_port()
    env = {**os.environ, "INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1"}
    url = f"http://127.0.0.1:{port}/embeddings"
    points: list[dict] = []
    with open(log_path, "wb") as server_log:
        server = subprocess.Popen(infinity_command(binary, resolve_text_source("package:all-minilm-l6-v2"), port),
                                  env=env, stdout=server_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + INFINITY_START_TIMEOUT_S
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"infinity-emb exited with {server.returncode}; its log: {log_path}")
            try:
                request = urllib.request.Request(url, data=request_body("warm up", "openai"),
                                                 headers={"content-type": "application/json"})
                with urllib.request.urlopen(request, timeout=10) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"infinity-emb did not answer in {INFINITY_START_TIMEOUT_S:.0f} s; log {log_path}")
            time.sleep(1.0)
        loop = asyncio.new_event_loop()
        for mix in args.mixes:
            generator = LoadGenerator(make_texts(NUM_TEXTS, mix), body_format="openai")
            for clients in args.clients:
                point = loop.run_until_complete(generator.closed_loop(
                    url, Point("infinity", "closed", clients, duration_s, mix=mix), clients, warmup_s))
                points.append({**point.summary(), "ingress": "infinity-emb"})
                log.info("[infinity-emb] %s %3d clients: %s", mix, clients, _brief(points[-1]))
        loop.close()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    return points


# ---- figures ----

def closed_point(points: list[dict], system: str, mix: str, clients: int) -> dict | None:
    return next((p for p in points if p["system"] == system and p["mode"] == "closed" and p["mix"] == mix
                 and p["load"] == clients), None)


def mix_figures(points: list[dict], mix: str, clients: list[int]) -> dict:
    """The figures of one mix from its points: answers/s and p50/p99 per side and client count, plexserve's ratios
    over the plain app and infinity-emb, its overload goodput over its peak on the mix, the load generator's CPU."""
    figures: dict = {}
    for count in clients:
        plex = closed_point(points, "plexserve", mix, count)
        for side in SIDES:
            point = closed_point(points, side, mix, count)
            if point is None:
                continue
            figures[f"ok_per_s_{side}_{count}"] = point["ok_per_s"]
            figures[f"p50_ms_{side}_{count}"] = point["p50_ms"]
            figures[f"p99_ms_{side}_{count}"] = point["p99_ms"]
            if side != "plexserve" and plex is not None:
                figures[f"ratio_vs_{side}_{count}"] = plex["ok_per_s"] / max(point["ok_per_s"], 1e-9)
    for side in SIDES:
        one = closed_point(points, side, mix, 1)
        if one is not None:
            figures[f"p50_ms_1_client_{side}"] = one["p50_ms"]
    peak = max((p["goodput_per_s"] for p in points
                if p["system"] == "plexserve" and p["mode"] == "closed" and p["mix"] == mix), default=0.0)
    figures["peak_goodput_plexserve"] = peak
    for p in points:
        if p["mode"] == "open" and p["mix"] == mix:
            figures[f"goodput_ratio_overload_{p['factor']:g}x"] = p["goodput_per_s"] / max(peak, 1e-9)
    shares = [p["load_generator_cpu_share"] for p in points if p["mix"] == mix and "load_generator_cpu_share" in p]
    if shares:
        figures["load_generator_cpu_share_max"] = max(shares)
    return figures


SOAK_KEYS = ("rss_growth", "p99_growth", "p99_ms_start", "p99_ms_end", "rss_mb_start", "rss_mb_end", "load",
             "rate_fraction_of_peak", "duration_s")


def run_figures(points: list[dict], mixes: list[str], clients: list[int], bounds: dict[str, dict]) -> dict:
    """The run's figures: per mix (under the mix's name), the soak's, and the error counts over every point."""
    figures: dict = {}
    for mix in mixes:
        figures[mix] = mix_figures(points, mix, clients)
        if mix in bounds:
            figures[mix]["compute_bound_texts_per_s"] = bounds[mix]["texts_per_s"]
            plex = closed_point(points, "plexserve", mix, max(clients))
            if plex is not None:
                bound = bounds[mix]["texts_per_s"]
                figures[mix][f"fraction_of_compute_bound_{max(clients)}"] = plex["ok_per_s"] / bound
    soak = next((p for p in points if p["mode"] == "soak"), None)
    if soak is not None:
        figures["soak"] = {key: soak[key] for key in SOAK_KEYS if key in soak}
        figures["rss_growth"], figures["p99_growth"] = soak["rss_growth"], soak["p99_growth"]
    figures.update(error_counts(points))
    return figures


def error_counts(points: list[dict]) -> dict[str, int]:
    """5xx answers other than 503 (a refusal), and client-side timeouts and connection errors, over `points`."""
    return {"errors_5xx_not_503": sum(count for p in points for status, count in p["statuses"].items()
                                      if int(status) >= 500 and int(status) != 503),
            "client_errors_and_timeouts": sum(p["errors"] for p in points)}


def merge_figures(previous: dict, current: dict, measured_mixes: list[str]) -> dict:
    """`current` with what `previous` (an earlier result's figures) holds and this run did not measure: the mixes
    outside `measured_mixes` (their figures and points), the soak when this run had none, and, in a mix this run
    measured in part (some sides, or no overload), the earlier figures it did not produce and the points of the
    sides it did not run. Those kept figures are listed under the mix's `kept_figures` by the command that
    measured them ({command: [keys]}): a ratio among them compares the sides of that earlier run, not this run's
    plexserve."""
    merged = dict(current)
    for mix in MIXES:
        if mix not in measured_mixes and mix in previous:
            merged[mix] = previous[mix]
        elif mix in measured_mixes and mix in previous and mix in current:
            earlier = previous[mix]
            kept = {key: value for key, value in earlier.items()
                    if key not in current[mix] and key not in ("command", "kept_figures")}
            if kept:
                whence = {key: command for command, keys in (earlier.get("kept_figures") or {}).items()
                          for key in keys}
                sources: dict[str, list[str]] = {}
                for key in sorted(kept):
                    sources.setdefault(whence.get(key, earlier.get("command", "unknown")), []).append(key)
                merged[mix] = {**kept, **current[mix], "kept_figures": sources}
    measured = {(p.get("mix"), p.get("system"), p.get("mode")) for p in current.get("points", [])}
    kept_points = [p for p in previous.get("points", []) if p.get("mode") != "soak"
                   and (p.get("mix") not in measured_mixes or (p.get("mix"), p.get("system"), p.get("mode"))
                        not in measured)]
    if "soak" not in current and "soak" in previous:
        merged["soak"] = previous["soak"]
        merged["rss_growth"], merged["p99_growth"] = previous.get("rss_growth"), previous.get("p99_growth")
        kept_points += [p for p in previous.get("points", []) if p.get("mode") == "soak"]
    if previous.get("infinity_emb") == "measured" and current.get("infinity_emb", "measured") != "measured" \
            and any("kept_figures" in merged.get(mix, {}) for mix in measured_mixes):
        merged["infinity_emb"] = f"{current['infinity_emb']} in this run; earlier figures kept (kept_figures)"
    merged["points"] = kept_points + current.get("points", [])
    merged.update(error_counts(merged["points"]))
    merged["mixes"] = [mix for mix in MIXES if mix in merged]
    return merged


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's options; a bad value is an argparse error naming the option."""
    parser = make_parser(__doc__)
    parser.add_argument("--clients", type=int, nargs="+", default=list(CLIENT_COUNTS), help="closed-loop client counts")
    parser.add_argument("--mixes", choices=MIXES, nargs="+", default=list(MIXES), help="text mixes to measure")
    parser.add_argument("--soak-s", type=float, default=None,
                        help=f"seconds of the soak on the {SOAK_MIX} texts (default {SOAK_S:g}, {QUICK_SOAK_S:g} with "
                             "--quick; 0: no soak)")
    parser.add_argument("--skip-plain", action="store_true", help="no plain Ray Serve app")
    parser.add_argument("--skip-infinity", action="store_true", help="no infinity-emb")
    parser.add_argument("--merge", action="store_true",
                        help="keep the mixes (and soak) of benchmarks/results/serve_e2e.json this run does not measure")
    parser.add_argument("--config", type=Path, default=PLEXSERVE_CONFIG, help="plexserve Serve config to deploy")
    parser.add_argument("--skip-overload", action="store_true", help="no open-loop overload runs")
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="where the models compute: cpu (the config as written) or cuda (the config's cluster "
                             "becomes this machine's GPUs, the plain app runs on one too)")
    parser.add_argument("--ingress", choices=INGRESS_MODES, nargs="+", default=list(INGRESS_MODES),
                        help="ingress modes to run (fast_ingress: plexserve; serve_proxy: the plain app)")
    parser.add_argument("--median-of", type=int, default=1,
                        help="runs of every side, in alternating order; each figure is their median")
    parser.add_argument("--session", choices=INGRESS_MODES, help=argparse.SUPPRESS)
    parser.add_argument("--session-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if any(count < 1 for count in args.clients):
        parser.error(f"--clients: every client count must be >= 1, got {args.clients}")
    if args.median_of < 1:
        parser.error(f"--median-of must be >= 1, got {args.median_of}")
    if args.soak_s is None:
        args.soak_s = QUICK_SOAK_S if args.quick else SOAK_S
    if args.soak_s < 0:
        parser.error(f"--soak-s must be >= 0, got {args.soak_s:g}")
    args.mixes = list(dict.fromkeys(args.mixes))
    return args


def infinity_environment(args: argparse.Namespace) -> tuple[Path | None, str]:
    """(infinity-emb's command, "") for every run of this invocation, its environment made once
    (`ensure_infinity_venv`); or (None, why the side is skipped)."""
    if args.device != "cpu":
        return None, "skipped: measured on the CPU only"
    if args.skip_infinity:
        return None, "skipped (--skip-infinity)"
    binary, why = ensure_infinity_venv()
    if binary is None:
        note = f"skipped: its environment {INFINITY_VENV} cannot be made ({why})"
        log.warning("infinity-emb %s", note)
        return None, note
    return binary, ""


def measure_run(args: argparse.Namespace, run: int,
                infinity: tuple[Path | None, str]) -> tuple[list[dict], dict, str]:
    """One run of every side (`infinity`: what `infinity_environment` returned): (its points, each tagged with
    `run`; the compute bound per mix; infinity-emb's note). Odd runs measure the sides in the reverse order, so that
    a drift of the machine does not favour one side."""
    import json
    import subprocess
    import tempfile

    points: list[dict] = []
    bounds = {}
    for mix in args.mixes:
        log.info("run %d: measuring the in-process compute bound on the %s texts", run + 1, mix)
        bounds[mix] = compute_bound(make_texts(NUM_TEXTS, mix), seconds=1.0 if args.quick else 5.0,
                                    device=args.device)
    binary, infinity_note = infinity
    steps = ["infinity", *args.ingress]
    for step in reversed(steps) if run % 2 else steps:
        if step == "infinity":
            if binary is None:
                continue
            try:
                points += run_infinity(binary, args, out_dir() / "infinity-emb.log")
                infinity_note = "measured"
            except RuntimeError as error:
                infinity_note = f"skipped: {error}"
                log.warning("infinity-emb %s", infinity_note)
            continue
        if not session_systems(step, args):
            continue
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "points.json"
            log.info("run %d, session %s: a Ray of its own (%s)", run + 1, step, INGRESS_MODES[step])
            subprocess.run([sys.executable, __file__, *session_argv(args, step, out)], env=session_env(step),
                           check=True)
            points += json.loads(out.read_text())
    return [{**point, "run": run} for point in points], bounds, infinity_note


def median_of_runs(runs: list[dict]) -> dict:
    """The figures of several runs as one: each number the median of its values over the runs that have it (in a
    dict, key by key), anything else the last run's. Every numeric figure of a mix and the soak's growths also keep
    their values per run, under the mix's `per_run` and the top-level `per_run`."""
    def median(values: list) -> Any:
        numbers = [value for value in values if isinstance(value, (int, float)) and not isinstance(value, bool)]
        if numbers and len(numbers) == len(values):
            return float(np.median(numbers))
        if all(isinstance(value, dict) for value in values):
            keys = dict.fromkeys(key for value in values for key in value)
            return {key: median([value[key] for value in values if key in value]) for key in keys}
        return values[-1]

    if len(runs) == 1:
        return runs[0]
    merged = median([{key: value for key, value in run.items() if key != "points"} for run in runs])
    merged["points"] = [point for run in runs for point in run.get("points", [])]
    merged.update(error_counts(merged["points"]))
    for mix in MIXES:
        if isinstance(merged.get(mix), dict):
            merged[mix]["per_run"] = {key: [run[mix].get(key) for run in runs]
                                      for key, value in merged[mix].items()
                                      if isinstance(value, float) and key != "per_run"}
    merged["per_run"] = {key: [run.get(key) for run in runs] for key in ("rss_growth", "p99_growth")
                         if key in merged}
    merged["runs"] = len(runs)
    return merged


def main(argv: list[str] | None = None) -> None:
    import json

    from benchmarks._common import RESULTS_DIR, rerun_command

    args = parse_args(argv)
    if args.session:
        run_session(args.session, args, args.session_out)
        return

    command = rerun_command("serve_e2e", sys.argv if argv is None else ["serve_e2e", *argv])
    infinity = infinity_environment(args)
    runs = []
    for run in range(args.median_of):
        points, bounds, infinity_note = measure_run(args, run, infinity)
        figures = run_figures(points, args.mixes, args.clients, bounds)
        for mix in args.mixes:  # which invocation measured each mix (a merged result holds several)
            figures[mix]["command"] = command
        figures.update({"points": points, "infinity_emb": infinity_note})
        runs.append(figures)
    figures = median_of_runs(runs)
    figures.update({"machine": machine_description(), "quick": args.quick, "device": args.device,
                    "mixes": args.mixes})
    previous_path = RESULTS_DIR / "serve_e2e.json"
    if args.merge and previous_path.exists():
        figures = merge_figures(json.loads(previous_path.read_text())["figures"], figures, args.mixes)
    path = out_dir() / "serve_e2e.png"
    plot(figures["points"], path)
    log.info("wrote %s", path)
    emit_json(figures)


def _brief(point: dict) -> str:
    return (f"ok/s {point['ok_per_s']:.1f} goodput/s {point['goodput_per_s']:.1f} p50 {point['p50_ms']:.0f} ms "
            f"p99 {point['p99_ms']:.0f} ms statuses {point['statuses']} {point['error_types'] or ''} errors "
            f"{point['errors']} dropped {point['dropped']}")


if __name__ == "__main__":
    main()
