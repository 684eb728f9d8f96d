"""plexserve's custom metrics, exported through Ray's metrics agent to Prometheus and the Ray dashboard.

Every metric is named `plexserve_*` (Ray adds the `ray_` prefix on export) and created once per process: the
functions below return the same object each time, so a replica and the ingress never redefine a metric with
other tag keys. Serve adds `application`, `deployment` and `replica` tags by itself.
"""

from __future__ import annotations

from functools import cache

from ray.serve.metrics import Counter, Gauge, Histogram

#: Histogram buckets of batch sizes (requests or texts per forward pass).
BATCH_SIZE_BOUNDARIES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
#: Histogram buckets of fractions in [0, 1] (padding).
FRACTION_BOUNDARIES = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
#: Histogram buckets of tokens per batch.
BATCH_TOKENS_BOUNDARIES = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
#: Histogram buckets of end-to-end latency in milliseconds.
LATENCY_MS_BOUNDARIES = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]


@cache
def requests_total() -> Counter:
    return Counter("plexserve_requests_total",
                   description="Requests answered, by model and outcome (ok, rejected, failed).",
                   tag_keys=("model", "outcome"))


@cache
def slo_met_total() -> Counter:
    return Counter("plexserve_slo_met_total", description="Requests answered within their model's SLO.",
                   tag_keys=("model",))


@cache
def slo_attainment() -> Gauge:
    return Gauge("plexserve_slo_attainment",
                 description="Requests within the model's SLO over all requests, refused ones included, in the last "
                             "minute (0..1).",
                 tag_keys=("model",))


@cache
def rejections_total() -> Counter:
    return Counter("plexserve_rejections_total", description="Requests refused before running, by model and reason.",
                   tag_keys=("model", "reason"))


@cache
def request_latency_ms() -> Histogram:
    return Histogram("plexserve_request_latency_ms", description="End-to-end latency at the ingress, milliseconds.",
                     boundaries=LATENCY_MS_BOUNDARIES, tag_keys=("model",))


@cache
def group_queue_length() -> Gauge:
    return Gauge("plexserve_group_queue_length", description="Requests in flight in a device group.",
                 tag_keys=("group",))


@cache
def batch_size() -> Histogram:
    return Histogram("plexserve_batch_size", description="Requests or texts per forward pass.",
                     boundaries=BATCH_SIZE_BOUNDARIES, tag_keys=("model",))


@cache
def padding_fraction() -> Histogram:
    return Histogram("plexserve_padding_fraction", description="Share of computed token positions that are padding.",
                     boundaries=FRACTION_BOUNDARIES, tag_keys=("model",))


@cache
def placement_version() -> Gauge:
    return Gauge("plexserve_placement_version", description="Version of the placement a group (or the ingress) runs.",
                 tag_keys=("group",))


@cache
def batch_tokens() -> Histogram:
    return Histogram("plexserve_batch_tokens", description="Real (non-padding) tokens per ConcatBatching forward pass.",
                     boundaries=BATCH_TOKENS_BOUNDARIES, tag_keys=("model",))


@cache
def batch_utility_total() -> Counter:
    return Counter("plexserve_batch_utility_total", description="TCB utility (sum of 1/length of texts run), by model.",
                   tag_keys=("model",))


@cache
def dropped_requests_total() -> Counter:
    return Counter("plexserve_dropped_requests_total",
                   description="Texts dropped because their deadline passed while waiting.", tag_keys=("model",))


@cache
def controller_decisions_total() -> Counter:
    return Counter("plexserve_controller_decisions_total",
                   description="Placement controller decisions, by outcome (kept, applied, failed, idle).",
                   tag_keys=("outcome",))


@cache
def controller_predicted_gain() -> Gauge:
    return Gauge("plexserve_controller_predicted_gain",
                 description="Predicted SLO attainment gain (0..1) of the controller's latest decision.")


@cache
def controller_decision_seconds() -> Gauge:
    return Gauge("plexserve_controller_decision_seconds",
                 description="Seconds the controller's latest decision took (planning and applying).")


@cache
def placement_changes_total() -> Counter:
    return Counter("plexserve_placement_changes_total",
                   description="Group slots changed by re-placements, by kind (rehost, start, stop, replace); "
                               "runtime replicas switched by Arlo re-allocations (runtime) or added and released "
                               "by its target tracking (scale_out, scale_in).", tag_keys=("kind",))
