"""One device choice for every deployment and actor (`models.device`): CUDA exactly on a GPU cluster with a visible
GPU, `num_gpus` reserved (fractional when models share a device), CPU-only clusters unchanged. No GPU needed:
`torch.cuda.is_available` is mocked, and actor options are read without starting Ray."""

from __future__ import annotations

import pytest
import torch

from models.device import device_reservation, select_device
from parallel.group_runtime import ModelParallelGroup
from parallel.plan import ParallelPlan
from parallel.stage_layers import ModelSource
from placement.core.deployment_spec import parse_spec
from rayserve_apps.app import bind_polymorph_model, model_actor_options, model_device_resource
from rayserve_apps.replicas.group import MAX_MODELS_PER_GROUP


@pytest.mark.parametrize("resource, cuda_available, expected", [
    ("GPU", True, "cuda"), ("GPU", False, "cpu"), ("CPU", True, "cpu"), ("device", True, "cpu"),
    ("device", False, "cpu"),
])
def test_cuda_exactly_when_the_resource_is_a_gpu_and_torch_sees_one(monkeypatch, resource, cuda_available, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_available)
    assert select_device(resource) == torch.device(expected)


def test_reservation_is_num_gpus_on_gpus_a_logical_resource_elsewhere_and_nothing_for_cpu():
    assert device_reservation("GPU", 0.25) == {"num_gpus": 0.25}
    assert device_reservation("device", 0.25) == {"resources": {"device": 0.25}}
    assert device_reservation("device", 0.25, logical=False) == {}
    assert device_reservation("CPU", 1.0) == {}
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="share"):
            device_reservation("GPU", bad)


def _spec(device_resource: str, share: float | None = None):
    model = {"name": "minilm", "kind": "text", "source": "package:all-minilm-l6-v2", "num_cpus_per_replica": 0.5}
    if share is not None:
        model["device_share_per_replica"] = share
    return parse_spec({"cluster": {"num_devices": 1, "device_resource": device_resource}, "models": [model]})


def test_single_model_deployments_reserve_a_named_gpu_share_only_on_gpu_clusters():
    gpu = _spec("GPU", share=0.5)
    options = model_actor_options(gpu.model("minilm"), gpu.cluster.device_resource)
    assert options["num_gpus"] == 0.5 and options["num_cpus"] == 0.5
    # No share named (the default, and what a spec without a `cluster` section gets): no GPU reserved, so the
    # deployment starts on a machine without GPUs.
    assert "num_gpus" not in model_actor_options(_spec("GPU").model("minilm"), "GPU")
    for cpu_only in ("device", "CPU"):
        options = model_actor_options(_spec(cpu_only, share=0.5).model("minilm"), cpu_only)
        assert "num_gpus" not in options and "resources" not in options
    with pytest.raises(ValueError, match="device_share_per_replica"):
        _spec("GPU", share=2.0)


def test_a_single_model_replica_computes_on_the_gpu_only_when_it_reserved_a_share(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with_share, without = _spec("GPU", share=0.5).model("minilm"), _spec("GPU").model("minilm")
    assert select_device(model_device_resource(with_share, "GPU")) == torch.device("cuda")
    assert select_device(model_device_resource(without, "GPU")) == torch.device("cpu")
    assert select_device(model_device_resource(with_share, "device")) == torch.device("cpu")


def test_replica_models_take_their_inputs_to_the_device_of_their_weights():
    """The text replica's packed encoder and the vision replica's classifier move each batch to where the weights
    are (the meta device stands in for CUDA: a CPU input reaching meta weights would raise)."""
    from models import load_text_encoder
    from models.packed_text import PackedTextEncoder
    from models.vit import load_vit

    encoder = load_text_encoder()
    packed = PackedTextEncoder(encoder)
    batch = packed.pack(encoder.text_tokenizer.encode(["hello world", "a somewhat longer text"]), row_length_tokens=32)
    encoder.model.to("meta")
    assert packed.forward_packed(batch).device.type == "meta"
    classifier = load_vit("timm:vit_tiny_patch16_224", num_classes=10, image_size_px=32, in_chans=1,
                          allow_random_init=True)
    classifier.model.to("meta")
    assert classifier.logits(torch.zeros(2, 1, 32, 32)).device.type == "meta"


def test_polymorph_runtime_replicas_reserve_the_gpu_share():
    spec = _spec("GPU", share=0.25)
    app = bind_polymorph_model(spec.model("minilm"), {"capacities": {32: 4.0}}, "x", device_resource="GPU")
    assert app._bound_deployment.ray_actor_options["num_gpus"] == 0.25
    cpu_app = bind_polymorph_model(spec.model("minilm"), {"capacities": {32: 4.0}}, "x")
    assert "num_gpus" not in cpu_app._bound_deployment.ray_actor_options


@pytest.mark.parametrize("resource", ["GPU", "device"])
def test_group_stage_actors_take_their_models_share_of_the_device(monkeypatch, resource):
    # Options only: no actors, no Ray.
    monkeypatch.setattr(ModelParallelGroup, "_start", lambda self, reuse_actors=None: None)
    reservation = device_reservation(resource, 1.0 / MAX_MODELS_PER_GROUP)
    group = ModelParallelGroup(ModelSource(name="m", kind="vision", source="timm:vit_tiny_patch16_224"),
                               ParallelPlan.even(4, pipeline_stages=2), num_cpus_per_actor=0.0,
                               actor_resources=reservation.get("resources"),
                               num_gpus_per_actor=reservation.get("num_gpus", 0.0))
    options = group._actor_options(0)
    if resource == "GPU":  # Ray refuses "GPU" inside `resources`: it must be num_gpus
        assert options["num_gpus"] == 1.0 / MAX_MODELS_PER_GROUP and "resources" not in options
    else:
        assert options["num_gpus"] == 0.0 and options["resources"] == {"device": 1.0 / MAX_MODELS_PER_GROUP}


def test_select_device_returns_cuda_when_told_a_gpu_is_there():
    assert select_device("GPU", cuda_available=True) == torch.device("cuda")
    assert select_device("GPU", cuda_available=False) == torch.device("cpu")
    assert select_device("device", cuda_available=True) == torch.device("cpu")


_OTAS_MODEL = {"name": "digits", "kind": "vision", "source": "timm:vit_tiny_patch16_224", "num_classes": 10,
               "image_size_px": 32, "in_chans": 1, "num_cpus_per_replica": 0.5, "device_share_per_replica": 0.5,
               "policies": {"token_adaptation": {"name": "otas", "params": {"default_task": "digit"}}}}


def test_the_otas_vision_replica_computes_on_the_device_it_reserved(monkeypatch):
    """A token-adaptation (OTAS) replica with a GPU share puts the adaptive ViT, every task's heads and prompts on
    its device and takes each batch there, at every gamma (the meta device stands in for CUDA: a CPU input reaching
    meta weights would raise); without a GPU it stays on the CPU."""
    from rayserve_apps.replicas import vision

    monkeypatch.setattr(vision, "select_device",
                        lambda resource: torch.device("meta" if resource == "GPU" else "cpu"))
    replica = vision.VisionModelDeployment.func_or_class(_OTAS_MODEL, "GPU")
    registry = replica.otas.registry
    assert replica.device.type == registry.device.type == "meta"
    assert {p.device.type for p in registry.model.parameters()} == {"meta"}
    for task_id in registry.task_ids:
        task = registry.task(task_id)
        assert {p.device.type for head in task.heads.values() for p in head.parameters()} == {"meta"}
        assert {prompts.device.type for prompts in task.prompts.values()} <= {"meta"}
    images = torch.zeros(2, 1, 32, 32)
    for gamma in registry.gamma_list:
        logits = registry.logits(images, ["digit", "parity"], gamma)
        assert [(row.device.type, tuple(row.shape)) for row in logits] == [("meta", (10,)), ("meta", (2,))]
    # A group's stage actors send the backbone's features back as CPU tensors; the heads take them to their device.
    features = torch.zeros(2, registry.model.embed_dim)
    assert {row.device.type for row in registry.task_logits(features, ["digit", "ge5"], 0)} == {"meta"}
    cpu_replica = vision.VisionModelDeployment.func_or_class({**_OTAS_MODEL, "device_share_per_replica": None}, "CPU")
    assert {p.device.type for p in cpu_replica.otas.registry.model.parameters()} == {"cpu"}


def test_predictions_bring_rows_from_any_device_and_keep_mixed_task_widths():
    from rayserve_apps.engine.vision_batches import predictions

    mixed = predictions([torch.tensor([0.0, 3.0]), torch.tensor([5.0, 0.0, 1.0])], [{"task": "a"}, {"task": "b"}])
    assert [(p["label"], len(p["probabilities"]), p["task"]) for p in mixed] == [(1, 2, "a"), (0, 3, "b")]
    stacked = predictions(torch.tensor([[0.0, 2.0], [1.0, 0.0]]))
    assert [p["label"] for p in stacked] == [1, 0]
