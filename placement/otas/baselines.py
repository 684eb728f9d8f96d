"""Baseline token allocators that OTAS is compared with (otas-v2 §V "Baseline").

* `FixedGammaAllocator`: one gamma for every batch. gamma = 0 is the PetS-like server (shared foundation model,
  task heads, tokens unchanged); gamma < 0 is fixed ToMe merging; gamma > 0 is fixed VPT prompting.
* `ModelSwitchingAllocator`: INFaaS-like model adaptation: several model variants, one loaded at a time, chosen
  from the arrival rate; switching pays a load delay during which nothing runs. Here the variants are stand-ins:
  the adaptive ViT at fixed gammas (e.g. the most merged, plain, the most prompted) play the small, base and large
  ViT, and the delay is the measured weight-load time of the checkpoint.
"""

from __future__ import annotations

from typing import Sequence

from placement.otas.adaptive_batching import OtasBatch
from placement.otas.profile import OtasProfile
from placement.otas.token_allocation import AllocationPlan, RateToGamma


class FixedGammaAllocator:
    """Every batch at one gamma, in deadline order."""

    def __init__(self, profile: OtasProfile, gamma: int):
        if gamma not in profile.latency_s:
            raise ValueError(f"gamma {gamma} is not profiled; profiled gammas: {profile.gamma_list}")
        self.profile = profile
        self.gamma = gamma

    def allocate(self, batches: Sequence[OtasBatch], now_s: float, rate_rps: float,
                 since_start_s: float) -> AllocationPlan:
        order = sorted(batches, key=lambda b: b.deadline_s)
        return AllocationPlan(order, [self.gamma] * len(order), 0.0, "fixed")

    def min_latency_s(self, batch_size: int) -> float:
        return self.profile.batch_latency_s(self.gamma, batch_size)


class ModelSwitchingAllocator:
    """INFaaS-like: load the variant whose throughput covers the arrival rate; a switch costs `switch_delay_s`."""

    def __init__(self, profile: OtasProfile, variant_gammas: Sequence[int], switch_delay_s: float, batch_cap: int,
                 min_dwell_s: float = 1.0):
        if not variant_gammas:
            raise ValueError("variant_gammas must name at least one variant")
        self.profile = profile
        self.rate_to_gamma = RateToGamma.from_profile(profile.model_copy(update={"gamma_list": sorted(variant_gammas)}),
                                                      batch_cap)
        self.switch_delay_s = switch_delay_s
        self.min_dwell_s = min_dwell_s  # hysteresis: no switch within this time of the last one
        self.current = max(variant_gammas)
        self.last_switch_s = float("-inf")
        self.switches = 0

    def allocate(self, batches: Sequence[OtasBatch], now_s: float, rate_rps: float,
                 since_start_s: float) -> AllocationPlan:
        wanted = self.rate_to_gamma(rate_rps)
        setup_s = 0.0
        if wanted != self.current and now_s - self.last_switch_s >= self.min_dwell_s:
            self.current, self.last_switch_s, setup_s = wanted, now_s, self.switch_delay_s
            self.switches += 1
        order = sorted(batches, key=lambda b: b.deadline_s)
        return AllocationPlan(order, [self.current] * len(order), 0.0, "switching", setup_s=setup_s)

    def min_latency_s(self, batch_size: int) -> float:
        return self.profile.batch_latency_s(self.current, batch_size)
