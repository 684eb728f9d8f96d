"""The batching baselines ConcatBatching is measured against (TCB §6.1), with the engine interface of
models/packed_text.py: `embed(token_ids) -> EngineResult`.

- Naive batching (TCB §6.1 "TNB"): requests in the order given, max_batch_size per batch, each padded to the
  longest of its batch.
- Length-sorted batching (TCB §6.1 "TTB", TurboTransformers, Fang et al. PPoPP'21 §5): the queue is sorted by
  length and cut into batches by dynamic programming that minimises the summed cost of the batches, where a
  batch of n requests padded to length l costs `cost(n, l)`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from models.packed_text import BatchStats, EngineResult
from models.text_encoder import TextEncoder

#: Cost of one forward pass of `n` requests padded to `l` tokens, in any unit (seconds, token-equivalents).
BatchCost = Callable[[int, int], float]
#: Default per-pass overhead of the token cost model, in token-equivalents (weights read, kernel launches).
DEFAULT_PASS_OVERHEAD_TOKENS = 64.0


def padded_token_cost(overhead_tokens: float = DEFAULT_PASS_OVERHEAD_TOKENS) -> BatchCost:
    """A batch costs the tokens it computes, padding included, plus a fixed overhead per forward pass."""
    return lambda n, length: n * length + overhead_tokens


def naive_batches(lengths: Sequence[int], max_batch_size: int) -> list[list[int]]:
    """TCB §6.1 TNB: consecutive chunks of max_batch_size requests in the order given."""
    indices = list(range(len(lengths)))
    return [indices[i:i + max_batch_size] for i in range(0, len(indices), max_batch_size)]


def sorted_dp_batches(lengths: Sequence[int], max_batch_size: int, cost: BatchCost | None = None) -> list[list[int]]:
    """TurboTransformers' batch splitting (TCB §6.1 TTB): sort by length, then DP over split points.

    best[i] = min over j in [i - max_batch_size, i) of best[j] + cost(i - j, length of the i-th shortest), i.e. the
    cheapest way to run the i shortest requests, the last batch being j..i-1 padded to its longest member.
    """
    cost = cost or padded_token_cost()
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    sorted_lengths = [lengths[i] for i in order]
    count = len(order)
    best = [0.0] + [float("inf")] * count
    split = [0] * (count + 1)
    for i in range(1, count + 1):
        for j in range(max(0, i - max_batch_size), i):
            candidate = best[j] + cost(i - j, sorted_lengths[i - 1])
            if candidate < best[i]:
                best[i], split[i] = candidate, j
    batches: list[list[int]] = []
    i = count
    while i > 0:
        batches.append(order[split[i]:i])
        i = split[i]
    return batches[::-1]


class PaddedBatchingEngine:
    """Runs batches padded to their longest member through the encoder's ordinary (padded) forward."""

    name = "padded"

    def __init__(self, encoder: TextEncoder, max_batch_size: int):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self.encoder = encoder
        self.max_batch_size = max_batch_size

    def batches(self, lengths: Sequence[int]) -> list[list[int]]:  # pragma: no cover - interface
        raise NotImplementedError

    def padded_batch(self, token_ids: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        width = max(len(ids) for ids in token_ids)
        pad = int(self.encoder.tokenizer.pad_token_id or 0)
        input_ids = torch.full((len(token_ids), width), pad, dtype=torch.long)
        mask = torch.zeros((len(token_ids), width), dtype=torch.long)
        for row, ids in enumerate(token_ids):
            input_ids[row, :len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
            mask[row, :len(ids)] = 1
        return {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(input_ids)}

    def embed(self, token_ids: Sequence[Sequence[int]]) -> EngineResult:
        lengths = [len(ids) for ids in token_ids]
        for index, length in enumerate(lengths):
            if length > self.encoder.max_length:
                raise ValueError(f"request {index} has {length} tokens, more than the model limit "
                                 f"{self.encoder.max_length}")
        stats = BatchStats()
        out = torch.empty(len(token_ids), self.encoder.hidden_size)
        for batch in self.batches(lengths):
            padded = self.padded_batch([token_ids[i] for i in batch])
            out[batch] = self.encoder.embed_tokens(padded)
            stats.add(len(batch), sum(lengths[i] for i in batch), int(padded["input_ids"].numel()))
        return EngineResult(embeddings=out, stats=stats)


class NaiveBatchingEngine(PaddedBatchingEngine):
    """TCB §6.1 TNB: pad to the longest request of each arrival-order batch."""

    name = "naive"

    def batches(self, lengths: Sequence[int]) -> list[list[int]]:
        return naive_batches(lengths, self.max_batch_size)


class SortedBatchingEngine(PaddedBatchingEngine):
    """TCB §6.1 TTB: length-sorted batches split by TurboTransformers' dynamic programming."""

    name = "sorted"

    def __init__(self, encoder: TextEncoder, max_batch_size: int, cost: BatchCost | None = None):
        super().__init__(encoder, max_batch_size)
        self.cost = cost or padded_token_cost()

    def batches(self, lengths: Sequence[int]) -> list[list[int]]:
        return sorted_dp_batches(lengths, self.max_batch_size, self.cost)
