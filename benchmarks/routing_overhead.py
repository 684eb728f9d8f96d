"""Routing overhead of plexserve's model-aware RequestRouter against Ray Serve's default router.

Two copies of an echo deployment (the smallest possible model) run side by side on one local Ray, each with two
replicas hosting the same model name: one routed by Ray Serve's default router (power of two choices), one by
`rayserve_apps.routers.model_aware.ModelAwareRouter`. Rounds alternate A/B/A/B so both see the same machine; each
round sends a fixed number of requests through a `DeploymentHandle` with a bounded number in flight.

Final JSON line: `router_overhead_ratio` = default router requests/s / plexserve router requests/s (median
over rounds; 1.0 means no overhead, target <= 1.15), and both rates.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks._common` when run as a script

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from benchmarks._common import emit_json, machine_description, make_parser, setup_logging
from rayserve_apps.contracts import STATS_MODELS, STATS_QUEUE_LENGTH
from rayserve_apps.routers.model_aware import ModelAwareRouter

MODEL = "echo-model"
#: Requests in flight at once per round.
CONCURRENCY = 32
#: Replicas of each echo deployment.
NUM_REPLICAS = 2


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=64)
class Echo:
    """Returns its payload; reports the model it hosts so the model-aware router can filter."""

    async def __call__(self, model: str, payload: int) -> int:
        return payload

    def record_routing_stats(self) -> dict:
        return {STATS_MODELS: [MODEL], STATS_QUEUE_LENGTH: 0}


async def one_round(handle, num_requests: int) -> float:
    """Requests per second for `num_requests` echo calls with CONCURRENCY in flight."""
    semaphore = asyncio.Semaphore(CONCURRENCY)

    async def call(i: int) -> None:
        async with semaphore:
            assert await handle.remote(MODEL, i) == i

    start = time.perf_counter()
    await asyncio.gather(*(call(i) for i in range(num_requests)))
    return num_requests / (time.perf_counter() - start)


def main() -> None:
    args = make_parser(__doc__).parse_args()
    log = setup_logging("routing_overhead")
    rounds, per_round = (4, 300) if args.quick else (10, 2000)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    try:
        default = serve.run(Echo.options(name="echo-default", num_replicas=NUM_REPLICAS).bind(),
                            name="echo-default", route_prefix=None)
        plex = serve.run(Echo.options(name="echo-plex", num_replicas=NUM_REPLICAS,
                                      request_router_config=RequestRouterConfig(
                                          request_router_class=ModelAwareRouter,
                                          request_routing_stats_period_s=1.0)).bind(),
                         name="echo-plex", route_prefix=None)
        loop = asyncio.new_event_loop()
        loop.run_until_complete(one_round(default, per_round // 4))  # warm-up both
        loop.run_until_complete(one_round(plex, per_round // 4))
        default_rates, plex_rates = [], []
        for r in range(rounds):
            default_rates.append(loop.run_until_complete(one_round(default, per_round)))
            plex_rates.append(loop.run_until_complete(one_round(plex, per_round)))
            log.info("round %d/%d: default %.0f req/s, plexserve %.0f req/s", r + 1, rounds, default_rates[-1],
                     plex_rates[-1])
        loop.close()
    finally:
        serve.shutdown()
        ray.shutdown()
    ratios = [d / p for d, p in zip(default_rates, plex_rates)]
    emit_json({
        "router_overhead_ratio": statistics.median(ratios),
        "default_requests_per_s": statistics.median(default_rates),
        "plexserve_requests_per_s": statistics.median(plex_rates),
        "rounds": rounds, "requests_per_round": per_round, "concurrency": CONCURRENCY,
        "machine": machine_description(),
    })


if __name__ == "__main__":
    main()
