"""Train the adaptive ViT on scikit-learn's digits: a backbone, then per-task prompts and heads on it, frozen.

OTAS §III-B and §V ("We train the prompts for tasks offline"): one foundation model, and for every task a pair of
(prompts, head) per prompt count, trained separately with the backbone frozen. Here the foundation model is a small
timm ViT trained from scratch on the 8x8 digits upsampled to 32x32 (patch 4: 64 patch tokens + the class token,
so merging has room to work). The tasks are real and of different difficulty:

* ``parity``      even or odd digit (2 classes),
* ``ge5``         digit >= 5 (2 classes),
* ``digit``       the digit (10 classes),
* ``digit_noisy`` the digit under heavy, fixed Gaussian pixel noise (10 classes; the hardest).

Run ``python -m models.train_adaptive_vit`` (fixed seeds; writes models/artifacts/digits_vit/) or with ``--quick``
for a shortened run that tests the script (CI). Progress is logged per epoch.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from models.adaptive_vit import AdaptiveViT, AdaptiveVitConfig, build_backbone
from models.task_registry import DIGITS_ARTIFACTS_DIR, TaskModel, TaskRegistry

logger = logging.getLogger(__name__)

#: The configured gamma list: the paper's {-20, -15, -10, -5, 0, 2, 4, 8} (ViT-B, 197 tokens, 12 layers) with the
#: merge steps rescaled to 65 tokens in 6 layers (`scale_gamma_list` gives -13..-3; rounded to steps of 4 and
#: extended to -16 so that the largest reduction merges almost all tokens, as r=20 does on ViT-B) and the prompt
#: counts kept.
DIGITS_GAMMA_LIST = [-16, -12, -8, -4, 0, 2, 4, 8]
DIGITS_IMAGE_SIZE_PX = 32
DIGITS_MAX_PIXEL = 16.0  # sklearn digits pixels are 0..16
HELD_OUT_FRACTION = 0.3
NOISE_STD = 0.45  # digit_noisy: std of the Gaussian noise on the 8x8 image in [0, 1] units
NOISE_SEED = 1234
MAX_SHIFT_PX = 2.0  # backbone augmentation: random translation of up to 2 px at 32x32
LABEL_SMOOTHING = 0.1
WARMUP_FRACTION = 0.1
POS_EMBED_INIT_STD = 1.0


@dataclass(frozen=True)
class DigitsTask:
    task_id: str
    num_classes: int
    description: str
    noisy: bool = False

    def labels(self, digits: torch.Tensor) -> torch.Tensor:
        if self.task_id == "parity":
            return digits % 2
        if self.task_id == "ge5":
            return (digits >= 5).long()
        return digits


DIGITS_TASKS = [
    DigitsTask("parity", 2, "is the digit odd (1) or even (0)"),
    DigitsTask("ge5", 2, "is the digit >= 5"),
    DigitsTask("digit", 10, "which digit 0-9"),
    DigitsTask("digit_noisy", 10, "which digit 0-9, under heavy pixel noise", noisy=True),
]
DIGITS_TASKS_BY_ID = {task.task_id: task for task in DIGITS_TASKS}


@dataclass
class DigitsSplit:
    images: torch.Tensor  # [N, 1, 32, 32], normalised
    noisy_images: torch.Tensor  # the same digits with the fixed noise of `digit_noisy`
    digits: torch.Tensor  # [N] 0..9

    def task_data(self, task: DigitsTask) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.noisy_images if task.noisy else self.images), task.labels(self.digits)

    def subset(self, count: int) -> "DigitsSplit":
        return DigitsSplit(self.images[:count], self.noisy_images[:count], self.digits[:count])


def _to_model_images(pixels_8x8: np.ndarray) -> torch.Tensor:
    """[N, 64] pixels in [0, 1] -> [N, 1, 32, 32] bilinear upsampling, normalised to mean 0.5 / std 0.5."""
    x = torch.tensor(pixels_8x8, dtype=torch.float32).reshape(-1, 1, 8, 8)
    x = F.interpolate(x, size=(DIGITS_IMAGE_SIZE_PX, DIGITS_IMAGE_SIZE_PX), mode="bilinear", align_corners=False)
    return (x - 0.5) / 0.5


def load_digits_splits(seed: int = 0) -> tuple[DigitsSplit, DigitsSplit]:
    """(train, held-out) stratified splits of scikit-learn's digits; the noisy copies use a fixed noise seed."""
    data = load_digits()
    pixels = data.data / DIGITS_MAX_PIXEL
    noise = np.random.default_rng(NOISE_SEED).normal(0.0, NOISE_STD, size=pixels.shape)
    noisy = np.clip(pixels + noise, 0.0, 1.0)
    index = np.arange(len(pixels))
    train_idx, held_idx = train_test_split(index, test_size=HELD_OUT_FRACTION, random_state=seed, stratify=data.target)
    splits = []
    for idx in (train_idx, held_idx):
        splits.append(DigitsSplit(_to_model_images(pixels[idx]), _to_model_images(noisy[idx]),
                                  torch.tensor(data.target[idx], dtype=torch.long)))
    return splits[0], splits[1]


def random_shift(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Translate every image by up to MAX_SHIFT_PX pixels (bilinear, border filled with background)."""
    n = images.shape[0]
    shift = (torch.rand(n, 2, generator=generator) * 2 - 1) * (2 * MAX_SHIFT_PX / DIGITS_IMAGE_SIZE_PX)
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0] = theta[:, 1, 1] = 1.0
    theta[:, :, 2] = shift
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    background = images.amin()
    return F.grid_sample(images - background, grid, align_corners=False, padding_mode="zeros") + background


@dataclass(frozen=True)
class TrainingConfig:
    seed: int = 0
    backbone_epochs: int = 4
    prompt_epochs: int = 1
    batch_size: int = 32
    backbone_lr: float = 3e-3
    prompt_lr: float = 1e-2
    head_lr: float = 5e-3
    head_epochs: int = 60
    weight_decay: float = 0.05
    train_subset: int | None = None
    held_out_subset: int | None = None


QUICK_CONFIG = TrainingConfig(backbone_epochs=1, prompt_epochs=1, head_epochs=2, train_subset=96, held_out_subset=64)
#: --quick also shrinks the architecture so that CI tests the script in seconds.
QUICK_ARCHITECTURE = AdaptiveVitConfig(embed_dim=32, depth=2, num_heads=2)


def _batches(n: int, batch_size: int, generator: torch.Generator):
    order = torch.randperm(n, generator=generator)
    for start in range(0, n, batch_size):
        yield order[start:start + batch_size]


def _cosine_optimizer(params, lr: float, weight_decay: float, steps: int):
    """AdamW with a linear warm-up over the first WARMUP_FRACTION of the steps, then cosine decay."""
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    warmup = max(1, int(WARMUP_FRACTION * steps))
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=warmup),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, steps - warmup)),
    ], milestones=[warmup])
    return optimizer, scheduler


def train_backbone(train: DigitsSplit, held_out: DigitsSplit, arch: AdaptiveVitConfig,
                   config: TrainingConfig) -> AdaptiveViT:
    """Pre-train the foundation ViT on the clean 10-digit task (its own timm head)."""
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    vit = build_backbone(arch)
    with torch.no_grad():
        # Each token carries about one original pixel, so position carries most of the information: start the
        # position embedding at unit scale instead of timm's 0.02 (it learns much faster on digits).
        vit.pos_embed.normal_(std=POS_EMBED_INIT_STD)
    steps = config.backbone_epochs * -(-len(train.digits) // config.batch_size)
    optimizer, scheduler = _cosine_optimizer(vit.parameters(), config.backbone_lr, config.weight_decay, steps)
    for epoch in range(config.backbone_epochs):
        vit.train()
        total_loss = 0.0
        for idx in _batches(len(train.digits), config.batch_size, generator):
            logits = vit(random_shift(train.images[idx], generator))
            loss = F.cross_entropy(logits, train.digits[idx], label_smoothing=LABEL_SMOOTHING)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            total_loss += float(loss.detach()) * len(idx)
        vit.eval()
        with torch.inference_mode():
            accuracy = float((vit(held_out.images).argmax(-1) == held_out.digits).float().mean())
        logger.info("backbone epoch %d/%d: loss %.3f, held-out digit accuracy %.3f", epoch + 1, config.backbone_epochs,
                    total_loss / len(train.digits), accuracy)
    return AdaptiveViT(vit.eval().requires_grad_(False))


def train_head(model: AdaptiveViT, task: DigitsTask, train: DigitsSplit, config: TrainingConfig) -> nn.Linear:
    """Prompt count 0: a linear head on the frozen backbone's class-token features."""
    generator = torch.Generator().manual_seed(config.seed + 1)
    images, labels = train.task_data(task)
    with torch.inference_mode():
        features = model.pooled_features(images)
    head = nn.Linear(model.embed_dim, task.num_classes)
    steps = config.head_epochs * -(-len(labels) // config.batch_size)
    optimizer, scheduler = _cosine_optimizer(head.parameters(), config.head_lr, config.weight_decay, steps)
    for _ in range(config.head_epochs):
        for idx in _batches(len(labels), config.batch_size, generator):
            loss = F.cross_entropy(head(features[idx]), labels[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
    return head


def train_prompts(model: AdaptiveViT, task: DigitsTask, counts: list[int], head0: nn.Linear, train: DigitsSplit,
                  config: TrainingConfig) -> tuple[dict[int, torch.Tensor], dict[int, nn.Linear]]:
    """VPT-deep prompts and a head per prompt count, on the frozen backbone (OTAS §III-B).

    To fit a 2-core CPU, the counts of one task share one run (nested prompts): every step trains one count, cycling
    through `counts`, and count p uses the first p prompts of the largest set with its own head. The paper trains
    each (task, count) pair separately; the stored artefact has the same form (prompts and a head per count).
    """
    torch.manual_seed(config.seed + 100)
    generator = torch.Generator().manual_seed(config.seed + 100)
    prompts = nn.Parameter(torch.empty(model.depth, max(counts), model.embed_dim))
    nn.init.trunc_normal_(prompts, std=0.02)
    heads = {}
    for count in counts:
        heads[count] = nn.Linear(model.embed_dim, task.num_classes)
        heads[count].load_state_dict(head0.state_dict())
    images, labels = train.task_data(task)
    steps = config.prompt_epochs * -(-len(labels) // config.batch_size)
    head_params = [p for head in heads.values() for p in head.parameters()]
    optimizer, scheduler = _cosine_optimizer([{"params": [prompts], "lr": config.prompt_lr, "weight_decay": 0.0},
                                              {"params": head_params, "lr": config.head_lr}],
                                             config.prompt_lr, config.weight_decay, steps)
    step = 0
    for epoch in range(config.prompt_epochs):
        total_loss = 0.0
        for idx in _batches(len(labels), config.batch_size, generator):
            count = counts[step % len(counts)]
            step += 1
            batch_prompts = prompts[:, :count].unsqueeze(0).expand(len(idx), -1, -1, -1)
            logits = heads[count](model.pooled_features(images[idx], count, batch_prompts))
            loss = F.cross_entropy(logits, labels[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            total_loss += float(loss.detach()) * len(idx)
        logger.info("task %s prompts epoch %d/%d: loss %.3f", task.task_id, epoch + 1, config.prompt_epochs,
                    total_loss / len(labels))
    return {count: prompts[:, :count].detach().clone() for count in counts}, heads


def held_out_accuracy(registry: TaskRegistry, task: DigitsTask, held_out: DigitsSplit, gamma: int) -> float:
    images, labels = held_out.task_data(task)
    predictions = torch.tensor(registry.predict(images, [task.task_id] * len(labels), gamma))
    return float((predictions == labels).float().mean())


def train_all(out_dir: Path, config: TrainingConfig, arch: AdaptiveVitConfig | None = None,
              gamma_list: list[int] | None = None) -> TaskRegistry:
    """Train backbone, heads and prompts; save them to `out_dir`; return the registry."""
    torch.manual_seed(config.seed)
    arch = arch or AdaptiveVitConfig()
    gamma_list = gamma_list or DIGITS_GAMMA_LIST
    prompt_counts = [g for g in gamma_list if g > 0]
    train, held_out = load_digits_splits(config.seed)
    if config.train_subset:
        train = train.subset(config.train_subset)
    if config.held_out_subset:
        held_out = held_out.subset(config.held_out_subset)
    started = time.perf_counter()
    logger.info("training on %d digits, evaluating on %d held-out digits", len(train.digits), len(held_out.digits))
    model = train_backbone(train, held_out, arch, config)
    registry = TaskRegistry(model, arch, gamma_list)
    accuracies: dict[str, dict[int, float]] = {}
    for task in DIGITS_TASKS:
        head0 = train_head(model, task, train, config)
        prompts, heads = train_prompts(model, task, prompt_counts, head0, train, config)
        heads[0] = head0
        registry.register(TaskModel(task.task_id, task.num_classes, heads, prompts, task.description))
        accuracies[task.task_id] = {count: held_out_accuracy(registry, task, held_out, count)
                                    for count in [0] + prompt_counts}
        logger.info("task %s held-out accuracy by prompt count: %s", task.task_id, accuracies[task.task_id])
    registry.save(out_dir, extra_config={
        "data": "sklearn.datasets.load_digits, 8x8 upsampled to 32x32, stratified held-out fraction "
                f"{HELD_OUT_FRACTION} (seed {config.seed})",
        "training": config.__dict__,
        "held_out_accuracy_by_prompt_count": accuracies,
        "training_time_s": round(time.perf_counter() - started, 1),
    })
    logger.info("saved backbone and %d tasks to %s in %.0f s", len(DIGITS_TASKS), out_dir,
                time.perf_counter() - started)
    return registry


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DIGITS_ARTIFACTS_DIR, help="output directory of the artefacts")
    parser.add_argument("--quick", action="store_true", help="shortened training on a subset (tests the script)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    config = QUICK_CONFIG if args.quick else TrainingConfig()
    config = TrainingConfig(**{**config.__dict__, "seed": args.seed})
    registry = train_all(args.out, config, QUICK_ARCHITECTURE if args.quick else None)
    print(json.dumps({"out": str(args.out), "tasks": registry.task_ids, "gamma_list": registry.gamma_list}))


if __name__ == "__main__":
    main()
