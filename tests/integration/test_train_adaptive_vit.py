"""The digits training script (shortened, as CI runs it), the task registry and its errors, the committed artefacts."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from models import train_adaptive_vit
from models.task_registry import DIGITS_ARTIFACTS_DIR, TaskModel, TaskRegistry
from models.train_adaptive_vit import DIGITS_TASKS, QUICK_ARCHITECTURE, load_digits_splits
from placement.otas.profile import OtasProfile

torch.set_num_threads(1)
MAX_ARTIFACT_BYTES = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits_vit")
    train_adaptive_vit.main(["--quick", "--out", str(out), "--threads", "1"])
    return out


@pytest.fixture(scope="module")
def registry(trained) -> TaskRegistry:
    return TaskRegistry.load(trained)


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    _, held_out = load_digits_splits()
    return held_out.images[:6]


def test_quick_training_writes_loadable_artifacts(trained, registry):
    meta = json.loads((trained / "config.json").read_text())
    assert set(meta["held_out_accuracy_by_prompt_count"]) == {t.task_id for t in DIGITS_TASKS}
    assert meta["architecture"]["embed_dim"] == QUICK_ARCHITECTURE.embed_dim
    assert registry.task_ids == sorted(t.task_id for t in DIGITS_TASKS)
    for task_id in registry.task_ids:
        assert sorted(registry.task(task_id).prompts) == [g for g in registry.gamma_list if g > 0]


def test_mixed_task_batch_gets_each_tasks_head(registry, images):
    task_ids = ["parity", "digit", "ge5", "digit_noisy", "digit", "parity"]
    for gamma in (min(registry.gamma_list), 0, max(registry.gamma_list)):
        logits = registry.logits(images, task_ids, gamma)
        assert [row.shape[0] for row in logits] == [2, 10, 2, 10, 10, 2]
        alone = registry.logits(images[1:2], ["digit"], gamma)[0]
        assert (alone - logits[1]).abs().max() <= 1e-5


def test_unknown_task_and_bad_images_are_value_errors_naming_the_problem(registry, images):
    with pytest.raises(ValueError, match="unknown task_id 'cifar'"):
        registry.logits(images[:1], ["cifar"], 0)
    with pytest.raises(ValueError, match=r"shape \[N, 1, 32, 32\]"):
        registry.logits(torch.zeros(1, 3, 32, 32), ["digit"], 0)
    with pytest.raises(ValueError, match="float32"):
        registry.logits(torch.zeros(1, 1, 32, 32, dtype=torch.int64), ["digit"], 0)
    nan_image = images[:1].clone()
    nan_image[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        registry.logits(nan_image, ["digit"], 0)
    with pytest.raises(ValueError, match="not in the configured gamma list"):
        registry.logits(images[:1], ["digit"], 3)
    with pytest.raises(ValueError, match="task_ids has 2 entries for 1 images"):
        registry.logits(images[:1], ["digit", "digit"], 0)


def test_make_query_validates_slo_and_utility(registry, images):
    query = registry.make_query("digit", images[0], arrival_s=1.0, slo_ms=600, utility=0.3)
    assert query.deadline_s == pytest.approx(1.6)
    with pytest.raises(ValueError, match="slo_ms"):
        registry.make_query("digit", images[0], arrival_s=1.0, slo_ms=0, utility=0.3)
    with pytest.raises(ValueError, match="utility"):
        registry.make_query("digit", images[0], arrival_s=1.0, slo_ms=600, utility=float("inf"))
    with pytest.raises(ValueError, match="unknown task_id"):
        registry.make_query("nope", images[0], arrival_s=1.0, slo_ms=600, utility=0.3)
    with pytest.raises(ValueError, match="shape"):
        registry.make_query("digit", images[0, 0], arrival_s=1.0, slo_ms=600, utility=0.3)


def test_register_checks_heads_and_prompts(registry, images):
    dim, depth = registry.model.embed_dim, registry.model.depth
    with pytest.raises(ValueError, match="already registered"):
        registry.register(TaskModel("digit", 10, {0: nn.Linear(dim, 10)}))
    with pytest.raises(ValueError, match="prompt count 0"):
        registry.register(TaskModel("new", 10, {2: nn.Linear(dim, 10)}))
    with pytest.raises(ValueError, match="must map"):
        registry.register(TaskModel("new", 10, {0: nn.Linear(dim + 1, 10)}))
    with pytest.raises(ValueError, match="prompts for count 2 must have shape"):
        registry.register(TaskModel("new", 3, {0: nn.Linear(dim, 3), 2: nn.Linear(dim, 3)},
                                    {2: torch.zeros(depth, 3, dim)}))
    registry.register(TaskModel("no_prompts", 3, {0: nn.Linear(dim, 3)}))
    assert registry.supported_gammas(["no_prompts"]) == [g for g in registry.gamma_list if g <= 0]
    with pytest.raises(ValueError, match="has no prompts for gamma=2"):
        registry.logits(images[:2], ["no_prompts", "digit"], 2)


@pytest.mark.skipif(not (DIGITS_ARTIFACTS_DIR / "config.json").exists(), reason="digits artefacts not trained yet")
def test_committed_artifacts_are_small_trained_and_profiled():
    sizes = [p.stat().st_size for p in DIGITS_ARTIFACTS_DIR.iterdir()]
    assert sum(sizes) <= MAX_ARTIFACT_BYTES
    registry = TaskRegistry.load(DIGITS_ARTIFACTS_DIR)
    _, held_out = load_digits_splits()
    held_out = held_out.subset(120)
    predictions = torch.tensor(registry.predict(held_out.images, ["digit"] * 120, 0))
    assert float((predictions == held_out.digits).float().mean()) >= 0.5  # chance is 0.1
    profile = OtasProfile.load(DIGITS_ARTIFACTS_DIR / "profile.json")
    assert set(profile.accuracy) == set(registry.task_ids)
    assert profile.gamma_list == registry.gamma_list


# ---- the replica's OTAS executor on the wall clock (plain asyncio; no Ray needed) ----------------------------------
@pytest.fixture(scope="module")
def executor_parts(trained):
    from models.adaptive_vit_profile import build_profile
    from rayserve_apps.engine.otas_executor import parse_otas_params

    profile = build_profile(trained, batch_sizes=[1, 4], repeats=1, held_out_subset=16)
    return profile, parse_otas_params({"artifacts": str(trained), "default_task": "digit"})


def test_otas_executor_answers_every_image_at_a_planned_gamma(registry, executor_parts, images):
    import asyncio

    from rayserve_apps.engine.otas_executor import OtasExecutor

    profile, params = executor_parts
    executor = OtasExecutor(registry, profile, params, default_slo_ms=60_000)

    async def scenario():
        return await asyncio.gather(executor.classify(images[:3]),
                                    executor.classify(images[3:5], "parity", utility=0.3))

    digits, parity = asyncio.run(scenario())
    assert [a["task"] for a in digits] == ["digit"] * 3 and [a["task"] for a in parity] == ["parity"] * 2
    for answers, task, rows in ((digits, "digit", slice(0, 3)), (parity, "parity", slice(3, 5))):
        gamma = answers[0]["gamma"]
        assert gamma in registry.gamma_list
        assert [a["label"] for a in answers] == registry.predict(images[rows], [task] * len(answers), gamma)
    assert executor.scheduler.ledger.counts["in_time"] == 5


def test_otas_executor_evicts_hopeless_queries_and_names_bad_fields(registry, executor_parts, images):
    import asyncio

    from rayserve_apps.engine.otas_executor import OtasExecutor, parse_otas_params
    from rayserve_apps.requests import RequestError

    profile, params = executor_parts
    executor = OtasExecutor(registry, profile, params, default_slo_ms=60_000)
    with pytest.raises(RequestError, match="evicted") as error:
        asyncio.run(executor.classify(images[:1], slo_ms=1e-6))
    assert error.value.status_code == 503 and executor.scheduler.ledger.counts["evicted"] == 1
    with pytest.raises(ValueError, match="unknown task_id"):
        asyncio.run(executor.classify(images[:1], "cifar"))
    with pytest.raises(ValueError, match="slo_ms"):
        asyncio.run(executor.classify(images[:1], slo_ms=-1))
    with pytest.raises(ValueError, match="batching.epsilon"):
        parse_otas_params({"batching": {"epsilon": 0}})


@pytest.mark.ray
@pytest.mark.skipif(not (DIGITS_ARTIFACTS_DIR / "profile.json").exists(), reason="digits artefacts not trained yet")
def test_vision_replica_runs_otas_on_the_trained_digits_model(ray_serve):
    import requests
    from ray import serve

    from rayserve_apps.app import build_app
    from rayserve_apps.contracts import APP_NAME

    spec = {"models": [{
        "name": "digits", "kind": "vision", "source": "timm:vit_tiny_patch16_224", "num_classes": 10,
        "image_size_px": 32, "in_chans": 1, "slo_ms": 30_000, "num_cpus_per_replica": 0.5,
        "policies": {"token_adaptation": {"name": "otas", "params": {"default_task": "digit"}}},
    }]}
    serve.run(build_app(spec), name=APP_NAME, route_prefix="/", blocking=False)
    try:
        _, held_out = load_digits_splits()
        images = held_out.images[:4]
        response = requests.post(f"{ray_serve}/v1/models/digits/classify", json={"images": images.tolist()},
                                 timeout=120)
        assert response.status_code == 200, response.text
        predictions = response.json()["predictions"]
        registry = TaskRegistry.load(DIGITS_ARTIFACTS_DIR)
        for prediction, image in zip(predictions, images):
            assert prediction["task"] == "digit" and prediction["gamma"] in registry.gamma_list
            assert prediction["label"] == registry.predict(image[None], ["digit"], prediction["gamma"])[0]
        bad = requests.post(f"{ray_serve}/v1/models/digits/classify",
                            json={"images": torch.zeros(1, 3, 32, 32).tolist()}, timeout=60)
        assert bad.status_code == 422
    finally:
        serve.delete(APP_NAME)


@pytest.mark.skipif(not (DIGITS_ARTIFACTS_DIR / "profile.json").exists(), reason="digits artefacts not trained yet")
def test_otas_executor_gamma_follows_the_load():
    """The committed digits model with its measured profile: lone queries run at the most accurate gamma; a burst
    of queries (an arrival rate near the model's capacity) runs at faster gammas (OTAS Alg. 2/3). The same
    executor and former serve the vision replica and a device group (only the backend differs)."""
    import asyncio

    from rayserve_apps.engine.otas_executor import OtasExecutor, parse_otas_params

    registry = TaskRegistry.load(DIGITS_ARTIFACTS_DIR)
    profile = OtasProfile.load(DIGITS_ARTIFACTS_DIR / "profile.json")
    executor = OtasExecutor(registry, profile, parse_otas_params({"default_task": "digit"}), default_slo_ms=1_000)
    _, held_out = load_digits_splits()
    pictures = held_out.images.repeat(BURST_QUERIES // len(held_out.images) + 1, 1, 1, 1)[:BURST_QUERIES]

    async def scenario():
        lone = [await executor.classify(pictures[i: i + 1], utility=LOW_UTILITY) for i in range(3)]
        burst = await asyncio.gather(*(executor.classify(pictures[i: i + 1], utility=LOW_UTILITY)
                                       for i in range(BURST_QUERIES)),
                                     return_exceptions=True)
        return lone, burst

    lone, burst = asyncio.run(scenario())
    lone_gammas = {answer[0]["gamma"] for answer in lone}
    burst_gammas = {answer[0]["gamma"] for answer in burst if not isinstance(answer, Exception)}
    assert lone_gammas == {max(registry.gamma_list)}, lone_gammas
    assert burst_gammas and min(burst_gammas) < min(lone_gammas), burst_gammas
    assert max(executor.scheduler.ledger.batch_sizes) > 1


#: Below OTAS Alg. 3's kappa (0.8): the load, not the utility alone, sets the gamma.
LOW_UTILITY = 0.5
BURST_QUERIES = 2048
