"""Ray Serve's own ways to serve many models, as its documentation shows them (issue 57's baselines).

* `build_deployments_app`: one deployment per model, `@serve.batch` and `autoscaling_config`
  (docs: "Dynamic Request Batching", "Ray Serve Autoscaling").
* `build_multiplexed_app`: one deployment per architecture whose replicas load models on demand from local disk,
  `@serve.multiplexed(max_num_models_per_replica=k)`, each request tagged with its model id
  (docs: "Model Multiplexing"); a model alone in its architecture gets a deployment of its own as above.

Both sit behind one small HTTP ingress deployment that serves plexserve's routes (`POST /v1/models/NAME/embed`,
`/classify`) and forwards each request by a deployment handle, with `multiplexed_model_id` for the multiplexed
deployments, so one client drives all three systems. The memory budget is a custom Ray resource
(`device_memory_bytes`, which the benchmark's Ray declares as devices x budget): each replica requests the weights
it may hold (one model; k models of its architecture when multiplexed), so Ray places no more replicas than the
devices' memory holds. `deployment_options` and `multiplexed_options` compute those settings without Ray.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

#: The ingress deployment's name.
INGRESS_NAME = "ModelsIngress"
#: The custom Ray resource standing for device memory (bytes).
MEMORY_RESOURCE = "device_memory_bytes"
#: `@serve.batch` settings (Serve's defaults) and the requests one replica takes (two full batches).
MAX_BATCH_SIZE, BATCH_WAIT_TIMEOUT_S = 10, 0.01
MAX_ONGOING_REQUESTS = 2 * MAX_BATCH_SIZE
#: Autoscaling as Serve's docs configure it: target ongoing requests per replica, at least one replica per model.
TARGET_ONGOING_REQUESTS = 2
#: Logical CPUs of each model replica and of the ingress (the session's Ray declares 8; memory binds first).
REPLICA_NUM_CPUS, INGRESS_NUM_CPUS = 0.25, 0.25
INGRESS_MAX_ONGOING_REQUESTS = 512
#: Torch threads per model replica (plexserve's stage actors use one too).
TORCH_THREADS = 1


def _deployment_name(model: str) -> str:
    return f"model-{model}"


def _mux_name(index: int) -> str:
    return f"mux-{index}"


def app_args(case, multiplexed: bool, load_log: str | None = None) -> dict[str, Any]:
    """The application args for `case` (a `_many_models_live.LiveCase`): the models, their weights and the budget."""
    return {"models": [{"name": m.name, "kind": m.kind, "source": m.source, "weight_bytes": m.weight_bytes,
                        "architecture": m.architecture, **m.fields} for m in case.models],
            "num_devices": case.num_devices, "device_memory_bytes": case.device_memory_bytes,
            "multiplexed": multiplexed, "load_log": load_log}


def deployment_options(model: dict, num_devices: int, device_memory_bytes: int) -> dict[str, Any]:
    """Serve options of one model's deployment: autoscaling from one replica up to as many as the devices' memory
    holds, each replica requesting the model's weight bytes of `device_memory_bytes`."""
    weight = int(model["weight_bytes"])
    if weight > device_memory_bytes:
        raise ValueError(f"model {model['name']!r} ({weight} bytes) does not fit the per-device memory budget "
                         f"({device_memory_bytes} bytes)")
    most = max(1, num_devices * (device_memory_bytes // weight))
    return {"name": _deployment_name(model["name"]), "max_ongoing_requests": MAX_ONGOING_REQUESTS,
            "autoscaling_config": {"min_replicas": 1, "initial_replicas": 1, "max_replicas": most,
                                   "target_ongoing_requests": TARGET_ONGOING_REQUESTS},
            "ray_actor_options": {"num_cpus": REPLICA_NUM_CPUS, "resources": {MEMORY_RESOURCE: float(weight)}}}


def multiplexed_layout(models: list[dict], num_devices: int, device_memory_bytes: int) -> list[dict[str, Any]]:
    """One deployment per architecture with more than one model: k = that architecture's models one device holds
    (at most all of them), each replica requesting k x the largest weight of the architecture; replicas added one
    at a time to the architecture with the most models per replica while they fit the devices (first fit by
    device, so that no replica straddles two devices). Models alone in their architecture get a plain deployment
    (one replica). Raises ValueError when a model does not fit a device or the first replicas do not fit."""
    by_arch: dict[str, list[dict]] = {}
    for m in models:
        if int(m["weight_bytes"]) > device_memory_bytes:
            raise ValueError(f"model {m['name']!r} ({int(m['weight_bytes'])} bytes) does not fit the per-device "
                             f"memory budget ({device_memory_bytes} bytes)")
        by_arch.setdefault(m["architecture"], []).append(m)
    free = [device_memory_bytes] * num_devices

    def place(size: int) -> bool:
        for d in range(num_devices):
            if free[d] >= size:
                free[d] -= size
                return True
        return False

    layout = []
    for index, (arch, members) in enumerate(sorted(by_arch.items(), key=lambda kv: -max(
            int(m["weight_bytes"]) for m in kv[1]))):
        weight = max(int(m["weight_bytes"]) for m in members)
        k = 1 if len(members) == 1 else max(1, min(len(members), device_memory_bytes // weight))
        entry = {"models": [m["name"] for m in members], "k": k, "replica_bytes": k * weight,
                 "multiplexed": len(members) > 1, "num_replicas": 0,
                 "name": _mux_name(index) if len(members) > 1 else _deployment_name(members[0]["name"])}
        if not place(entry["replica_bytes"]):
            raise ValueError(f"the first replica of {entry['name']} ({entry['replica_bytes']} bytes for "
                             f"{entry['models']}) does not fit the devices left")
        entry["num_replicas"] = 1
        layout.append(entry)
    while True:  # more replicas where most models share one
        candidates = sorted((e for e in layout if e["multiplexed"]),
                            key=lambda e: -len(e["models"]) / (e["num_replicas"] * e["k"]))
        for entry in candidates:
            useful = entry["num_replicas"] * entry["k"] < len(entry["models"]) * num_devices
            if useful and place(entry["replica_bytes"]):
                entry["num_replicas"] += 1
                break
        else:
            return layout


def multiplexed_options(entry: dict) -> dict[str, Any]:
    """Serve options of one multiplexed deployment of `multiplexed_layout`."""
    return {"name": entry["name"], "num_replicas": entry["num_replicas"], "max_ongoing_requests": MAX_ONGOING_REQUESTS,
            "ray_actor_options": {"num_cpus": REPLICA_NUM_CPUS,
                                  "resources": {MEMORY_RESOURCE: float(entry["replica_bytes"])}}}


def models_of_deployment(case, deployment: str, multiplexed: bool) -> set[str]:
    """The models a replica of `deployment` may hold."""
    if deployment.startswith("model-"):
        return {deployment[len("model-"):]}
    args = app_args(case, multiplexed)
    for entry in multiplexed_layout(args["models"], args["num_devices"], args["device_memory_bytes"]):
        if entry["name"] == deployment:
            return set(entry["models"])
    return set()


# ---- model loading (replica side) ----

def _load(model: dict):
    """A callable batch -> list of answers for `model`: sentence-transformers for text, the project's timm ViT loader
    for vision; weights read from local disk."""
    import numpy as np
    import torch

    torch.set_num_threads(TORCH_THREADS)
    if model["kind"] == "text":
        from sentence_transformers import SentenceTransformer

        from models.text_encoder import resolve_text_source

        encoder = SentenceTransformer(str(resolve_text_source(model["source"])), device="cpu")
        return lambda texts: encoder.encode(texts, normalize_embeddings=True).tolist()
    adaptation = (model.get("policies") or {}).get("token_adaptation") or {}
    if adaptation.get("name") == "otas":  # the adaptive ViT: its trained backbone and task heads, all tokens kept
        from models.task_registry import DIGITS_ARTIFACTS_DIR, TaskRegistry

        params = adaptation.get("params") or {}
        registry = TaskRegistry.load(params.get("artifacts") or DIGITS_ARTIFACTS_DIR)
        task = params.get("default_task") or registry.task_ids[0]

        def predict(images: list) -> list:
            with torch.inference_mode():
                return list(registry.predict(torch.as_tensor(np.asarray(images, dtype=np.float32)),
                                             [task] * len(images)))

        return predict
    from models.vit import load_vit

    vit = load_vit(model["source"], checkpoint_path=model.get("checkpoint_path"),
                   num_classes=model.get("num_classes") or 1000, image_size_px=model.get("image_size_px") or 224,
                   in_chans=model.get("in_chans") or 3, allow_random_init=model.get("checkpoint_path") is None,
                   **(model.get("timm_kwargs") or {}))

    def classify(images: list) -> list:
        with torch.inference_mode():
            logits = vit.logits(torch.as_tensor(np.asarray(images, dtype=np.float32)))
        return logits.argmax(dim=-1).tolist()

    return classify


def _items(model: dict, payload: dict) -> list:
    return payload["texts"] if model["kind"] == "text" else payload["images"]


def _answer(model: dict, results: list) -> dict:
    return {"embeddings": results} if model["kind"] == "text" else {"predictions": results}


def _log_load(path: str | None, model: str, seconds: float, weight_bytes: int) -> None:
    if path:
        with open(path, "a") as handle:
            handle.write(json.dumps({"model": model, "load_s": seconds, "weight_bytes": weight_bytes,
                                     "pid": os.getpid()}) + "\n")


# ---- the applications ----

def _ingress_class():
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    @serve.deployment(name=INGRESS_NAME, max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
                      ray_actor_options={"num_cpus": INGRESS_NUM_CPUS})
    class ModelsIngress:
        """HTTP ingress: `POST /v1/models/NAME/embed|classify` forwarded to the model's deployment."""

        def __init__(self, handles: dict, multiplexed: list[str]):
            self.handles = handles
            self.multiplexed = set(multiplexed)

        async def __call__(self, request: Request):
            parts = request.url.path.strip("/").split("/")
            if len(parts) != 4 or parts[:2] != ["v1", "models"] or parts[3] not in ("embed", "classify"):
                return JSONResponse({"error": {"type": "not_found", "message": "POST /v1/models/NAME/embed"}}, 404)
            name = parts[2]
            if name not in self.handles:
                return JSONResponse({"error": {"type": "model_not_found", "message": f"no model {name!r}"}}, 404)
            payload = await request.json()
            handle = self.handles[name]
            if name in self.multiplexed:
                handle = handle.options(multiplexed_model_id=name)
            return JSONResponse(await handle.remote(payload))

    return ModelsIngress


def _model_class():
    from ray import serve

    @serve.deployment
    class ModelDeployment:
        """One model, `@serve.batch` over the texts (or images) of concurrent requests."""

        def __init__(self, model: dict, load_log: str | None = None):
            self.model = model
            started = time.perf_counter()
            self.run = _load(model)
            _log_load(load_log, model["name"], time.perf_counter() - started, int(model["weight_bytes"]))

        @serve.batch(max_batch_size=MAX_BATCH_SIZE, batch_wait_timeout_s=BATCH_WAIT_TIMEOUT_S)
        async def infer(self, items: list) -> list:
            return self.run(items)

        async def __call__(self, payload: dict) -> dict:
            items = _items(self.model, payload)
            return _answer(self.model, list(await asyncio.gather(*(self.infer(item) for item in items))))

    return ModelDeployment


def _multiplexed_class(k: int):
    from ray import serve

    @serve.deployment
    class MultiplexedModels:
        """The models of one architecture; a replica holds at most k, loaded from local disk on first use and
        evicted least recently used (`@serve.multiplexed`). Concurrent requests are batched per model."""

        def __init__(self, models: list[dict], load_log: str | None = None):
            self.models = {m["name"]: m for m in models}
            self.load_log = load_log

        @serve.multiplexed(max_num_models_per_replica=k)
        async def get_model(self, model_id: str):
            model = self.models[model_id]
            started = time.perf_counter()
            run = await asyncio.to_thread(_load, model)
            _log_load(self.load_log, model_id, time.perf_counter() - started, int(model["weight_bytes"]))
            return run

        @serve.batch(max_batch_size=MAX_BATCH_SIZE, batch_wait_timeout_s=BATCH_WAIT_TIMEOUT_S)
        async def infer(self, keyed: list[tuple[str, Any]]) -> list:
            results: list = [None] * len(keyed)
            for model_id in dict.fromkeys(key for key, _ in keyed):
                run = await self.get_model(model_id)
                positions = [i for i, (key, _) in enumerate(keyed) if key == model_id]
                for i, answer in zip(positions, run([keyed[i][1] for i in positions])):
                    results[i] = answer
            return results

        async def __call__(self, payload: dict) -> dict:
            model_id = serve.get_multiplexed_model_id()
            model = self.models[model_id]
            items = _items(model, payload)
            return _answer(model, list(await asyncio.gather(*(self.infer((model_id, item)) for item in items))))

    return MultiplexedModels


def build_deployments_app(args: dict):
    """Serve application builder: one deployment per model (`@serve.batch`, autoscaling)."""
    model_class = _model_class()
    handles = {m["name"]: model_class.options(**deployment_options(m, args["num_devices"],
                                                                   args["device_memory_bytes"])
                                              ).bind(m, args.get("load_log"))
               for m in args["models"]}
    return _ingress_class().bind(handles, [])


def build_multiplexed_app(args: dict):
    """Serve application builder: one `@serve.multiplexed` deployment per architecture (plain deployments for
    models alone in theirs)."""
    by_name = {m["name"]: m for m in args["models"]}
    handles, multiplexed = {}, []
    for entry in multiplexed_layout(args["models"], args["num_devices"], args["device_memory_bytes"]):
        if entry["multiplexed"]:
            bound = _multiplexed_class(entry["k"]).options(**multiplexed_options(entry)).bind(
                [by_name[n] for n in entry["models"]], args.get("load_log"))
            multiplexed += entry["models"]
        else:
            (name,) = entry["models"]
            options = {key: value for key, value in deployment_options(
                by_name[name], args["num_devices"], args["device_memory_bytes"]).items() if key != "autoscaling_config"}
            options["num_replicas"] = entry["num_replicas"]
            bound = _model_class().options(**options).bind(by_name[name], args.get("load_log"))
        for name in entry["models"]:
            handles[name] = bound
    return _ingress_class().bind(handles, multiplexed)
