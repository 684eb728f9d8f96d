"""Token merging (ToMe): bipartite soft matching, size-weighted merging and proportional attention.

ToMe (Bolya et al., "Token Merging: Your ViT But Faster", ICLR'23, §3) merges `r` tokens per block, between the
attention and the MLP; OTAS (otas-v2 §II-C, §III-B, Fig. 3b and Fig. 6) uses it for gamma < 0 with r = |gamma|:

1. split the tokens alternately into sets A (even positions) and B (odd positions);
2. every token of A picks its most similar token of B, by cosine similarity of the attention keys (averaged over
   heads); the class token never merges (its scores are -inf);
3. the r most similar edges are merged: the A token is folded into its B partner as a size-weighted average;
4. `size` counts how many patches a token stands for; attention adds log(size) to the keys' logits (proportional
   attention), so a merged token weighs as much as the patches it replaced.

Plain torch; no model code. `models/adaptive_vit.py` calls it inside every block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Merge:
    """A merge plan for one batch: which A tokens fold into which B tokens, and which stay unmerged.

    All index tensors are [batch, count, 1]; `apply` works on any [batch, tokens, channels] tensor that has the
    token order of the metric the plan was computed from.
    """

    unmerged_idx: torch.Tensor  # indices into set A of tokens kept as they are (sorted, so the class token stays first)
    source_idx: torch.Tensor  # indices into set A of the r tokens that merge away
    destination_idx: torch.Tensor  # indices into set B of their partners
    r: int

    def apply(self, x: torch.Tensor, reduce: str = "sum") -> torch.Tensor:
        """[B, N, C] -> [B, N - r, C]: unmerged A tokens first, then set B with the sources reduced into it."""
        set_a, set_b = x[:, ::2, :], x[:, 1::2, :]
        batch, num_a, channels = set_a.shape
        unmerged = set_a.gather(1, self.unmerged_idx.expand(batch, num_a - self.r, channels))
        sources = set_a.gather(1, self.source_idx.expand(batch, self.r, channels))
        set_b = set_b.scatter_reduce(1, self.destination_idx.expand(batch, self.r, channels), sources, reduce=reduce)
        return torch.cat([unmerged, set_b], dim=1)


def clamp_merge_count(num_tokens: int, r: int, num_protected: int = 1) -> int:
    """ToMe merges at most half of the unprotected tokens per block: r is clamped to (N - protected) // 2."""
    return max(0, min(r, (num_tokens - num_protected) // 2))


def bipartite_soft_matching(metric: torch.Tensor, r: int, class_token: bool = True) -> Merge | None:
    """ToMe §3 bipartite soft matching with alternate split; None when nothing merges.

    metric: [B, N, C] keys averaged over heads; the class token, when `class_token`, is at index 0 and protected.
    """
    if metric.dim() != 3:
        raise ValueError(f"metric must be [batch, tokens, channels], got shape {list(metric.shape)}")
    r = clamp_merge_count(metric.shape[1], r, num_protected=1 if class_token else 0)
    if r <= 0:
        return None
    with torch.no_grad():
        metric = metric / metric.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(metric.dtype).tiny)
        set_a, set_b = metric[:, ::2, :], metric[:, 1::2, :]
        scores = set_a @ set_b.transpose(-1, -2)  # cosine similarity [B, |A|, |B|]
        if class_token:
            scores[:, 0, :] = -torch.inf
        best_score, best_partner = scores.max(dim=-1)
        edge_order = best_score.argsort(dim=-1, descending=True)[..., None]
        unmerged_idx = edge_order[:, r:, :].sort(dim=1).values  # keep original order: class token first
        source_idx = edge_order[:, :r, :]
        destination_idx = best_partner[..., None].gather(1, source_idx)
    return Merge(unmerged_idx=unmerged_idx, source_idx=source_idx, destination_idx=destination_idx, r=r)


def merge_weighted_average(merge: Merge, x: torch.Tensor, size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Size-weighted average merge (ToMe §3 "merging"): returns (merged tokens, their sizes).

    x: [B, N, C] tokens; size: [B, N, 1] patches each token stands for. The total size is conserved.
    """
    merged = merge.apply(x * size, reduce="sum")
    merged_size = merge.apply(size, reduce="sum")
    return merged / merged_size, merged_size


def proportional_attention_bias(size: torch.Tensor) -> torch.Tensor:
    """ToMe §3 proportional attention: log(size) added to every query's logit for each key;
    [B, N, 1] -> [B, 1, 1, N]."""
    return size.log()[:, None, None, :, 0]
