"""Packing invariants of ConcatBatching (ops/packing.py, ops/concat_attention.py): no model needed."""

from __future__ import annotations

import random

import pytest
import torch

from ops.concat_attention import block_diagonal_mask, mask_kind_for
from ops.packing import first_fit_decreasing, narrowest_rows, pack_requests, pooled_embeddings, unpack_token_states
from ops.pooling import POOLING_MODES, Pooling, pool_padded


def _requests(count: int, seed: int = 0, low: int = 3, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 2000) for _ in range(rng.randint(low, high))] for _ in range(count)]


@pytest.mark.parametrize("slot", [None, 48])
def test_every_token_placed_once_with_own_positions(slot):
    requests = _requests(30)
    batch = pack_requests(requests, row_length_tokens=144, slot_size_tokens=slot)
    seen = torch.zeros(batch.input_ids.shape, dtype=torch.long)
    for index, (ids, p) in enumerate(zip(requests, batch.placements)):
        assert p.request == index and p.length == len(ids)
        assert batch.input_ids[p.row, p.start:p.start + p.length].tolist() == ids
        assert batch.position_ids[p.row, p.start:p.start + p.length].tolist() == list(range(len(ids)))
        assert (batch.segment_ids[p.row, p.start:p.start + p.length] == index + 1).all()
        seen[p.row, p.start:p.start + p.length] += 1
    assert seen.max() == 1
    assert int(seen.sum()) == batch.real_tokens == sum(map(len, requests))
    assert (batch.segment_ids == 0).sum() == batch.computed_tokens - batch.real_tokens
    width = slot or 144
    assert batch.input_ids.shape[1] <= width
    # rows (slots) respect the capacity
    for row in range(batch.input_ids.shape[0]):
        assert int((batch.segment_ids[row] > 0).sum()) <= width


def test_slotted_batch_respects_row_capacity_in_slots():
    requests = _requests(40, seed=3, high=30)
    batch = pack_requests(requests, row_length_tokens=96, num_rows=12, slot_size_tokens=32)
    assert batch.input_ids.shape[0] <= 12 * 3
    assert batch.slot_size_tokens == 32


def test_first_fit_decreasing_uses_few_bins():
    lengths = [60, 50, 40, 30, 20, 10, 10, 5, 5]
    bins = first_fit_decreasing(lengths, 100)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert len(bins) == 3  # 230 tokens: the fewest bins of 100
    assert all(sum(lengths[i] for i in b) <= 100 for b in bins)


def test_oversize_request_names_request_and_limit():
    requests = [[1] * 10, [1] * 200]
    with pytest.raises(ValueError, match=r"request 1 has 200 tokens.*row_length_tokens=128"):
        pack_requests(requests, row_length_tokens=128)
    with pytest.raises(ValueError, match=r"request 0 has 10 tokens.*slot_size_tokens=8"):
        pack_requests([[1] * 10], row_length_tokens=64, slot_size_tokens=8)


def test_too_many_requests_for_the_rows_is_an_error():
    with pytest.raises(ValueError, match="more than the 2 available"):
        pack_requests([[1] * 50] * 5, row_length_tokens=100, num_rows=2)


def test_scheduler_bins_are_kept_and_checked():
    requests = [[1] * 5, [2] * 6, [3] * 7]
    batch = pack_requests(requests, row_length_tokens=16, bins=[[2, 0], [1]])
    assert [p.row for p in batch.placements] == [0, 1, 0]
    assert batch.placements[0].start == 7
    with pytest.raises(ValueError, match="exactly once"):
        pack_requests(requests, row_length_tokens=16, bins=[[0], [1]])
    with pytest.raises(ValueError, match="bin 0 holds 18 tokens"):
        pack_requests(requests, row_length_tokens=16, bins=[[0, 1, 2]])


def test_block_diagonal_mask_forms():
    segments = torch.tensor([[1, 1, 2, 2, 2, 0]])
    allowed = block_diagonal_mask(segments, "bool")
    assert allowed.shape == (1, 1, 6, 6) and allowed.dtype == torch.bool
    assert allowed[0, 0, 0, 1] and not allowed[0, 0, 0, 2] and not allowed[0, 0, 4, 5] and allowed[0, 0, 5, 5]
    additive = block_diagonal_mask(segments, "additive", torch.float32)
    assert additive.dtype == torch.float32
    assert torch.equal(additive[0, 0] == 0, allowed[0, 0])
    assert additive.min() == torch.finfo(torch.float32).min


def test_mask_kind_refuses_boolean_for_eager():
    assert mask_kind_for("eager") == "additive"
    assert mask_kind_for("sdpa") == "bool"
    with pytest.raises(ValueError, match="wrong for 'eager'"):
        mask_kind_for("eager", "bool")


def test_unpack_and_pool_follow_placements():
    requests = _requests(7, seed=5, high=12)
    batch = pack_requests(requests, row_length_tokens=32)
    hidden = torch.randn(*batch.input_ids.shape, 4)
    states = unpack_token_states(hidden, batch)
    pooled = pooled_embeddings(hidden, batch, Pooling("mean", normalize=False))
    for index, p in enumerate(batch.placements):
        assert torch.equal(states[index], hidden[p.row, p.start:p.start + p.length])
        assert torch.allclose(pooled[index], states[index].mean(dim=0), atol=1e-6)


@pytest.mark.parametrize("mode", POOLING_MODES)
@pytest.mark.parametrize("normalize", [True, False])
def test_packed_pooling_equals_padded_pooling_of_each_request(mode, normalize):
    """Every pooling mode gives the same embedding from a packed row as from the request padded alone."""
    requests = _requests(6, seed=9, high=10)
    batch = pack_requests(requests, row_length_tokens=24)
    hidden = torch.randn(*batch.input_ids.shape, 5, dtype=torch.float64)
    pooling = Pooling(mode, normalize)
    packed = pooled_embeddings(hidden, batch, pooling)
    states = unpack_token_states(hidden, batch)
    width = max(len(s) for s in states)
    padded = torch.zeros(len(states), width + 3, 5, dtype=torch.float64)
    mask = torch.zeros(len(states), width + 3, dtype=torch.long)
    for index, state in enumerate(states):
        padded[index, :len(state)] = state
        padded[index, len(state):] = 100.0  # padding never reaches a pooled value
        mask[index, :len(state)] = 1
    assert torch.allclose(packed, pool_padded(padded, mask, pooling), atol=1e-12)
    first = states[0]
    expected = {"mean": first.mean(0), "cls": first[0], "max": first.amax(0), "last_token": first[-1],
                "mean_sqrt_len": first.sum(0) / len(first) ** 0.5}[mode]
    if normalize:
        expected = expected / expected.norm()
    assert torch.allclose(packed[0], expected, atol=1e-12)


def test_an_unknown_pooling_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="'weightedmean' is not supported"):
        Pooling("weightedmean")


def _positions(lengths: list[int], bins: list[list[int]]) -> int:
    return len(bins) * max(sum(lengths[i] for i in b) for b in bins)


def test_narrowest_rows_computes_fewer_positions_than_rows_filled_to_the_limit():
    """Short texts in rows of a long limit: the same texts in narrower rows, each once, within num_rows rows."""
    lengths = [len(r) for r in _requests(16, seed=3, low=10, high=34)]
    full = first_fit_decreasing(lengths, 256, 8)
    narrow = narrowest_rows(lengths, 256, 8)
    assert sorted(i for b in narrow for i in b) == list(range(len(lengths)))
    assert len(narrow) <= 8 and all(sum(lengths[i] for i in b) <= 256 for b in narrow)
    assert _positions(lengths, narrow) < _positions(lengths, full)
    packed = pack_requests([[7] * n for n in lengths], 256, num_rows=8, bins=narrow)
    assert packed.input_ids.shape[1] < 256 and packed.real_tokens == sum(lengths)


def test_narrowest_rows_keeps_full_rows_when_only_they_fit_and_names_the_limit_when_nothing_fits():
    assert narrowest_rows([120, 120, 10], 256, 1) == [[0, 1, 2]]  # narrower rows would need more than 1
    with pytest.raises(ValueError, match="more than the 1 available"):
        narrowest_rows([100, 100], 128, 1)


def test_narrowest_rows_of_no_request_is_no_row():
    assert narrowest_rows([], 256, 4) == []
