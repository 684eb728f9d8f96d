"""Reproduction profiles shaped after Arlo's Fig. 2 (TensorRT Bert on an RTX 3090), named as such.

These are NOT measurements: they rebuild the paper's latency staircase from the figures its text states so the
simulator can run at Arlo's scale (hundreds of GPUs) on a CPU-only machine.

* Bert-Base, batch 1: a length-20 request on the 512 runtime takes 4.86 ms, 4.28x its own computation time
  (Arlo §2.2), and 512 tokens cost 4.22x what 64 tokens cost (§2.1).
* Bert-Large: 512 tokens cost 5.25x what 64 tokens cost (§2.1); its absolute scale (about 3x Bert-Base, the
  ratio of their FLOPs) is an assumption of this reproduction.
* Steps of 64 tokens, flat within a step (Arlo §3.3: "less than 5%"); between steps the latency grows linearly.
* Dynamic-shape runtimes (DT) are slower than static ones by 1.22x to 3.56x (§2.2); this reproduction uses the
  low end, 1.22x, on the unpadded length rounded up to 8 tokens, which favours DT.
* SLOs: 150 ms for Bert-Base and 450 ms for Bert-Large (§5).
"""

from __future__ import annotations

import math

from placement.arlo.runtimes import RuntimeProfile, RuntimeProfileSet

#: Arlo §3.3: the staircase step of TensorRT Bert.
PAPER_STEP_TOKENS = 64
PAPER_MAX_LENGTH_TOKENS = 512
#: Arlo §2.2: 4.86 ms for the 512 runtime (Bert-Base, batch 1).
BERT_BASE_512_S = 4.86e-3
#: Arlo §2.1: latency(512) / latency(64).
BERT_BASE_512_OVER_64 = 4.22
BERT_LARGE_512_OVER_64 = 5.25
#: Assumption of this reproduction: Bert-Large is ~3x Bert-Base (its FLOPs ratio).
BERT_LARGE_OVER_BASE = 3.0
#: Arlo §2.2: the smallest slowdown of a dynamic-shape runtime.
PAPER_DT_SLOWDOWN = 1.22
#: Granularity of a dynamic runtime's kernels (tokens), an assumption of this reproduction.
DT_ROUND_TOKENS = 8
#: Arlo §5: SLOs of the two request streams.
BERT_BASE_SLO_S = 0.150
BERT_LARGE_SLO_S = 0.450


def staircase_latency_s(model: str, length_tokens: int) -> float:
    """Batch-1 latency of a static runtime compiled for `length_tokens` (rounded up to its 64-token step)."""
    top, ratio = _scale(model)
    steps = math.ceil(max(length_tokens, 1) / PAPER_STEP_TOKENS)
    max_steps = PAPER_MAX_LENGTH_TOKENS // PAPER_STEP_TOKENS
    low = top / ratio
    return low + (top - low) * (steps - 1) / (max_steps - 1)


def dynamic_latency_s(model: str, length_tokens: int) -> float:
    """Batch-1 latency of the dynamic-shape runtime (DT) on an unpadded request."""
    top, ratio = _scale(model)
    low = top / ratio
    rounded = math.ceil(max(length_tokens, 1) / DT_ROUND_TOKENS) * DT_ROUND_TOKENS
    # Linear through the staircase's step tops, then the paper's dynamic-shape slowdown.
    static = low + (top - low) * (rounded - PAPER_STEP_TOKENS) / (PAPER_MAX_LENGTH_TOKENS - PAPER_STEP_TOKENS)
    return max(static, low * rounded / PAPER_STEP_TOKENS) * PAPER_DT_SLOWDOWN


def _scale(model: str) -> tuple[float, float]:
    if model == "bert-base":
        return BERT_BASE_512_S, BERT_BASE_512_OVER_64
    if model == "bert-large":
        return BERT_BASE_512_S * BERT_LARGE_OVER_BASE, BERT_LARGE_512_OVER_64
    raise ValueError(f"unknown paper model {model!r}; known: bert-base, bert-large")


def paper_slo_s(model: str) -> float:
    return {"bert-base": BERT_BASE_SLO_S, "bert-large": BERT_LARGE_SLO_S}[model]


def paper_runtime_profiles(model: str, lengths_tokens: list[int] | None = None,
                           slo_s: float | None = None) -> RuntimeProfileSet:
    """Batch-1 runtime profiles (Arlo serves with a fixed small batch) at the paper's 8 step tops by default."""
    lengths = lengths_tokens or list(range(PAPER_STEP_TOKENS, PAPER_MAX_LENGTH_TOKENS + 1, PAPER_STEP_TOKENS))
    slo = slo_s if slo_s is not None else paper_slo_s(model)
    runtimes = [RuntimeProfile(max_length_tokens=length, batch_latency_s={1: staircase_latency_s(model, length)},
                               max_batch_size=1, slo_s=slo) for length in lengths]
    return RuntimeProfileSet(model=model, source=f"paper:arlo-fig2-{model} (reproduction, not measured)",
                             runtimes=runtimes)
