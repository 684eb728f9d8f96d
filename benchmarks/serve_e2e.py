"""serve_e2e: plexserve's main path against the plain Ray Serve app a user would write instead, end to end.

Two applications, driven over HTTP by one asyncio load generator (aiohttp, keep-alive connections) in the same
process as their Ray, on the same CPUs:

* plexserve: `configs/local.yaml` exactly as `make serve` deploys it (ingress, device groups, vision model,
  placement controller), requests `POST /v1/models/minilm/embed {"texts": [text]}`;
* plain: one deployment, sentence-transformers all-MiniLM-L6-v2 with `@serve.batch(max_batch_size=32)`, the
  replica owning the two CPUs, requests `POST /plain {"texts": [text]}`.

Serve's HTTP path is switched when Ray starts, so the run has two sessions, each a Ray of its own in a child
process, both applications side by side in each:

* `serve_proxy`: Serve's defaults, its Python HTTP proxy in front (how a user runs the plain app);
* `fast_ingress`: plexserve's serving mode (`make serve`, `rayserve_apps/fast_ingress.py`): HAProxy in front,
  HTTP served by the ingress replica.

The headline `ratio_ok_per_s_N` is plexserve as shipped (fast ingress) over the plain app as users run it (Serve's
proxy); `ratio_ok_per_s_N_both_fast_ingress` and `..._both_serve_proxy` compare the two behind the same ingress.

Short texts of N(20, 8) words. Closed loop at 1, 4, 16 and 64 clients (each client sends its next request when
the last one is answered), the two systems alternating per client count; then, in the fast-ingress session, an
open-loop overload (Poisson arrivals) on plexserve at 2x and 4x the peak it sustained there, with the CPU seconds of
each process. `goodput` counts 200 answers within the model's SLO. `fraction_of_compute_bound_64` divides
plexserve's requests/s at 64 clients by what the same model does in this process on the same texts at its best
batch size (measured in the same run, Ray idle).

    .venv/bin/python benchmarks/serve_e2e.py --quick
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

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import yaml  # noqa: E402

from benchmarks._common import emit_json, machine_description, make_parser, out_dir, setup_logging  # noqa: E402

#: Client counts of the closed-loop runs.
CLIENT_COUNTS = (1, 4, 16, 64)
#: Multiples of the measured peak for the open-loop overload runs.
OVERLOAD_FACTORS = (2.0, 4.0)
#: Words per text: N(mean, std), at least one.
WORDS_MEAN, WORDS_STD = 20.0, 8.0
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

PLEXSERVE_CONFIG = REPO / "configs" / "local.yaml"
#: How Serve's HTTP path runs, each in a Ray of its own (the switches are read when Ray's processes start).
INGRESS_MODES = {"serve_proxy": "Serve's defaults: its Python HTTP proxy in front of every application",
                 "fast_ingress": "plexserve's serving mode (make serve): Serve's HAProxy ingress, "
                                 "rayserve_apps/fast_ingress.py"}
#: plexserve as shipped, and the plain app as a user writes and runs it (the issue's bar).
PLEXSERVE_INGRESS = "fast_ingress"
BASELINE_INGRESS = "serve_proxy"
PLEXSERVE_MODEL = "minilm"

log = setup_logging("serve_e2e")


def make_texts(count: int, seed: int = 0) -> list[str]:
    """Texts of N(20, 8) words drawn from the tokenizer's whole-word vocabulary."""
    from models.text_encoder import load_text_tokenizer

    vocab = [w for w in load_text_tokenizer().tokenizer.get_vocab() if w.isalpha() and w.isascii() and len(w) > 2]
    vocab.sort()
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        words = max(1, round(rng.gauss(WORDS_MEAN, WORDS_STD)))
        texts.append(" ".join(rng.choice(vocab) for _ in range(words)))
    return texts


# ---- the plain Ray Serve app (what a user would write instead) ----

#: The share of a GPU the plain app reserves with `--device cuda` (it runs beside plexserve's replicas).
PLAIN_GPU_SHARE = 0.1
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
    statuses: dict[int, int] = field(default_factory=dict)
    error_types: dict[str, int] = field(default_factory=dict)  # error.type of non-200 JSON answers
    errors: int = 0  # timeouts and connection errors
    dropped: int = 0  # open loop: arrivals past MAX_OPEN_LOOP_IN_FLIGHT
    slo_ms: float = 1000.0

    def summary(self) -> dict:
        ok = self.statuses.get(200, 0)
        lat = np.asarray(self.latencies_ms) if self.latencies_ms else np.asarray([np.nan])
        good = int((lat <= self.slo_ms).sum()) if self.latencies_ms else 0
        return {"system": self.system, "mode": self.mode, "load": self.load, "ok_per_s": ok / self.duration_s,
                "goodput_per_s": good / self.duration_s, "p50_ms": float(np.percentile(lat, 50)),
                "p99_ms": float(np.percentile(lat, 99)),
                "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "error_types": dict(self.error_types),
                "errors": self.errors, "dropped": self.dropped}


class LoadGenerator:
    def __init__(self, texts: list[str]):
        import aiohttp

        self.aiohttp = aiohttp
        self.bodies = [f'{{"texts": [{_json_str(t)}]}}'.encode() for t in texts]
        self.next = 0

    def _body(self) -> bytes:
        self.next = (self.next + 1) % len(self.bodies)
        return self.bodies[self.next]

    async def _send(self, session, url: str, point: Point, record: bool) -> None:
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
            else:
                kind = _error_type(body)
                point.error_types[kind] = point.error_types.get(kind, 0) + 1

    def _session(self):
        connector = self.aiohttp.TCPConnector(limit=0, force_close=False)
        return self.aiohttp.ClientSession(connector=connector,
                                          timeout=self.aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))

    async def closed_loop(self, url: str, point: Point, clients: int, warmup_s: float) -> Point:
        async with self._session() as session:
            start = time.perf_counter()
            measure_from, stop_at = start + warmup_s, start + warmup_s + point.duration_s

            async def client() -> None:
                while True:
                    now = time.perf_counter()
                    if now >= stop_at:
                        return
                    await self._send(session, url, point, record=now >= measure_from)

            await asyncio.gather(*(client() for _ in range(clients)))
        return point

    async def open_loop(self, url: str, point: Point, rate_per_s: float, seed: int) -> Point:
        rng = random.Random(seed)
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
                    task = asyncio.ensure_future(self._send(session, url, point, record=True))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                next_at += rng.expovariate(rate_per_s)
            if tasks:
                await asyncio.wait(tasks)
        return point


#: Processes whose CPU time the overload runs attribute, by a fragment of their command line (Ray's process titles).
CPU_ROLES = {"haproxy": "bin/haproxy", "proxy": "ProxyActor", "ingress": "plexserve:Ingress",
             "replicas": "ServeReplica:plexserve:", "stage_actors": "StageShard"}


def cpu_seconds_by_role() -> dict[str, float]:
    """CPU seconds (user + system) so far of Serve's proxy, plexserve's ingress, its other replicas and this
    process (the load generator), read from /proc (Linux); empty where /proc is not there."""
    from parallel.profiler import PROC_ROOT, process_cpu_s

    totals = {role: 0.0 for role in (*CPU_ROLES, "load_generator")}
    for entry in PROC_ROOT.glob("[0-9]*"):
        seconds = process_cpu_s(int(entry.name))
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if seconds is None:
            continue
        if int(entry.name) == os.getpid():
            totals["load_generator"] += seconds
            continue
        for role, fragment in CPU_ROLES.items():  # the first matching role: the ingress before other replicas
            if fragment in command:
                totals[role] += seconds
                break
    return totals


def _error_type(body: bytes) -> str:
    import json

    try:
        return str(json.loads(body)["error"]["type"])
    except (ValueError, KeyError, TypeError):  # not plexserve's JSON error: Serve's or HAProxy's plain-text answer
        return "text: " + body[:UNPARSED_PREFIX_CHARS].decode(errors="replace").strip()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _json_str(text: str) -> str:
    import json

    return json.dumps(text)


# ---- in-process compute bound ----

def compute_bound(texts: list[str], seconds: float) -> dict:
    """Texts/s of MiniLM in this process on the same texts: the best of length-sorted padded batches and
    ConcatBatching packs at each batch size, with as many torch threads as the machine has cores."""
    import torch

    from models.packed_text import ConcatBatchingEngine
    from models.text_encoder import load_text_encoder

    torch.set_num_threads(os.cpu_count() or 1)
    encoder = load_text_encoder()
    token_ids = encoder.text_tokenizer.encode(texts)
    results = {}
    for batch in COMPUTE_BOUND_BATCH_SIZES:
        ordered = sorted(token_ids, key=len)
        chunks = [ordered[i:i + batch] for i in range(0, len(ordered), batch)]
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            chunk = chunks[done % len(chunks)]
            encoder.embed_token_ids(chunk)
            done += 1
        results[f"sorted_padded_{batch}"] = done * batch / (time.perf_counter() - start)
    longest = max(len(ids) for ids in token_ids)
    for batch in COMPUTE_BOUND_BATCH_SIZES:
        engine = ConcatBatchingEngine(encoder, row_length_tokens=max(longest, 64), num_rows=max(1, batch // 4))
        done, start, index = 0, time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            chunk = token_ids[index:index + batch] or token_ids[:batch]
            index = (index + batch) % len(token_ids)
            engine.embed(chunk)
            done += len(chunk)
        results[f"packed_{batch}"] = done / (time.perf_counter() - start)
    best = max(results, key=results.get)
    log.info("in-process compute bound: %s", {k: round(v, 1) for k, v in results.items()})
    return {"best": best, "texts_per_s": results[best], "all": results}


# ---- the run ----

def plexserve_args(path: Path = PLEXSERVE_CONFIG, device: str = "cpu") -> dict:
    """The application args of a Serve config; with `device` 'cuda' its cluster's devices are this machine's GPUs
    (device resource 'GPU', one device per GPU, each GPU's memory), and a placement group over more devices than
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
        placement = spec.get("placement") or {}
        if placement.get("groups"):
            kept = [group for group in placement["groups"] if group["num_devices"] <= gpus]
            if len(kept) < len(placement["groups"]):
                log.info("--device cuda: %d placement group(s) over more than %d GPU(s) left out",
                         len(placement["groups"]) - len(kept), gpus)
            placement["groups"] = kept
    return spec


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_p99) = plt.subplots(1, 2, figsize=(10, 4))
    styles = {("plexserve", "fast_ingress"): "o-", ("plexserve", "serve_proxy"): "o:",
              ("plain", "serve_proxy"): "s--", ("plain", "fast_ingress"): "s-."}
    for (system, ingress), style in styles.items():
        rows = [p for p in points if p["system"] == system and p["mode"] == "closed" and p["ingress"] == ingress]
        if not rows:
            continue
        clients = [p["load"] for p in rows]
        label = f"{system} ({ingress})"
        ax_tp.plot(clients, [p["ok_per_s"] for p in rows], style, label=label)
        ax_p99.plot(clients, [p["p99_ms"] for p in rows], style, label=label)
    for ax, label in ((ax_tp, "requests/s answered 200"), (ax_p99, "p99 latency of 200 answers (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("closed-loop clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("MiniLM over HTTP: plexserve (configs/local.yaml) vs plain Ray Serve @serve.batch")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_session(ingress: str, args, out: Path) -> None:
    """One Ray with one ingress mode (its switches are in this process's environment, set by `main`): both
    applications side by side, closed loop alternating per client count; with the fast ingress, the open-loop
    overload on plexserve. Writes the points as JSON to `out`."""
    import json

    import ray
    from ray import serve

    from rayserve_apps.app import build_app

    warmup_s, duration_s = QUICK_DURATIONS_S if args.quick else FULL_DURATIONS_S
    texts = make_texts(NUM_TEXTS)
    spec = plexserve_args(args.config, args.device)
    slo_ms = next(m["slo_ms"] for m in spec["models"] if m["name"] == PLEXSERVE_MODEL)
    ray.init(address="local", num_cpus=RAY_NUM_CPUS, include_dashboard=False, log_to_driver=False,
             **({"num_gpus": spec["cluster"]["num_devices"]} if args.device == "cuda" else {}))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    urls = {"plexserve": f"{base}/v1/models/{PLEXSERVE_MODEL}/embed", "plain": f"{base}/plain"}
    systems = ["plexserve"] if args.skip_plain else ["plain", "plexserve"]
    points: list[dict] = []
    try:
        log.info("[%s] deploying plexserve (%s)%s", ingress, args.config.name,
                 "" if args.skip_plain else " and the plain app")
        serve.run(build_app(spec), name="plexserve", route_prefix="/")
        if not args.skip_plain:
            serve.run(plain_app(args.device), name="plain", route_prefix="/plain")
        generator = LoadGenerator(texts)
        loop = asyncio.new_event_loop()
        for system in systems:  # one warm-up request each: first calls load lazily initialised parts
            loop.run_until_complete(generator.closed_loop(urls[system], Point(system, "closed", 1, 1.0), 1, 0.0))
        for index, clients in enumerate(args.clients):
            order = systems if index % 2 == 0 else systems[::-1]
            for system in order:
                point = loop.run_until_complete(generator.closed_loop(
                    urls[system], Point(system, "closed", clients, duration_s, slo_ms=slo_ms), clients, warmup_s))
                points.append({**point.summary(), "ingress": ingress})
                log.info("[%s] %-9s %3d clients: %s", ingress, system, clients, _brief(points[-1]))
        if ingress == PLEXSERVE_INGRESS and not args.skip_overload:
            peak = max(p["goodput_per_s"] for p in points if p["system"] == "plexserve")
            for factor in OVERLOAD_FACTORS:
                cpu_before = cpu_seconds_by_role()
                point = loop.run_until_complete(generator.open_loop(
                    urls["plexserve"], Point("plexserve", "open", factor * peak, duration_s, slo_ms=slo_ms),
                    factor * peak, seed=int(factor * 10)))
                cpu_s = {role: round(s - cpu_before[role], 2) for role, s in cpu_seconds_by_role().items()}
                points.append({**point.summary(), "ingress": ingress, "factor": factor, "cpu_s_by_process": cpu_s})
                log.info("[%s] plexserve open loop at %.1fx peak (%.0f/s): %s; CPU s by process %s", ingress,
                         factor, factor * peak, _brief(points[-1]), cpu_s)
        loop.close()
    finally:
        serve.shutdown()
        ray.shutdown()
    out.write_text(json.dumps(points))


def session_env(ingress: str) -> dict[str, str]:
    """The environment of a session's process: Serve's defaults, or plexserve's fast ingress (free ports for
    HAProxy's stats and metrics so that the run can go on beside `make serve`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    if ingress == "fast_ingress":
        from rayserve_apps.fast_ingress import local_env

        env.update(local_env(stats_port=free_port(), metrics_port=free_port()))
    return env


def session_argv(args: argparse.Namespace, ingress: str, out: Path) -> list[str]:
    """The command line of one session's child process: this run's options, its ingress mode and its output."""
    argv = ["--clients", *map(str, args.clients), "--config", str(args.config), "--session", ingress,
            "--session-out", str(out), "--device", args.device]
    flags = {"--quick": args.quick, "--skip-plain": args.skip_plain, "--skip-overload": args.skip_overload}
    return argv + [flag for flag, on in flags.items() if on]


def main() -> None:
    import json
    import subprocess
    import tempfile

    parser = make_parser(__doc__)
    parser.add_argument("--clients", type=int, nargs="*", default=list(CLIENT_COUNTS), help="closed-loop client counts")
    parser.add_argument("--skip-plain", action="store_true", help="measure plexserve alone (development runs)")
    parser.add_argument("--config", type=Path, default=PLEXSERVE_CONFIG, help="plexserve Serve config to deploy")
    parser.add_argument("--skip-overload", action="store_true", help="no open-loop overload runs")
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="where the models compute: cpu (the config as written) or cuda (the config's cluster "
                             "becomes this machine's GPUs, the plain app runs on one too)")
    parser.add_argument("--ingress", choices=INGRESS_MODES, nargs="*", default=list(INGRESS_MODES),
                        help="ingress modes to measure, each in its own Ray (default: both)")
    parser.add_argument("--session", choices=INGRESS_MODES, help=argparse.SUPPRESS)
    parser.add_argument("--session-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.session:
        run_session(args.session, args, args.session_out)
        return

    texts = make_texts(NUM_TEXTS)
    log.info("measuring the in-process compute bound")
    bound = compute_bound(texts, seconds=1.0 if args.quick else 5.0)
    points: list[dict] = []
    for ingress in args.ingress:
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "points.json"
            log.info("session %s: a Ray of its own (%s)", ingress, INGRESS_MODES[ingress])
            subprocess.run([sys.executable, __file__, *session_argv(args, ingress, out)], env=session_env(ingress),
                           check=True)
            points += json.loads(out.read_text())

    def closed(system: str, clients: int, ingress: str) -> dict | None:
        return next((p for p in points if p["system"] == system and p["mode"] == "closed" and p["load"] == clients
                     and p["ingress"] == ingress), None)

    shipped = [p for p in points if p["system"] == "plexserve" and p["ingress"] == PLEXSERVE_INGRESS]
    peak = max((p["goodput_per_s"] for p in shipped if p["mode"] == "closed"), default=0.0)
    figures: dict = {"machine": machine_description(), "quick": args.quick, "device": args.device, "points": points,
                     "compute_bound_texts_per_s": bound["texts_per_s"], "compute_bound_best": bound["best"],
                     "peak_goodput_plexserve": peak}
    for clients in args.clients:
        plex, plain = closed("plexserve", clients, PLEXSERVE_INGRESS), closed("plain", clients, BASELINE_INGRESS)
        if plex is not None:
            figures[f"ok_per_s_plexserve_{clients}"] = plex["ok_per_s"]
            figures[f"p99_ms_plexserve_{clients}"] = plex["p99_ms"]
        if plain is not None:
            figures[f"ok_per_s_plain_{clients}"] = plain["ok_per_s"]
            figures[f"p99_ms_plain_{clients}"] = plain["p99_ms"]
        if plex is not None and plain is not None:
            figures[f"ratio_ok_per_s_{clients}"] = plex["ok_per_s"] / max(plain["ok_per_s"], 1e-9)
        for ingress in INGRESS_MODES:  # both systems behind the same ingress
            a, b = closed("plexserve", clients, ingress), closed("plain", clients, ingress)
            if a is not None and b is not None:
                figures[f"ratio_ok_per_s_{clients}_both_{ingress}"] = a["ok_per_s"] / max(b["ok_per_s"], 1e-9)
                figures[f"p99_ms_plexserve_{clients}_{ingress}"] = a["p99_ms"]
                figures[f"p99_ms_plain_{clients}_{ingress}"] = b["p99_ms"]
    if closed("plexserve", 64, PLEXSERVE_INGRESS) is not None:
        figures["fraction_of_compute_bound_64"] = closed("plexserve", 64, PLEXSERVE_INGRESS)["ok_per_s"] / bound[
            "texts_per_s"]
    for p in points:
        if p["mode"] == "open":
            figures[f"goodput_ratio_overload_{p['factor']:g}x"] = p["goodput_per_s"] / max(peak, 1e-9)
    figures["errors_5xx_not_503"] = sum(count for p in points for status, count in p["statuses"].items()
                                        if int(status) >= 500 and int(status) != 503)
    figures["client_errors_and_timeouts"] = sum(p["errors"] for p in points)
    path = out_dir() / "serve_e2e.png"
    plot(points, path)
    log.info("wrote %s", path)
    emit_json(figures)


def _brief(point: dict) -> str:
    return (f"ok/s {point['ok_per_s']:.1f} goodput/s {point['goodput_per_s']:.1f} p50 {point['p50_ms']:.0f} ms "
            f"p99 {point['p99_ms']:.0f} ms statuses {point['statuses']} {point['error_types'] or ''} errors "
            f"{point['errors']} dropped {point['dropped']}")


if __name__ == "__main__":
    main()
