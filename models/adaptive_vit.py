"""The unified adaptive ViT of OTAS: one timm VisionTransformer whose token count changes per call.

OTAS (otas-v2 §III-B, Fig. 6) inserts two modules in every transformer block:

* a prompt module before the attention: gamma > 0 inserts gamma learned prompt tokens per layer (VPT-deep,
  `ops/prompts.py`); each layer's prompts replace the previous layer's prompt outputs, so the prompt rows are
  dropped right after the attention, before the MLP;
* a merging module between the attention and the MLP: gamma < 0 merges r = |gamma| tokens per layer (ToMe,
  `ops/token_merging.py`) with proportional attention.

gamma = 0 runs timm's own blocks untouched, so it is the plain model bit for bit. gamma is an argument of every
call: no recompilation, no weight reload. Prompts are per sample ([B, depth, gamma, C]) so one batch can mix
tasks; the task registry (`models/task_registry.py`) looks them up and applies each task's head.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from timm.models.vision_transformer import Attention, Block, VisionTransformer
from torch import nn

from ops.prompts import drop_prompts, insert_prompts
from ops.token_merging import bipartite_soft_matching, merge_weighted_average, proportional_attention_bias

logger = logging.getLogger(__name__)

#: OTAS §V setup: the gamma selection list of ViT-Base (197 tokens, 12 layers).
PAPER_GAMMA_LIST = (-20, -15, -10, -5, 0, 2, 4, 8)
#: OTAS §V: ViT-Base/16 at 224 px has 196 patches + 1 class token, in 12 layers.
PAPER_NUM_TOKENS = 197
PAPER_DEPTH = 12


class AdaptiveVitConfig(BaseModel):
    """Architecture of the adaptive ViT (timm VisionTransformer arguments)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image_size_px: int = Field(default=32, ge=8, description="Input image side length in pixels.")
    patch_size_px: int = Field(default=4, ge=1, description="Patch side length in pixels.")
    in_chans: int = Field(default=1, ge=1, le=4, description="Input image channels.")
    embed_dim: int = Field(default=64, ge=8, description="Token feature dimension.")
    depth: int = Field(default=4, ge=1, description="Number of transformer blocks.")
    num_heads: int = Field(default=4, ge=1, description="Attention heads per block.")
    mlp_ratio: float = Field(default=4.0, gt=0, description="MLP hidden dimension over embed_dim.")
    num_classes: int = Field(default=10, ge=1, description="Classes of the backbone's own (pre-training) head.")

    @property
    def num_patches(self) -> int:
        return (self.image_size_px // self.patch_size_px) ** 2


def build_backbone(config: AdaptiveVitConfig) -> VisionTransformer:
    """A timm VisionTransformer with class-token pooling (needed by token merging: the class token is protected)."""
    return VisionTransformer(img_size=config.image_size_px, patch_size=config.patch_size_px, in_chans=config.in_chans,
                             num_classes=config.num_classes, embed_dim=config.embed_dim, depth=config.depth,
                             num_heads=config.num_heads, mlp_ratio=config.mlp_ratio, global_pool="token",
                             class_token=True, qkv_bias=True)


def scale_gamma_list(num_tokens: int, depth: int, paper_list: tuple[int, ...] = PAPER_GAMMA_LIST) -> list[int]:
    """Scale the paper's gamma list (ViT-B: 197 tokens, 12 layers) to a model with `num_tokens` and `depth`.

    Merging keeps the paper's fraction of tokens removed over the whole depth (r * depth / tokens); prompting keeps
    the paper's prompt counts scaled by tokens only (a prompt count is per layer). Duplicates collapse; 0 is kept.
    """
    merge_scale = (num_tokens * PAPER_DEPTH) / (PAPER_NUM_TOKENS * depth)
    prompt_scale = num_tokens / PAPER_NUM_TOKENS
    scaled = set()
    for gamma in paper_list:
        factor = merge_scale if gamma < 0 else prompt_scale
        value = int(round(gamma * factor))
        if gamma != 0 and value == 0:
            value = 1 if gamma > 0 else -1
        scaled.add(value)
    return sorted(scaled)


def _attention_with_size(attn: Attention, x: torch.Tensor,
                         size: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """timm `Attention.forward` plus ToMe's proportional attention; also returns the keys averaged over heads."""
    batch, num_tokens, _ = x.shape
    gate = attn.gate(x).sigmoid() if getattr(attn, "gate", None) is not None else None
    qkv = attn.qkv(x).reshape(batch, num_tokens, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    q, k = attn.q_norm(q), attn.k_norm(k)
    bias = proportional_attention_bias(size) if size is not None else None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=attn.attn_drop.p if attn.training else 0.0)
    out = out.transpose(1, 2).reshape(batch, num_tokens, attn.attn_dim)
    out = attn.norm(out)
    if gate is not None:
        out = out * gate
    out = attn.proj_drop(attn.proj(out))
    return out, k.mean(dim=1)


def merging_block_forward(block: Block, x: torch.Tensor, size: torch.Tensor | None,
                          r: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One block with ToMe merging between attention and MLP (OTAS Fig. 6, gamma < 0).

    `size` None means every token is one patch (nothing merged yet): the attention then needs no log-size bias and
    takes the same fused kernel as timm's own block.
    """
    attn_out, keys = _attention_with_size(block.attn, block.norm1(x), size)
    x = x + block.drop_path1(block.ls1(attn_out))
    merge = bipartite_soft_matching(keys, r, class_token=True)
    if merge is not None:
        if size is None:
            size = torch.ones(x.shape[0], x.shape[1], 1, dtype=x.dtype, device=x.device)
        x, size = merge_weighted_average(merge, x, size)
    x = x + block.drop_path2(block.ls2(block.mlp(block.norm2(x))))
    return x, size


def prompting_block_forward(block: Block, x: torch.Tensor, prompts: torch.Tensor,
                            num_prefix_tokens: int) -> torch.Tensor:
    """One block with VPT-deep prompts (OTAS Fig. 6, gamma > 0): insert, attend, drop the prompt rows before the MLP."""
    num_prompts = prompts.shape[1]
    x = insert_prompts(x, prompts, num_prefix_tokens)
    x = x + block.drop_path1(block.ls1(block.attn(block.norm1(x))))
    x = drop_prompts(x, num_prompts, num_prefix_tokens)
    x = x + block.drop_path2(block.ls2(block.mlp(block.norm2(x))))
    return x


class AdaptiveViT(nn.Module):
    """timm VisionTransformer + per-block prompt and merging modules; gamma chosen per call."""

    def __init__(self, vit: VisionTransformer):
        super().__init__()
        if vit.num_prefix_tokens != 1 or vit.cls_token is None:
            raise ValueError("the adaptive ViT needs exactly one prefix token, the class token (no register tokens)")
        if vit.global_pool != "token":
            raise ValueError("the adaptive ViT needs global_pool='token' (merging protects the class token), got "
                             f"{vit.global_pool!r}")
        self.vit = vit
        self.depth = len(vit.blocks)
        self.embed_dim = vit.embed_dim
        self.num_tokens = vit.patch_embed.num_patches + vit.num_prefix_tokens

    def check_gamma(self, gamma: int, prompts: torch.Tensor | None, batch: int) -> None:
        if not isinstance(gamma, int):
            raise ValueError(f"gamma must be an int, got {gamma!r}")
        if gamma > 0:
            expected = [batch, self.depth, gamma, self.embed_dim]
            if prompts is None or list(prompts.shape) != expected:
                got = None if prompts is None else list(prompts.shape)
                raise ValueError(f"gamma={gamma} needs prompts of shape {expected}, got {got}")
        elif prompts is not None:
            raise ValueError(f"prompts are only used with gamma > 0, got gamma={gamma}")

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """timm's patch embedding, class token, position embedding and pre-norm."""
        x = self.vit.patch_embed(images)
        x = self.vit._pos_embed(x)
        x = self.vit.patch_drop(x)
        return self.vit.norm_pre(x)

    def forward_features(self, images: torch.Tensor, gamma: int = 0,
                         prompts: torch.Tensor | None = None) -> torch.Tensor:
        """Token features after the final norm: [B, N', C] (N' = N at gamma >= 0, fewer when merging)."""
        self.check_gamma(gamma, prompts, images.shape[0])
        x = self.embed(images)
        if gamma == 0:
            for block in self.vit.blocks:
                x = block(x)
        elif gamma < 0:
            size = None
            for block in self.vit.blocks:
                x, size = merging_block_forward(block, x, size, -gamma)
        else:
            for layer, block in enumerate(self.vit.blocks):
                x = prompting_block_forward(block, x, prompts[:, layer], self.vit.num_prefix_tokens)
        return self.vit.norm(x)

    def pooled_features(self, images: torch.Tensor, gamma: int = 0,
                        prompts: torch.Tensor | None = None) -> torch.Tensor:
        """The class token's features before a head (timm's `forward_head(pre_logits=True)`): [B, C]."""
        return self.vit.forward_head(self.forward_features(images, gamma, prompts), pre_logits=True)

    def forward(self, images: torch.Tensor, gamma: int = 0, prompts: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the backbone's own head."""
        return self.vit.forward_head(self.forward_features(images, gamma, prompts))


def load_backbone(path: str | Path, config: AdaptiveVitConfig) -> AdaptiveViT:
    """Build the backbone from its config and load its local state dict (never downloads)."""
    vit = build_backbone(config)
    state = torch.load(Path(path), map_location="cpu", weights_only=True)
    vit.load_state_dict(state)
    logger.info("loaded adaptive ViT backbone from %s", path)
    return AdaptiveViT(vit.eval())
