"""Which model to load and how to cut one (stage, shard) out of its layer view.

`ModelSource` names a served model the way `placement.core.deployment_spec` does (kind + source + checkpoint), so
that a Ray actor can load it by itself. `build_stage_layers` keeps only the layers of one pipeline stage, and of each
block only this shard's slices of the weights (`parallel.tensor_parallel`); everything else is dropped so the actor
holds its share of the weights and no more. Embeddings and heads are kept whole (replicated over the stage's
shards).

`load_stage_layers` is what a stage actor runs: it builds the model without weights (`models.partial_load`) and
reads from the checkpoint only the tensors of its stage's layers, so its memory is its share even while loading.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from models.adaptive_vit_layers import (
    AdaptiveBackbone,
    AdaptiveBlockLayer,
    adaptive_input_state,
    load_adaptive_backbone,
)
from models.layers import ActivationState, Layer, run_layers
from models.mpnet_layers import MPNetBlockLayer
from models.partial_load import CheckpointTensors, load_named, meta_tensor_names, tensor_names
from parallel.tensor_parallel import (
    BlockShardingPlan,
    Collectives,
    TensorParallelBlock,
    TensorParallelBlockLayer,
    ThreadCollectives,
    bert_block_parts,
    vit_block_parts,
)

if TYPE_CHECKING:
    from parallel.plan import ParallelPlan


class ModelSource(BaseModel):
    """Where a model's weights come from; enough for an actor to load it on its own."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="The model's name in profiles and the deployment spec.")
    kind: Literal["text", "vision"] = Field(description="'text' for BERT-family encoders, 'vision' for timm ViTs.")
    source: str = Field(description="'package:NAME' (models/packaged.py), a local Hugging Face directory, or "
                        "'timm:<arch>'.")
    checkpoint_path: str | None = Field(default=None, description="Vision only: local state-dict file.")
    num_classes: int = Field(default=1000, ge=1, description="Vision only: classifier outputs.")
    image_size_px: int = Field(default=224, ge=1, description="Vision only: input side in pixels.")
    allow_random_init: bool = Field(default=False, description="Vision only: random weights (code-path tests only).")
    timm_kwargs: dict[str, int | float | str | bool] = Field(
        default_factory=dict, description="Vision only: extra timm.create_model arguments, e.g. depth, num_heads.")
    adaptive_artifacts: str | None = Field(
        default=None, description="Vision only: a token-adaptation (OTAS) artefacts directory; the stages then run its "
        "adaptive ViT backbone at each batch's gamma (models/adaptive_vit_layers.py) instead of `source`.")


def load_model(source: ModelSource, weights: Literal["all", "none"] = "all"):
    """The TextEncoder or VisionClassifier that `source` names (never downloads); weights="none" builds it with its
    parameters on the meta device and reads no weights (not for token-adaptation artefacts)."""
    if source.kind == "text":
        from models.text_encoder import load_text_encoder

        return load_text_encoder(source.source, name=source.name, weights=weights)
    if source.adaptive_artifacts is not None:
        if weights != "all":
            raise ValueError("a token-adaptation model (adaptive_artifacts) is always loaded whole")
        return load_adaptive_backbone(source.adaptive_artifacts, source.name)
    from models.vit import load_vit

    return load_vit(source.source, checkpoint_path=source.checkpoint_path, num_classes=source.num_classes,
                    image_size_px=source.image_size_px, name=source.name, allow_random_init=source.allow_random_init,
                    weights=weights, **source.timm_kwargs)


def import_loader(source: ModelSource) -> None:
    """Import the code that builds `source` (transformers and its architecture's module for text, timm for vision)
    without loading any weights, so that memory measured around a load is the model's, not the library's."""
    if source.kind == "text":
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_MAPPING

        from models.text_encoder import resolve_text_source

        MODEL_MAPPING[type(AutoConfig.from_pretrained(resolve_text_source(source.source), local_files_only=True))]
    else:
        import models.vit  # noqa: F401


def weight_file(source: ModelSource) -> tuple[Path, tuple[str, ...]] | None:
    """The checkpoint a stage can read its tensors from by name, with the key prefixes to try; None when the model
    has none to read by name (random-init stand-ins, token-adaptation artefacts: those are loaded whole)."""
    if source.kind == "text":
        from models.text_encoder import text_weight_file

        return text_weight_file(source.source), ("", TEXT_CHECKPOINT_PREFIX)
    if source.adaptive_artifacts is not None or source.checkpoint_path is None:
        return None
    return Path(source.checkpoint_path), ("",)


def _strip_vit(vit: nn.Module, keep_modules: set[str], keep_parameters: set[str]) -> nn.Module:
    """A shallow copy of a timm VisionTransformer that shares only the named submodules and parameters."""
    stripped = copy.copy(vit)
    stripped._modules = {name: (module if name in keep_modules else nn.Identity())
                         for name, module in vit._modules.items()}
    stripped._modules["blocks"] = nn.Sequential()
    stripped._parameters = {name: (p if name in keep_parameters else None) for name, p in vit._parameters.items()}
    stripped._buffers = dict(vit._buffers)
    return stripped


#: Key prefix of a BERT encoder's tensors when its checkpoint is a task model's (e.g. BertForMaskedLM's "bert.").
TEXT_CHECKPOINT_PREFIX = "bert."
#: timm ViT parts the embeddings layer runs (`patch_embed`, `_pos_embed`, `patch_drop`, `norm_pre`).
VIT_EMBEDDING_MODULES = {"patch_embed", "pos_drop", "patch_drop", "norm_pre"}
VIT_EMBEDDING_PARAMETERS = {"cls_token", "reg_token", "pos_embed"}
#: timm ViT parts the head layer runs (`norm`, `forward_head`).
VIT_HEAD_MODULES = {"norm", "attn_pool", "fc_norm", "head_drop", "head"}


def standalone_layers(model) -> list[Layer]:
    """The model's layer view with each layer holding only its own weights.

    The text encoder's layers already do; the ViT's embeddings and head layers hold the whole timm model, so they
    are rebuilt around stripped copies that share only the parts they run.
    """
    layers = model.layers()
    if getattr(model, "kind", None) != "vision":
        return layers
    from models.vit import VitEmbeddingsLayer

    vit = model.model
    result: list[Layer] = []
    for layer in layers:
        if layer.kind == "embeddings":
            result.append(VitEmbeddingsLayer(_strip_vit(vit, VIT_EMBEDDING_MODULES, VIT_EMBEDDING_PARAMETERS)))
        elif layer.kind == "head":  # the classifier head, or the adaptive ViT's pooled features
            result.append(type(layer)(_strip_vit(vit, VIT_HEAD_MODULES, set())))
        else:
            result.append(layer)
    return result


def shard_block_layer(layer: Layer, kind: str, plan: BlockShardingPlan, collectives: Collectives) -> Layer:
    """This shard's part of one block layer; the layer itself when nothing is split."""
    if collectives.degree == 1 or plan.is_replicated():
        return layer
    if isinstance(layer, AdaptiveBlockLayer):
        raise ValueError("the adaptive ViT's blocks (token merging, prompts) are not split by tensor parallelism: "
                         "a token-adaptation model needs intra_op_degree 1 in its group")
    if isinstance(layer, MPNetBlockLayer):
        raise ValueError("MPNet's blocks (a relative position bias per head) are not split by tensor parallelism: an "
                         "MPNet model needs intra_op_degree 1 in its group")
    parts = bert_block_parts(layer.block) if kind == "text" else vit_block_parts(layer.block)
    return TensorParallelBlockLayer(TensorParallelBlock(parts, plan, collectives), uses_attention_bias=kind == "text")


@dataclass
class StageSlice:
    """Layers [start, end) of a model's layer view on one shard, and the weight bytes this shard holds."""

    layers: list[Layer]
    weight_bytes: int


def build_stage_layers(model, start: int, end: int, collectives: Collectives,
                       plans: dict[int, BlockShardingPlan] | None = None) -> StageSlice:
    """Cut layers [start, end) out of `model` for shard `collectives.rank`; block i is split by `plans[i]`."""
    layers = standalone_layers(model)
    if not 0 <= start < end <= len(layers):
        raise ValueError(f"stage layers [{start}, {end}) outside the model's {len(layers)} layers")
    plans = plans or {}
    kind = getattr(model, "kind", "text")
    stage: list[Layer] = []
    for index in range(start, end):
        layer = layers[index]
        if layer.kind == "block":
            layer = shard_block_layer(layer, kind, plans.get(index, BlockShardingPlan.replicated()), collectives)
        stage.append(layer.eval())
    held = nn.ModuleList(stage)
    weight_bytes = _unique_parameter_bytes(held)
    return StageSlice(layers=stage, weight_bytes=weight_bytes)


def load_stage_layers(source: ModelSource, start: int, end: int, collectives: Collectives,
                      plans: dict[int, BlockShardingPlan] | None = None,
                      on_skeleton: Callable[[], object] | None = None) -> StageSlice:
    """Layers [start, end) of `source` for shard `collectives.rank`, reading only their tensors from the checkpoint.

    The model is built with its parameters on the meta device; the tensors the stage's layers hold are read by
    name and everything else is never materialised; `on_skeleton` is called between the two (a stage actor
    measures its memory there). Models without a checkpoint to read by name are loaded whole and cut
    (`build_stage_layers`)."""
    checkpoint = weight_file(source)
    if checkpoint is None:
        return build_stage_layers(load_model(source), start, end, collectives, plans)
    model = load_model(source, weights="none")
    layers = standalone_layers(model)
    if not 0 <= start < end <= len(layers):
        raise ValueError(f"stage layers [{start}, {end}) outside the model's {len(layers)} layers")
    names = tensor_names(model.model, layers[start:end])
    del layers
    if on_skeleton is not None:
        on_skeleton()
    path, prefixes = checkpoint
    with CheckpointTensors(path, prefixes) as tensors:
        load_named(model.model, names, tensors)
    stage = build_stage_layers(model, start, end, collectives, plans)
    missing = meta_tensor_names(nn.ModuleList(stage.layers))
    if missing:
        raise ValueError(f"stage layers [{start}, {end}) of {source.name!r} hold tensors that are not in {path}: "
                         f"{missing[:5]}")
    return stage


def run_plan_in_process(model, plan: "ParallelPlan", state: ActivationState) -> ActivationState:
    """Run `plan` in one process, stage after stage, each stage's shards on threads (checks without Ray)."""
    import torch

    for stage in plan.stages:
        group = ThreadCollectives.group(plan.intra_op_degree)
        outputs: list = [None] * plan.intra_op_degree

        def shard(rank: int, stage=stage, group=group, outputs=outputs, state=state) -> None:
            with torch.inference_mode():
                sliced = build_stage_layers(model, stage.start_layer, stage.end_layer, group[rank], stage.block_plans())
                outputs[rank] = run_layers(sliced.layers, state)

        threads = [threading.Thread(target=shard, args=(rank,)) for rank in range(plan.intra_op_degree)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        state = outputs[0]
    return state


def _unique_parameter_bytes(module: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in list(module.parameters()) + list(module.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total


#: Token ids drawn for synthetic text inputs stay above the special tokens of BERT vocabularies.
_FIRST_PLAIN_TOKEN_ID = 1000


def example_input(model, batch_size: int, seq_len_tokens: int | None = None, seed: int = 0) -> ActivationState:
    """A deterministic input state for profiling and exactness checks (random tokens or images).

    Text: `seq_len_tokens` tokens per row, the last row half padding so the attention mask matters.
    """
    import torch


    generator = torch.Generator().manual_seed(seed)
    if getattr(model, "kind", None) == "vision":
        images = torch.randn(batch_size, model.in_chans, *model.image_size, generator=generator)
        if isinstance(model, AdaptiveBackbone):  # a token-adaptation backbone, measured at gamma 0 (the plain pass)
            return adaptive_input_state(images, 0, None)
        return ActivationState(hidden=images)
    if seq_len_tokens is None or seq_len_tokens < 2:
        raise ValueError(f"seq_len_tokens must be >= 2 for a text model, got {seq_len_tokens}")
    vocab = model.model.config.vocab_size
    ids = torch.randint(_FIRST_PLAIN_TOKEN_ID, vocab, (batch_size, seq_len_tokens), generator=generator)
    mask = torch.ones(batch_size, seq_len_tokens, dtype=torch.long)
    if batch_size > 1:
        mask[-1, seq_len_tokens // 2:] = 0
    return ActivationState(hidden=ids, attention_mask=mask, extras={"token_type_ids": torch.zeros_like(ids)})
