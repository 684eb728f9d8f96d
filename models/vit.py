"""Vision transformers built with timm from local checkpoints.

`load_vit("timm:vit_tiny_patch16_224", checkpoint_path=..., num_classes=10, image_size_px=32)` builds timm's
`VisionTransformer` with no pretrained download and loads a local state dict. Without a checkpoint the loader
refuses, unless `allow_random_init=True` is passed explicitly (tests of code paths only, never served as a model).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Literal

import timm
import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from models.layers import ActivationState, Layer, parameter_bytes, run_layers
from models.partial_load import parameters_on_meta

logger = logging.getLogger(__name__)

TIMM_SOURCE_PREFIX = "timm:"


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"checkpoint file {path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    return state


def check_image_batch(images: torch.Tensor, expected: tuple[int, int, int]) -> None:
    """Raise ValueError naming the expected shape when `images` is not a float [N, C, H, W] batch of `expected`."""
    if not isinstance(images, torch.Tensor):
        raise ValueError(f"images must be a tensor, got {type(images).__name__}")
    if images.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"images must be float32, got {images.dtype}")
    if images.dim() != 4 or tuple(images.shape[1:]) != tuple(expected):
        raise ValueError(f"images must have shape [N, {expected[0]}, {expected[1]}, {expected[2]}], got "
                         f"{list(images.shape)}")
    if not torch.isfinite(images).all():
        raise ValueError("images contain NaN or infinite values")


class VitEmbeddingsLayer(Layer):
    """Patch embedding, class token, position embedding (timm's `_pos_embed`), and the pre-norm."""

    kind = "embeddings"

    def __init__(self, vit: VisionTransformer):
        super().__init__()
        self.vit = vit

    def forward(self, state: ActivationState) -> ActivationState:
        x = self.vit.patch_embed(state.hidden)
        x = self.vit._pos_embed(x)
        x = self.vit.patch_drop(x)
        x = self.vit.norm_pre(x)
        return ActivationState(hidden=x, extras=state.extras)


class VitBlockLayer(Layer):
    kind = "block"

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, state: ActivationState) -> ActivationState:
        return ActivationState(hidden=self.block(state.hidden), extras=state.extras)


class VitHeadLayer(Layer):
    """Final norm, pooling and the classifier head (timm's `forward_head` after `norm`)."""

    kind = "head"

    def __init__(self, vit: VisionTransformer):
        super().__init__()
        self.vit = vit

    def forward(self, state: ActivationState) -> ActivationState:
        x = self.vit.norm(state.hidden)
        return ActivationState(hidden=self.vit.forward_head(x))


class VisionClassifier:
    """A timm ViT with its input contract (channels, image size) and its layer view."""

    kind = "vision"

    def __init__(self, name: str, model: VisionTransformer):
        self.name = name
        self.model = model.eval()
        self.in_chans = model.patch_embed.proj.in_channels
        self.image_size = tuple(model.patch_embed.img_size)
        self.num_classes = model.num_classes
        self._layers = [VitEmbeddingsLayer(model)] + [VitBlockLayer(b) for b in model.blocks] + [VitHeadLayer(model)]

    def layers(self) -> list[Layer]:
        return list(self._layers)

    def weight_bytes(self) -> int:
        return parameter_bytes(self.model)

    def check_images(self, images: torch.Tensor) -> None:
        """Raise ValueError naming the expected shape when `images` is not [N, C, H, W] float of this model."""
        check_image_batch(images, (self.in_chans, *self.image_size))

    @torch.inference_mode()
    def logits(self, images: torch.Tensor) -> torch.Tensor:
        self.check_images(images)
        device = next(self.model.parameters()).device
        return run_layers(self._layers, ActivationState(hidden=images.float().to(device))).hidden


def load_vit(source: str, checkpoint_path: str | Path | None = None, num_classes: int = 1000, image_size_px: int = 224,
             in_chans: int = 3, name: str | None = None, allow_random_init: bool = False,
             weights: Literal["all", "none"] = "all", **timm_kwargs) -> VisionClassifier:
    """Build a timm ViT from `timm:<architecture>` and load local weights; never downloads.

    weights="none": the parameters stay on the meta device and nothing is read (a pipeline stage then loads only
    its own tensors by name, `models.partial_load`)."""
    if not source.startswith(TIMM_SOURCE_PREFIX):
        raise ValueError(f"vision source must look like 'timm:<architecture>', got {source!r}")
    architecture = source[len(TIMM_SOURCE_PREFIX):]
    if architecture not in timm.list_models():
        raise ValueError(f"unknown timm architecture {architecture!r}")
    if checkpoint_path is None and not allow_random_init:
        raise ValueError(f"vision model {architecture!r} needs checkpoint_path: plexserve never downloads weights")
    with parameters_on_meta() if weights == "none" else contextlib.nullcontext():
        model = timm.create_model(architecture, pretrained=False, num_classes=num_classes, img_size=image_size_px,
                                  in_chans=in_chans, **timm_kwargs)
    if not isinstance(model, VisionTransformer):
        raise ValueError(f"{architecture!r} is not a timm VisionTransformer")
    if checkpoint_path is not None and weights == "all":
        missing, unexpected = model.load_state_dict(load_state_dict(checkpoint_path), strict=False)
        if missing or unexpected:
            raise ValueError(f"checkpoint {checkpoint_path} does not fit {architecture}: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
    logger.info("loaded ViT %s (%s, %d classes, %s px)", name or architecture,
                "no weights" if weights == "none" else checkpoint_path or "random init", num_classes, image_size_px)
    return VisionClassifier(name or architecture, model)
