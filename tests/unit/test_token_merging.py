"""ToMe bipartite soft matching: token counts, size conservation, class token protection, weighted averages."""

from __future__ import annotations

import pytest
import torch

from ops.prompts import drop_prompts, insert_prompts
from ops.token_merging import (
    bipartite_soft_matching,
    clamp_merge_count,
    merge_weighted_average,
    proportional_attention_bias,
)

torch.set_num_threads(1)


def test_merge_reduces_by_r_and_conserves_size():
    torch.manual_seed(0)
    x = torch.randn(3, 17, 8)
    size = torch.ones(3, 17, 1)
    merge = bipartite_soft_matching(x, r=5)
    merged, merged_size = merge_weighted_average(merge, x, size)
    assert merged.shape == (3, 12, 8) and merged_size.shape == (3, 12, 1)
    assert torch.allclose(merged_size.sum(dim=1), torch.full((3, 1), 17.0))
    # Size-weighted feature sums are conserved too (a weighted average redistributes nothing).
    assert torch.allclose((merged * merged_size).sum(dim=1), (x * size).sum(dim=1), atol=1e-5)


def test_class_token_is_never_merged_and_stays_first():
    torch.manual_seed(1)
    x = torch.randn(2, 11, 4)
    x[:, 0] = x[:, 1]  # the class token is identical to a B token: the most similar pair, yet protected
    merge = bipartite_soft_matching(x, r=5)
    merged, size = merge_weighted_average(merge, x, torch.ones(2, 11, 1))
    assert torch.equal(merged[:, 0], x[:, 0])
    assert torch.equal(size[:, 0], torch.ones(2, 1))


def test_most_similar_pairs_merge_into_their_average():
    # Tokens 2 (A) and 3 (B) are near-duplicates; all others are orthogonal-ish.
    x = torch.eye(9).unsqueeze(0)
    x[0, 2] = x[0, 3] + 0.01 * x[0, 2]
    size = torch.ones(1, 9, 1)
    size[0, 3] = 3.0  # token 3 already stands for 3 patches
    merge = bipartite_soft_matching(x, r=1)
    merged, merged_size = merge_weighted_average(merge, x, size)
    expected = (x[0, 2] * 1 + x[0, 3] * 3) / 4
    row = (merged_size[0, :, 0] == 4).nonzero().item()
    assert torch.allclose(merged[0, row], expected, atol=1e-6)


def test_merge_count_is_clamped_to_half_of_unprotected_tokens():
    assert clamp_merge_count(65, 40) == 32
    assert clamp_merge_count(3, 5) == 1
    assert bipartite_soft_matching(torch.randn(1, 65, 4), 0) is None
    merge = bipartite_soft_matching(torch.randn(1, 65, 4), 100)
    assert merge.r == 32


def test_proportional_attention_bias_is_log_size_per_key():
    size = torch.tensor([[[1.0], [2.0], [4.0]]])
    bias = proportional_attention_bias(size)
    assert bias.shape == (1, 1, 1, 3)
    assert torch.allclose(bias[0, 0, 0], torch.log(torch.tensor([1.0, 2.0, 4.0])))


def test_prompts_insert_after_prefix_and_drop_back():
    x = torch.randn(2, 5, 3)
    prompts = torch.randn(2, 4, 3)
    with_prompts = insert_prompts(x, prompts, num_prefix_tokens=1)
    assert with_prompts.shape == (2, 9, 3)
    assert torch.equal(with_prompts[:, 1:5], prompts) and torch.equal(with_prompts[:, 0], x[:, 0])
    assert torch.equal(drop_prompts(with_prompts, 4, 1), x)
    with pytest.raises(ValueError, match="prompts must be"):
        insert_prompts(x, torch.randn(3, 4, 3), 1)
