"""The OTAS task registry: per-task prompts (one set per prompt count) and heads on one shared adaptive ViT.

OTAS §III-A (Fig. 5, "task register") and §IV ("TaskModel", "Register Task" / "Make Query" interfaces): a developer
registers a task with its prompts for the supported prompt counts and its classification head; a query names its
task, its latency requirement and its utility. `TaskRegistry.classify` runs one batch that may mix tasks: every
sample carries its task's prompts (gamma > 0) and goes through its task's head.

A task has one head per prompt count (0 included: the head used with gamma <= 0, i.e. plain and merged tokens),
because a head is trained together with its prompts. Unknown tasks, missing prompt counts, bad images and bad
query attributes raise ValueError naming the problem (the HTTP layer turns it into a 4xx).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from models.adaptive_vit import AdaptiveViT, AdaptiveVitConfig, load_backbone
from models.vit import check_image_batch

logger = logging.getLogger(__name__)

BACKBONE_FILE = "backbone.pt"
TASKS_FILE = "tasks.pt"
CONFIG_FILE = "config.json"


@dataclass
class TaskModel:
    """All parameters of one task (OTAS §IV TaskModel): a head per prompt count and prompts per positive count."""

    task_id: str
    num_classes: int
    heads: dict[int, nn.Linear]  # prompt count (0 = no prompts) -> head
    prompts: dict[int, torch.Tensor] = field(default_factory=dict)  # prompt count -> [depth, count, embed_dim]
    description: str = ""

    def head_for(self, gamma: int) -> nn.Linear:
        return self.heads[max(gamma, 0)]


@dataclass(frozen=True)
class Query:
    """One classification query as OTAS §III-C defines it: s_r arrival, l_r latency requirement, d_r = s_r + l_r,
    u_r."""

    task_id: str
    image: torch.Tensor  # [C, H, W]
    arrival_s: float  # s_r
    slo_s: float  # l_r
    utility: float  # u_r

    @property
    def deadline_s(self) -> float:  # d_r
        return self.arrival_s + self.slo_s


def artifacts_config(directory: str | Path) -> AdaptiveVitConfig:
    """The backbone architecture saved in an artefacts directory written by `TaskRegistry.save`."""
    path = Path(directory) / CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: train with `python -m models.train_adaptive_vit`")
    return AdaptiveVitConfig(**json.loads(path.read_text())["architecture"])


class TaskRegistry:
    """Registered tasks over one adaptive ViT; validates queries and runs mixed-task batches at a chosen gamma."""

    def __init__(self, model: AdaptiveViT, config: AdaptiveVitConfig, gamma_list: list[int] | None = None):
        self.model = model.eval()
        self.config = config
        self.gamma_list = sorted(gamma_list) if gamma_list is not None else [0]
        self._tasks: dict[str, TaskModel] = {}
        #: Where the backbone, heads and prompts live; `logits` takes each batch there (`to`).
        self.device = torch.device("cpu")

    def to(self, device: torch.device | str) -> "TaskRegistry":
        """Move the backbone and every task's heads and prompts to `device` (tasks registered later follow)."""
        self.device = torch.device(device)
        self.model.to(self.device)
        for task in self._tasks.values():
            self._move_task(task)
        return self

    def _move_task(self, task: TaskModel) -> None:
        for head in task.heads.values():
            head.to(self.device)
        task.prompts = {count: prompts.to(self.device) for count, prompts in task.prompts.items()}

    # ---- registration -------------------------------------------------------------------------------------------
    def register(self, task: TaskModel) -> None:
        """Register a task; raise ValueError naming the first inconsistent parameter."""
        if not task.task_id or not task.task_id.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"task_id must be a non-empty name of letters, digits, '_' or '-', got {task.task_id!r}")
        if task.task_id in self._tasks:
            raise ValueError(f"task {task.task_id!r} is already registered")
        if 0 not in task.heads:
            raise ValueError(f"task {task.task_id!r}: heads needs an entry for prompt count 0 (used with gamma <= 0)")
        for count, head in task.heads.items():
            if head.in_features != self.model.embed_dim or head.out_features != task.num_classes:
                raise ValueError(f"task {task.task_id!r}: head for prompt count {count} must map "
                                 f"{self.model.embed_dim} -> {task.num_classes}, "
                                 f"got {head.in_features} -> {head.out_features}")
        for count, prompts in task.prompts.items():
            expected = [self.model.depth, count, self.model.embed_dim]
            if count <= 0 or list(prompts.shape) != expected:
                raise ValueError(f"task {task.task_id!r}: prompts for count {count} must have shape {expected}, got "
                                 f"{list(prompts.shape)}")
            if count not in task.heads:
                raise ValueError(f"task {task.task_id!r}: prompt count {count} has prompts but no head")
        for module in task.heads.values():
            module.eval().requires_grad_(False)
        self._move_task(task)
        self._tasks[task.task_id] = task
        logger.info("registered task %s (%d classes, prompt counts %s)", task.task_id, task.num_classes,
                    sorted(task.prompts))

    @property
    def task_ids(self) -> list[str]:
        return sorted(self._tasks)

    def task(self, task_id: str) -> TaskModel:
        if task_id not in self._tasks:
            raise ValueError(f"unknown task_id {task_id!r}; registered tasks: {self.task_ids}")
        return self._tasks[task_id]

    def supported_gammas(self, task_ids: list[str]) -> list[int]:
        """The configured gammas every given task can run with (gamma > 0 needs prompts of that count)."""
        return [g for g in self.gamma_list if g <= 0 or all(g in self.task(t).prompts for t in task_ids)]

    # ---- queries ------------------------------------------------------------------------------------------------
    def check_images(self, images: torch.Tensor) -> None:
        """Raise ValueError naming the expected shape/dtype when `images` is not a batch this model takes."""
        check_image_batch(images, (self.config.in_chans, self.config.image_size_px, self.config.image_size_px))

    def make_query(self, task_id: str, image: torch.Tensor, arrival_s: float, slo_ms: float, utility: float) -> Query:
        """OTAS "Make Query": validate the task, the image, the latency requirement and the utility."""
        self.task(task_id)
        if not isinstance(image, torch.Tensor):
            raise ValueError(f"image must be a tensor, got {type(image).__name__}")
        self.check_images(image.unsqueeze(0))
        if not math.isfinite(slo_ms) or slo_ms <= 0:
            raise ValueError(f"slo_ms must be a positive number of milliseconds, got {slo_ms}")
        if not math.isfinite(utility) or utility < 0:
            raise ValueError(f"utility must be a finite number >= 0, got {utility}")
        return Query(task_id=task_id, image=image.float(), arrival_s=arrival_s, slo_s=slo_ms / 1000.0, utility=utility)

    # ---- execution ----------------------------------------------------------------------------------------------
    def batch_prompts(self, task_ids: list[str], gamma: int) -> torch.Tensor | None:
        """[B, depth, gamma, C]: each sample's task prompts for gamma > 0; None otherwise."""
        if gamma <= 0:
            return None
        stacks = {}
        for task_id in set(task_ids):
            task = self.task(task_id)
            if gamma not in task.prompts:
                raise ValueError(f"task {task_id!r} has no prompts for gamma={gamma}; it has prompt counts "
                                 f"{sorted(task.prompts)}")
            stacks[task_id] = task.prompts[gamma]
        return torch.stack([stacks[t] for t in task_ids])

    @torch.inference_mode()
    def logits(self, images: torch.Tensor, task_ids: list[str], gamma: int = 0) -> list[torch.Tensor]:
        """One forward pass of a mixed-task batch at `gamma` on the registry's device; each sample's logits (on that
        device) from its own task's head."""
        self.check_images(images)
        if len(task_ids) != images.shape[0]:
            raise ValueError(f"task_ids has {len(task_ids)} entries for {images.shape[0]} images")
        if gamma not in self.gamma_list:
            raise ValueError(f"gamma {gamma} is not in the configured gamma list {self.gamma_list}")
        prompts = self.batch_prompts(task_ids, gamma)
        features = self.model.pooled_features(images.float().to(self.device), gamma, prompts)
        return self.task_logits(features, task_ids, gamma)

    @torch.inference_mode()
    def task_logits(self, features: torch.Tensor, task_ids: list[str], gamma: int) -> list[torch.Tensor]:
        """Each sample's logits from its own task's head for `gamma`, given the backbone's pooled features [B, C]
        (from any device: a group's stage actors send them back as CPU tensors)."""
        features = features.to(self.device)
        out: list[torch.Tensor | None] = [None] * len(task_ids)
        for task_id in set(task_ids):
            rows = [i for i, t in enumerate(task_ids) if t == task_id]
            task_logits = self.task(task_id).head_for(gamma)(features[rows])
            for row, value in zip(rows, task_logits):
                out[row] = value
        return out  # type: ignore[return-value]

    def predict(self, images: torch.Tensor, task_ids: list[str], gamma: int = 0) -> list[int]:
        return [int(row.argmax()) for row in self.logits(images, task_ids, gamma)]

    # ---- persistence --------------------------------------------------------------------------------------------
    def save(self, directory: str | Path, extra_config: dict | None = None) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(self.model.vit.state_dict(), directory / BACKBONE_FILE)
        tasks = {
            task.task_id: {
                "num_classes": task.num_classes,
                "description": task.description,
                "heads": {count: head.state_dict() for count, head in task.heads.items()},
                "prompts": {count: prompts.detach().clone() for count, prompts in task.prompts.items()},
            }
            for task in self._tasks.values()
        }
        torch.save(tasks, directory / TASKS_FILE)
        config = {"architecture": self.config.model_dump(), "gamma_list": self.gamma_list, "tasks": self.task_ids}
        config.update(extra_config or {})
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> "TaskRegistry":
        """Load a backbone and its registered tasks saved by `save` (e.g. models/artifacts/digits_vit)."""
        directory = Path(directory)
        config = artifacts_config(directory)
        meta = json.loads((directory / CONFIG_FILE).read_text())
        registry = cls(load_backbone(directory / BACKBONE_FILE, config), config, meta["gamma_list"])
        tasks = torch.load(directory / TASKS_FILE, map_location="cpu", weights_only=True)
        for task_id, saved in tasks.items():
            heads = {}
            for count, state in saved["heads"].items():
                head = nn.Linear(config.embed_dim, saved["num_classes"])
                head.load_state_dict(state)
                heads[int(count)] = head
            registry.register(TaskModel(task_id=task_id, num_classes=saved["num_classes"], heads=heads,
                                        prompts={int(c): p for c, p in saved["prompts"].items()},
                                        description=saved.get("description", "")))
        return registry


#: Where the trained digits artefacts live inside the package.
DIGITS_ARTIFACTS_DIR = Path(__file__).resolve().parent / "artifacts" / "digits_vit"
