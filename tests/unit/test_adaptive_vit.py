"""The unified adaptive ViT: exact at gamma = 0, modules off change nothing, VPT-deep replacement, merge schedule."""

from __future__ import annotations

import pytest
import torch

from models.adaptive_vit import (
    AdaptiveViT,
    AdaptiveVitConfig,
    build_backbone,
    merging_block_forward,
    prompting_block_forward,
    scale_gamma_list,
)
from ops.token_merging import clamp_merge_count

torch.set_num_threads(1)
TOLERANCE = 1e-5
CONFIG = AdaptiveVitConfig(embed_dim=32, depth=3, num_heads=2)


@pytest.fixture(scope="module")
def model() -> AdaptiveViT:
    torch.manual_seed(0)
    vit = build_backbone(CONFIG)
    with torch.no_grad():  # non-trivial class/position embeddings (timm initialises some to zero)
        vit.pos_embed.normal_(std=0.5)
        vit.cls_token.normal_(std=0.5)
    return AdaptiveViT(vit.eval())


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.randn(4, 1, 32, 32, generator=torch.Generator().manual_seed(1))


@torch.inference_mode()
def test_gamma_zero_is_the_plain_timm_model(model, images):
    assert (model(images, 0) - model.vit(images)).abs().max() <= TOLERANCE
    assert (model.forward_features(images, 0) - model.vit.forward_features(images)).abs().max() <= TOLERANCE


@torch.inference_mode()
def test_merging_module_with_nothing_to_merge_is_the_plain_block(model, images):
    x = model.embed(images)
    size = torch.ones(x.shape[0], x.shape[1], 1)
    for block in model.vit.blocks:
        merged, size_out = merging_block_forward(block, x, size, r=0)
        assert (merged - block(x)).abs().max() <= TOLERANCE
        assert torch.equal(size_out, size)
        x = block(x)


@torch.inference_mode()
def test_prompt_module_with_no_prompts_is_the_plain_block(model, images):
    x = model.embed(images)
    no_prompts = torch.zeros(x.shape[0], 0, x.shape[2])
    for block in model.vit.blocks:
        assert (prompting_block_forward(block, x, no_prompts, 1) - block(x)).abs().max() <= TOLERANCE
        x = block(x)


def reference_vpt_deep(model: AdaptiveViT, images: torch.Tensor, prompts: torch.Tensor) -> torch.Tensor:
    """VPT-deep as Jia et al. write it: prompt rows go through the whole block, the next layer overwrites them."""
    x = model.embed(images)
    count = prompts.shape[2]
    x = torch.cat([x[:, :1], prompts[:, 0], x[:, 1:]], dim=1)
    for layer, block in enumerate(model.vit.blocks):
        if layer > 0:
            x = torch.cat([x[:, :1], prompts[:, layer], x[:, 1 + count:]], dim=1)  # replace previous prompt outputs
        x = block(x)
    x = torch.cat([x[:, :1], x[:, 1 + count:]], dim=1)
    return model.vit.forward_head(model.vit.norm(x))


@torch.inference_mode()
def test_prompts_replace_the_previous_layers_prompt_outputs(model, images):
    prompts = torch.randn(images.shape[0], CONFIG.depth, 3, CONFIG.embed_dim)
    ours = model(images, 3, prompts)
    assert (ours - reference_vpt_deep(model, images, prompts)).abs().max() <= TOLERANCE
    features = model.pooled_features(images, 3, prompts)
    assert (features - model.pooled_features(images, 0)).abs().max() > 1e-3  # prompts do change the result (>> 1e-5)
    # Every layer's own prompts matter (the last layer's too).
    changed = prompts.clone()
    changed[:, -1] += torch.randn_like(changed[:, -1])  # (a constant shift would vanish in LayerNorm)
    assert (model.pooled_features(images, 3, changed) - features).abs().max() > 1e-3


@torch.inference_mode()
def test_mixed_task_batch_uses_each_samples_prompts(model, images):
    prompts = torch.randn(images.shape[0], CONFIG.depth, 2, CONFIG.embed_dim)
    batched = model(images, 2, prompts)
    for i in range(images.shape[0]):
        alone = model(images[i:i + 1], 2, prompts[i:i + 1])
        assert (alone - batched[i:i + 1]).abs().max() <= TOLERANCE


@torch.inference_mode()
@pytest.mark.parametrize("r", [1, 4, 12, 40])
def test_merging_follows_the_tome_schedule(model, images, r):
    expected = model.num_tokens
    for _ in range(CONFIG.depth):
        expected -= clamp_merge_count(expected, r)
    features = model.forward_features(images, -r)
    assert features.shape == (images.shape[0], expected, CONFIG.embed_dim)
    assert torch.isfinite(features).all()


def test_bad_gamma_and_prompt_shapes_are_value_errors(model, images):
    with pytest.raises(ValueError, match="needs prompts of shape"):
        model(images, 2)
    with pytest.raises(ValueError, match="needs prompts of shape"):
        model(images, 2, torch.randn(4, CONFIG.depth, 3, CONFIG.embed_dim))
    with pytest.raises(ValueError, match="only used with gamma > 0"):
        model(images, -2, torch.randn(4, CONFIG.depth, 2, CONFIG.embed_dim))
    with pytest.raises(ValueError, match="gamma must be an int"):
        model(images, 1.5)


def test_backbone_without_class_token_pooling_is_refused():
    vit = build_backbone(CONFIG)
    vit.global_pool = "avg"
    with pytest.raises(ValueError, match="global_pool"):
        AdaptiveViT(vit)


def test_paper_gamma_list_scales_to_token_count_and_depth():
    assert scale_gamma_list(197, 12) == [-20, -15, -10, -5, 0, 2, 4, 8]
    scaled = scale_gamma_list(65, 6)
    assert 0 in scaled and min(scaled) < -5 and max(scaled) >= 1


@torch.inference_mode()
@pytest.mark.parametrize("gamma", [0, -6, 4])
def test_layer_view_cut_into_stages_equals_pooled_features(model, images, gamma):
    """What a group's stage actors run: the layer view, cut into two stages with the stand-alone (stripped) layers
    of `parallel.stage_layers`, at the batch's gamma with its prompts in the state."""
    from models.adaptive_vit_layers import AdaptiveBackbone, adaptive_input_state
    from models.layers import run_layers
    from parallel.stage_layers import standalone_layers

    prompts = torch.randn(len(images), CONFIG.depth, gamma, CONFIG.embed_dim) if gamma > 0 else None
    expected = model.pooled_features(images, gamma, prompts)
    layers = standalone_layers(AdaptiveBackbone("tiny", model))
    assert len(layers) == CONFIG.depth + 2
    cut = 2
    middle = run_layers(layers[:cut], adaptive_input_state(images, gamma, prompts))
    served = run_layers(layers[cut:], middle).hidden
    assert served.shape == expected.shape and (served - expected).abs().max() <= TOLERANCE
    if gamma < 0:
        assert middle.hidden.shape[1] < model.num_tokens  # tokens were merged in the first stage already


def test_adaptive_blocks_refuse_tensor_parallel_sharding(model):
    from models.adaptive_vit_layers import AdaptiveBackbone
    from parallel.stage_layers import shard_block_layer
    from parallel.tensor_parallel import BlockShardingPlan, NoCollectives

    class TwoShards(NoCollectives):
        degree = 2

    block = AdaptiveBackbone("tiny", model).layers()[1]
    with pytest.raises(ValueError, match="intra_op_degree 1"):
        shard_block_layer(block, "vision", BlockShardingPlan.megatron(), TwoShards())
