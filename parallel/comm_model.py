"""Alpha-beta communication model: time = alpha + beta * bytes, fitted to measured transfers and collectives.

The profiler (`parallel.profiler`) measures sends between pipeline stages (over their stage transport) and the
all-reduce / all-gather of a tensor-parallel group at several sizes; `fit_alpha_beta` fits the classic latency-bandwidth
model by least squares (Hockney's alpha-beta model, the cost model of Alpa's intra-op pass), and `CommModel` answers
what the inter-op and intra-op passes ask: the cost of receiving a stage's input and of a collective over `degree`
shards.

`HopOverhead` is what one pipeline hop costs the runtime beyond moving the bytes (a message on the stage transport:
its header and each tensor as point-to-point sends, the stage's loop; see `parallel.stage_transport`), in wall time
and in host CPU; the cost model of `placement.core.profiles.ConfigProfile` adds it to every stage (AlpaServe §3.3's
communication overhead, measured as the runtime really pays it) and, on hosts whose devices are CPU shares, bounds
throughput by the CPU per request.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class AlphaBeta(BaseModel):
    """time_s = alpha_s + beta_s_per_byte * bytes."""

    model_config = ConfigDict(extra="forbid")

    alpha_s: float = Field(ge=0, description="Fixed cost of one operation, in seconds.")
    beta_s_per_byte: float = Field(ge=0, description="Cost per byte moved, in seconds per byte.")
    num_samples: int = Field(default=0, ge=0, description="Measurements the fit used.")

    def cost_s(self, num_bytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * float(num_bytes)


def fit_alpha_beta(sizes_bytes: Sequence[float], times_s: Sequence[float]) -> AlphaBeta:
    """Least-squares fit of time = alpha + beta * bytes, both clamped at zero."""
    if len(sizes_bytes) != len(times_s) or len(sizes_bytes) < 2:
        raise ValueError("fit_alpha_beta needs at least two (size, time) pairs of equal length")
    x = np.asarray(sizes_bytes, dtype=float)
    y = np.asarray(times_s, dtype=float)
    design = np.stack([np.ones_like(x), x], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, y, rcond=None)
    if beta < 0:
        alpha, beta = float(np.mean(y)), 0.0
    if alpha < 0:
        alpha, beta = 0.0, float(np.dot(x, y) / max(np.dot(x, x), 1e-30))
    return AlphaBeta(alpha_s=float(alpha), beta_s_per_byte=float(beta), num_samples=len(x))


class HopOverhead(BaseModel):
    """Per-hop overhead of the model-parallel runtime, measured by relaying an activation-sized payload through
    chains of 1 and 2 actors over the group runtime's stage transport (`parallel.profiler.profile_hop_overhead`)."""

    model_config = ConfigDict(extra="forbid")

    payload_bytes: int = Field(ge=0, description="Bytes of the relayed activation.")
    latency_s: float = Field(ge=0, description="Wall seconds one more stage call adds to a request (sequential).")
    cpu_s: float = Field(ge=0, description="Host CPU seconds one more stage call costs, over every process "
                                           "(caller, Ray, actors), with requests pipelined.")
    request_cpu_s: float = Field(ge=0, description="Host CPU seconds per request outside its stage calls (put of "
                                                   "the input, collecting the result).")
    request_latency_s: float = Field(default=0.0, ge=0,
                                     description="Wall seconds per request outside its stage calls (put of the "
                                                 "input, waiting for and collecting every call's result).")
    host_cores: float = Field(gt=0, description="CPU cores of the host the overhead was measured on.")
    background_cpu_cores: float = Field(
        default=0.0, ge=0,
        description="Cores the Ray cluster's own processes (raylet, GCS, agents) and the idle actors keep busy with no "
                    "request in flight (CPU seconds per second); 0 in files that did not measure it.")
    foreign_cpu_cores: float = Field(
        default=0.0, ge=0,
        description="Cores other processes on the host (another tenant, the hypervisor's steal) kept busy while the "
                    "overhead was measured (CPU seconds per second, `parallel.profiler.ForeignLoadMeter`); the figures "
                    "above were measured beside that load. 0 in files that did not measure it.")

    def beyond_send(self, send_s: float) -> tuple[float, float]:
        """(wall, CPU) seconds per stage call that a stage latency pricing its receive at `send_s` leaves out."""
        return max(0.0, self.latency_s - send_s), max(0.0, self.cpu_s - send_s)


class CommModel(BaseModel):
    """Fitted costs of a point-to-point send between actors and of collectives by group degree."""

    model_config = ConfigDict(extra="forbid")

    send: AlphaBeta = Field(description="Handing one activation to the next pipeline stage: one more hop over the "
                                        "stage transport (`torch.distributed` point-to-point: out of one actor, into "
                                        "the next, relayed).")
    all_reduce: dict[int, AlphaBeta] = Field(default_factory=dict, description="Degree -> all-reduce cost.")
    all_gather: dict[int, AlphaBeta] = Field(default_factory=dict,
                                             description="Degree -> all-gather cost (bytes of the gathered tensor).")
    hop: HopOverhead | None = Field(default=None, description="Per-hop runtime overhead; None in files that did not "
                                                              "measure it (priced as 0).")

    def send_s(self, num_bytes: float) -> float:
        return self.send.cost_s(num_bytes)

    @staticmethod
    def _collective(fits: dict[int, AlphaBeta], degree: int, num_bytes: float, what: str) -> float:
        if degree <= 1:
            return 0.0
        if degree in fits:
            return fits[degree].cost_s(num_bytes)
        if not fits:
            raise ValueError(f"no {what} measurement: profile collectives before planning intra-op degree {degree}")
        # Ring collectives: alpha grows with (d - 1) steps, bytes moved with (d - 1) / d.
        nearest = min(fits, key=lambda d: abs(d - degree))
        fit = fits[nearest]
        steps = (degree - 1) / (nearest - 1)
        volume = ((degree - 1) / degree) / ((nearest - 1) / nearest)
        return fit.alpha_s * steps + fit.beta_s_per_byte * num_bytes * volume

    def all_reduce_s(self, num_bytes: float, degree: int) -> float:
        return self._collective(self.all_reduce, degree, num_bytes, "all-reduce")

    def all_gather_s(self, num_bytes: float, degree: int) -> float:
        """All-gather whose *gathered* (whole) tensor has `num_bytes`."""
        return self._collective(self.all_gather, degree, num_bytes, "all-gather")

    def without_collectives(self, degree: int) -> "CommModel":
        """This model with free collectives over `degree` shards (what a shard computes, without its waits)."""
        free = AlphaBeta(alpha_s=0.0, beta_s_per_byte=0.0)
        return self.model_copy(update={"all_reduce": {**self.all_reduce, degree: free},
                                       "all_gather": {**self.all_gather, degree: free}})

    def merge(self, other: "CommModel") -> "CommModel":
        """`other`'s fits override this one's, degree by degree."""
        return CommModel(send=other.send, all_reduce={**self.all_reduce, **other.all_reduce},
                         all_gather={**self.all_gather, **other.all_gather},
                         hop=other.hop if other.hop is not None else self.hop)
