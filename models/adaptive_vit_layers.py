"""The adaptive ViT as a layer view, so that pipeline stages can run it at any gamma (OTAS §III-B inside a group).

`AdaptiveViT.forward_features` runs every block at one gamma: plain (gamma = 0), ToMe merging of -gamma tokens
per block (gamma < 0, OTAS Fig. 6) or gamma VPT-deep prompts per block (gamma > 0). Here each block is one
`Layer`, and what a block needs besides the hidden states travels in the activation state's extras: the batch's
gamma, its prompts [B, depth, gamma, C] (gamma > 0) and the merged tokens' sizes (gamma < 0). A stage actor holding
blocks [i, j) therefore runs its share of any batch at the gamma the OTAS scheduler chose for it, and the stage
cuts are the same as for a plain ViT. The last layer returns the class token's pooled features; each task's head
for that gamma runs where the task registry lives (the replica), since heads are per task.

`AdaptiveBackbone` is what a stage actor loads (`parallel.stage_layers.load_model`); `layers()` of it on one
process computes exactly `AdaptiveViT.pooled_features` (a test checks it).
"""

from __future__ import annotations

from pathlib import Path

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from models.adaptive_vit import AdaptiveViT, load_backbone, merging_block_forward, prompting_block_forward
from models.layers import ActivationState, Layer, parameter_bytes
from models.task_registry import BACKBONE_FILE, artifacts_config
from models.vit import VitEmbeddingsLayer

#: Extras keys of the adaptive ViT's activation state.
GAMMA_KEY = "gamma"
PROMPTS_KEY = "prompts"
TOKEN_SIZES_KEY = "token_sizes"


def adaptive_input_state(images: torch.Tensor, gamma: int, prompts: torch.Tensor | None) -> ActivationState:
    """The first stage's input: the images, the batch's gamma and (gamma > 0) each sample's prompts."""
    extras = {GAMMA_KEY: torch.tensor(int(gamma))}
    if prompts is not None:
        extras[PROMPTS_KEY] = prompts
    return ActivationState(hidden=images.float(), extras=extras)


class AdaptiveBlockLayer(Layer):
    """One transformer block at the state's gamma: plain, merging (gamma < 0) or prompting (gamma > 0)."""

    kind = "block"

    def __init__(self, block: nn.Module, index: int, num_prefix_tokens: int):
        super().__init__()
        self.block = block
        self.index = index
        self.num_prefix_tokens = num_prefix_tokens

    def forward(self, state: ActivationState) -> ActivationState:
        gamma = int(state.extras[GAMMA_KEY])
        extras = dict(state.extras)
        x = state.hidden
        if gamma == 0:
            x = self.block(x)
        elif gamma < 0:
            x, sizes = merging_block_forward(self.block, x, extras.get(TOKEN_SIZES_KEY), -gamma)
            if sizes is not None:
                extras[TOKEN_SIZES_KEY] = sizes
        else:
            x = prompting_block_forward(self.block, x, extras[PROMPTS_KEY][:, self.index], self.num_prefix_tokens)
        return ActivationState(hidden=x, extras=extras)


class AdaptivePooledHeadLayer(Layer):
    """Final norm and class-token pooling (timm's `forward_head(pre_logits=True)`): [B, C] features for the heads."""

    kind = "head"

    def __init__(self, vit: VisionTransformer):
        super().__init__()
        self.vit = vit

    def forward(self, state: ActivationState) -> ActivationState:
        return ActivationState(hidden=self.vit.forward_head(self.vit.norm(state.hidden), pre_logits=True))


class AdaptiveBackbone:
    """An adaptive ViT backbone with its layer view (what a group's stage actors load)."""

    kind = "vision"

    def __init__(self, name: str, backbone: AdaptiveViT):
        self.name = name
        self.backbone = backbone.eval()
        self.model = backbone.vit  # stage cutting strips copies of the timm model (parallel.stage_layers)
        self.in_chans = backbone.vit.patch_embed.proj.in_channels
        self.image_size = tuple(backbone.vit.patch_embed.img_size)
        vit = backbone.vit
        self._layers = ([VitEmbeddingsLayer(vit)]
                        + [AdaptiveBlockLayer(b, i, vit.num_prefix_tokens) for i, b in enumerate(vit.blocks)]
                        + [AdaptivePooledHeadLayer(vit)])

    def layers(self) -> list[Layer]:
        return list(self._layers)

    def weight_bytes(self) -> int:
        return parameter_bytes(self.backbone)


def load_adaptive_backbone(directory: str | Path, name: str) -> AdaptiveBackbone:
    """The backbone of a task-registry artefacts directory as a layer view (no task heads or prompts)."""
    return AdaptiveBackbone(name, load_backbone(Path(directory) / BACKBONE_FILE, artifacts_config(directory)))
