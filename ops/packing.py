"""ConcatBatching: pack variable-length requests into rows, with per-request positions (TCB §4.1, §4.2).

TCB (ICPP'22) §4.1 "pure ConcatBatching": several requests are concatenated in one batch row of at most L tokens.
Each request keeps its own positions (§4.1.1, separate positional encoding: position ids restart at 0 for every
request) and its own token-type ids, and attends only to itself (§4.1.2, Eq. 5-6: a block-diagonal mask M).
The mask lives in `ops/concat_attention.py`.

TCB §4.2 "slotted ConcatBatching": each row of L tokens is cut into fixed slots of z tokens, requests are
concatenated inside a slot, and attention is computed per slot (Eq. 8). Every part of a BERT layer but attention
acts on each token alone, so computing attention per slot is exactly the same as running every slot as a row of
its own: a slotted batch of R rows x (L // z) slots executes as up to R * (L // z) rows of z tokens.

A request is never truncated: one longer than the row (or slot) is a ValueError that names the request and the
limit. Rows are filled by first-fit-decreasing unless a scheduler (placement/tcb/batch_scheduler.py) already chose which
requests share a row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ops.pooling import DEFAULT_POOLING, Pooling, finish

#: Segment id of padding tokens; request i has segment id i + 1.
PADDING_SEGMENT = 0


@dataclass(frozen=True)
class Placement:
    """Where one request lies in the executed tensor."""

    request: int  #: index of the request in the packed list
    row: int  #: executed row (a slot's own row in the slotted variant)
    start: int  #: first token's column
    length: int  #: tokens of the request


@dataclass
class PackedBatch:
    """Requests concatenated into rows: the tensors of one forward pass and where each request lies.

    `input_ids`, `position_ids`, `token_type_ids` and `segment_ids` are [executed_rows, width]. `segment_ids` holds
    request index + 1 for every real token and 0 for padding; the block-diagonal mask is built from it.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    token_type_ids: torch.Tensor
    segment_ids: torch.Tensor
    placements: list[Placement]
    row_length_tokens: int  # TCB §5.1: L
    num_rows: int  # TCB §5.1: B, the logical rows the batch may use
    slot_size_tokens: int | None = None  # TCB Alg. 2: slot size z (None: pure ConcatBatching)

    @property
    def num_requests(self) -> int:
        return len(self.placements)

    @property
    def real_tokens(self) -> int:
        return sum(p.length for p in self.placements)

    @property
    def computed_tokens(self) -> int:
        """Token positions the forward pass computes, padding included."""
        return int(self.input_ids.numel())

    @property
    def padding_fraction(self) -> float:
        computed = self.computed_tokens
        return 0.0 if computed == 0 else 1.0 - self.real_tokens / computed

    @property
    def attention_mask(self) -> torch.Tensor:
        """[executed_rows, width] with 1 for real tokens and 0 for padding."""
        return (self.segment_ids != PADDING_SEGMENT).long()


def check_lengths(lengths: Sequence[int], limit_tokens: int, limit_name: str) -> None:
    """Raise ValueError naming the first request longer than the limit (no silent truncation)."""
    if limit_tokens < 1:
        raise ValueError(f"{limit_name} must be at least 1 token, got {limit_tokens}")
    for index, length in enumerate(lengths):
        if length < 1:
            raise ValueError(f"request {index} is empty; every request needs at least 1 token")
        if length > limit_tokens:
            raise ValueError(f"request {index} has {length} tokens, more than the limit {limit_name}={limit_tokens}")


def first_fit_decreasing(lengths: Sequence[int], capacity_tokens: int, max_bins: int | None = None,
                         limit_name: str = "row_length_tokens") -> list[list[int]]:
    """Bin packing by first-fit-decreasing: the longest request first, each into the first bin with room.

    Returns bins of request indices. Raises ValueError for a request longer than a bin, or when the requests
    need more than `max_bins` bins.
    """
    check_lengths(lengths, capacity_tokens, limit_name)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    for index in order:
        for b, room in enumerate(free):
            if lengths[index] <= room:
                bins[b].append(index)
                free[b] -= lengths[index]
                break
        else:
            bins.append([index])
            free.append(capacity_tokens - lengths[index])
    if max_bins is not None and len(bins) > max_bins:
        raise ValueError(f"{len(lengths)} requests ({sum(lengths)} tokens) need {len(bins)} bins of {capacity_tokens} "
                         f"tokens, more than the {max_bins} available")
    return bins


def slots_per_row(row_length_tokens: int, slot_size_tokens: int) -> int:
    """TCB Alg. 2 line 5: a row of L tokens holds L // z slots."""
    if slot_size_tokens < 1 or slot_size_tokens > row_length_tokens:
        raise ValueError(f"slot_size_tokens={slot_size_tokens} must be between 1 and "
                         f"row_length_tokens={row_length_tokens}")
    return row_length_tokens // slot_size_tokens


#: Row widths tried by `narrowest_rows` are multiples of this many tokens (and the full row length).
LAYOUT_WIDTH_STEP_TOKENS = 16


def narrowest_rows(lengths: Sequence[int], row_length_tokens: int, num_rows: int) -> list[list[int]]:
    """The same requests re-laid into the rows that compute the fewest positions: first-fit-decreasing into rows of
    width W <= row_length_tokens (W a multiple of LAYOUT_WIDTH_STEP_TOKENS, or L itself), at most num_rows rows,
    the W whose rows x longest row is smallest (the narrower on a tie, as attention costs W^2 per row).

    An execution-layout step after TCB's schedulers (§4.1, Alg. 1 and 2 choose which requests run, in B rows of
    L tokens): a scheduler fills rows to L, and a trimmed batch still computes every row as wide as the fullest
    one, so a few short texts in rows of a long model limit (L = 256 for MiniLM) cost up to a third more
    positions, and longer attention rows, than the same texts in narrower rows. The texts, hence the scheduler's
    decision and every answer, are unchanged. Returns bins of request indices (none for no request); ValueError as
    `first_fit_decreasing` when the requests do not fit num_rows rows of row_length_tokens.
    """
    if not lengths:
        return []
    longest = max(lengths)
    step = LAYOUT_WIDTH_STEP_TOKENS
    widths = sorted({w for w in range(-(-longest // step) * step, row_length_tokens, step) if w > 0}
                    | {row_length_tokens})
    best: tuple[int, list[list[int]]] | None = None
    for width in widths:
        if width < longest:
            continue
        bins = first_fit_decreasing(lengths, width)
        if len(bins) > num_rows:
            continue
        cost = len(bins) * max(sum(lengths[i] for i in b) for b in bins)
        if best is None or cost < best[0]:
            best = (cost, bins)
    if best is None:  # not even rows of the full length hold them: first_fit_decreasing names the limit
        return first_fit_decreasing(lengths, row_length_tokens, num_rows)
    return best[1]


def pack_requests(token_ids: Sequence[Sequence[int]], row_length_tokens: int, num_rows: int | None = None,
                  slot_size_tokens: int | None = None, bins: Sequence[Sequence[int]] | None = None,
                  token_type_ids: Sequence[Sequence[int]] | None = None, pad_token_id: int = 0,
                  trim: bool = True) -> PackedBatch:
    """Concatenate tokenized requests into rows (TCB §4.1) or into slots of rows (TCB §4.2).

    token_ids: one list of token ids per request, special tokens included.
    row_length_tokens: L, the most tokens of one row.  # TCB §5.1: L
    num_rows: B, the most rows (None: as many as first-fit-decreasing needs).  # TCB §5.1: B
    slot_size_tokens: z; each row is cut into L // z slots and attention runs per slot.  # TCB Alg. 2: z
    bins: a scheduler's choice of which requests share each row (pure) or each slot (slotted), as request indices;
        every request must appear once. Without it, rows (or slots) are filled by first-fit-decreasing.
    trim: execute only up to the longest used row (or slot) instead of the full width.
    """
    lengths = [len(ids) for ids in token_ids]
    if token_type_ids is not None and [len(t) for t in token_type_ids] != lengths:
        raise ValueError("token_type_ids must have one id per token of every request")
    width_limit = row_length_tokens if slot_size_tokens is None else slot_size_tokens
    limit_name = "row_length_tokens" if slot_size_tokens is None else "slot_size_tokens"
    if slot_size_tokens is not None:
        per_row = slots_per_row(row_length_tokens, slot_size_tokens)
    check_lengths(lengths, width_limit, limit_name)

    max_bins = None if num_rows is None else (num_rows if slot_size_tokens is None else num_rows * per_row)
    if bins is None:
        bins = first_fit_decreasing(lengths, width_limit, max_bins, limit_name)
    else:
        bins = _check_bins(lengths, bins, width_limit, limit_name, max_bins)
    logical_rows = num_rows if num_rows is not None else (
        len(bins) if slot_size_tokens is None else -(-len(bins) // per_row))

    used = [sum(lengths[i] for i in b) for b in bins]
    width = max(used, default=0) if trim else width_limit
    executed = len(bins)
    input_ids = torch.full((executed, width), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((executed, width), dtype=torch.long)
    types = torch.zeros((executed, width), dtype=torch.long)
    segment_ids = torch.full((executed, width), PADDING_SEGMENT, dtype=torch.long)
    placements: list[Placement | None] = [None] * len(lengths)
    for row, members in enumerate(bins):
        start = 0
        for index in members:
            length = lengths[index]
            end = start + length
            input_ids[row, start:end] = torch.as_tensor(list(token_ids[index]), dtype=torch.long)
            position_ids[row, start:end] = torch.arange(length)  # TCB §4.1.1: positions restart per request
            if token_type_ids is not None:
                types[row, start:end] = torch.as_tensor(list(token_type_ids[index]), dtype=torch.long)
            segment_ids[row, start:end] = index + 1
            placements[index] = Placement(request=index, row=row, start=start, length=length)
            start = end
    return PackedBatch(input_ids=input_ids, position_ids=position_ids, token_type_ids=types, segment_ids=segment_ids,
                       placements=list(placements), row_length_tokens=row_length_tokens, num_rows=logical_rows,
                       slot_size_tokens=slot_size_tokens)


def _check_bins(lengths: Sequence[int], bins: Sequence[Sequence[int]], width_limit: int, limit_name: str,
                max_bins: int | None) -> list[list[int]]:
    """Check a scheduler's assignment of requests to rows (or slots); drop empty ones."""
    seen = sorted(i for members in bins for i in members)
    if seen != list(range(len(lengths))):
        raise ValueError("bins must name every request exactly once")
    kept = [list(members) for members in bins if members]
    if max_bins is not None and len(kept) > max_bins:
        raise ValueError(f"{len(kept)} non-empty bins given, more than the {max_bins} the batch holds")
    for k, members in enumerate(kept):
        total = sum(lengths[i] for i in members)
        if total > width_limit:
            raise ValueError(f"bin {k} holds {total} tokens, more than {limit_name}={width_limit}")
    return kept


def unpack_token_states(hidden: torch.Tensor, batch: PackedBatch) -> list[torch.Tensor]:
    """[executed_rows, width, hidden] -> one [length, hidden] tensor per request, in request order."""
    return [hidden[p.row, p.start:p.start + p.length] for p in batch.placements]


def pooled_embeddings(hidden: torch.Tensor, batch: PackedBatch, pooling: Pooling = DEFAULT_POOLING) -> torch.Tensor:
    """Each request's sentence embedding from its own token states: [requests, hidden] (`ops.pooling`).

    The default is sentence-transformers' mean of the request's tokens, then L2 norm. CLS and last-token pooling take
    the request's own first and last token (positions restart per request, TCB §4.1.1)."""
    size = hidden.shape[-1]
    mode = pooling.mode
    if mode in ("cls", "last_token"):
        rows = torch.tensor([p.row for p in batch.placements], dtype=torch.long, device=hidden.device)
        columns = torch.tensor([p.start + (p.length - 1 if mode == "last_token" else 0) for p in batch.placements],
                               dtype=torch.long, device=hidden.device)
        return finish(hidden[rows, columns], pooling)
    flat = hidden.reshape(-1, size)
    segments = batch.segment_ids.reshape(-1).to(hidden.device)
    if mode == "max":
        maxima = torch.full((batch.num_requests + 1, size), torch.finfo(hidden.dtype).min, dtype=hidden.dtype,
                            device=hidden.device)
        maxima.scatter_reduce_(0, segments[:, None].expand(-1, size), flat, reduce="amax")
        return finish(maxima[1:], pooling)
    sums = torch.zeros(batch.num_requests + 1, size, dtype=hidden.dtype, device=hidden.device)
    sums.index_add_(0, segments, flat)
    counts = torch.tensor([0] + [p.length for p in batch.placements], dtype=hidden.dtype, device=hidden.device)
    counts = counts[1:, None].clamp(min=1)
    return finish(sums[1:] / (counts if mode == "mean" else counts.sqrt()), pooling)
