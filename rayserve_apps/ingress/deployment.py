"""The front door: HTTP routes and a Python handle API over the same validation and dispatch.

HTTP (FastAPI inside Ray Serve):
- `POST /v1/models/{name}/embed`     body `{"texts": [...]}` -> `{"model", "embeddings": [[...], ...],
  "ingress_latency_ms"}` in input order
- `POST /v1/models/{name}/classify`  body `{"images": [N][C][H][W], "dtype": "float32"|"uint8"}` or
  `{"images_base64": ["<PNG or JPEG>", ...]}`, optional `"top_k"`, and, for a
  token-adaptation (OTAS) model, optional `"task"`, `"slo_ms"`, `"utility"` -> `{"model", "predictions",
  "ingress_latency_ms"}`
- `GET  /v1/models`                  the served models with their kind and limits (also in OpenAI's list shape)
- `GET  /v1/models/{id}`             one served model as OpenAI's model object
- `GET  /v1/placement`               the live placement (groups, their models, replicas) or the per-model layout
- `GET  /v1/placement/history`       the placement controller's recent decisions (`?limit=N`)
- `GET  /v1/placement/recommended`   the controller's last recommended Serve config (`controller.mode: recommend`)
- `GET  /healthz`                     200 when every model can answer, else 503
- `POST /v1/embeddings`              OpenAI's embeddings API (`rayserve_apps/edge/openai_api.py`)
- `GET  /v2`, `/v2/health/live`, `/v2/health/ready`, `/v2/models/{name}[/versions/{version}]`,
  `.../ready`, `POST .../infer`     the KServe/Triton v2 protocol (`rayserve_apps/edge/kserve.py`)

Every error, FastAPI's own and the ingress's refusal past its bound (`edge/admission.py`) included, takes the
route's protocol's shape (`edge/errors.py`): `{"error": {"type", "message", "field"}}` on plexserve's routes,
OpenAI's `{"error": {"message", "type", "param", "code"}}` on its routes, `{"error": "<message>"}` on `/v2`.
Request and response bodies are pydantic models (`rayserve_apps/edge/schemas.py`) shown at `/docs`. A request's
clock starts when it arrives, or at its client's `X-Request-Start` header (`request_clock.py`).

Python: `handle.embed.remote(model, texts)`, `handle.classify.remote(model, images)` (each also takes `sent_at_s`,
the client's send time), `handle.list_models.remote()`
on the application's handle (`serve.get_app_handle("plexserve")`). Bad input raises `RequestError` (a
`ValueError`) there and becomes a 4xx JSON body over HTTP.
"""


import asyncio
import logging
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from models.device import CPU_RESOURCE
from models.text_encoder import TextTokenizer, load_text_tokenizer, text_embedding_width
from placement.alpaserve.placement_rollout import SlotLayout
from placement.core.deployment_spec import DeploymentSpec, ModelSpec, parse_spec
from placement.core.traffic_window import RequestRecord
from rayserve_apps import metrics
from rayserve_apps.contracts import polymorphing_params
from rayserve_apps.edge import kserve, native, openai_api
from rayserve_apps.edge.admission import Admission, AdmissionGate
from rayserve_apps.edge.answer import answer, embedding_lists, guarded
from rayserve_apps.edge.attainment import SloAttainment
from rayserve_apps.edge.errors import Protocol, error_response, install_error_handlers, protocol_of
from rayserve_apps.edge.health import group_info
from rayserve_apps.edge.schemas import (
    ERROR_RESPONSES,
    ClassifyRequest,
    ClassifyResponse,
    EmbedRequest,
    EmbedResponse,
    json_body,
)
from rayserve_apps.ingress.backends import Backend, GroupBackend, ModelDeploymentBackend, ModelRouterBackend
from rayserve_apps.ingress.request_clock import REQUEST_START_HEADER, Received, received_at, receiving
from rayserve_apps.ingress.traffic_reporter import TrafficReporter
from rayserve_apps.replicas.text import TextModelServer
from rayserve_apps.requests import (
    ImageContract,
    RequestError,
    check_images,
    check_query_options,
    check_texts,
    check_token_counts,
    find_model,
)

logger = logging.getLogger("ray.serve")

#: Decisions `GET /v1/placement/history` returns unless `?limit=` says otherwise.
DEFAULT_HISTORY_LIMIT = 20

app = FastAPI(title="plexserve", description="Many transformer models on one Ray cluster.")
install_error_handlers(app)
#: The bound this process's ingress replica keeps on what it holds (configured from the spec by `Ingress`).
ADMISSION = Admission()
app.add_middleware(AdmissionGate, admission=ADMISSION)


def describe_model(model: ModelSpec, text_limit: int | None) -> dict[str, Any]:
    """The public description of a served model, as `GET /v1/models` lists it."""
    description: dict[str, Any] = {"name": model.name, "kind": model.kind, "slo_ms": model.slo_ms}
    if model.kind == "text":
        description.update(max_input_length_tokens=text_limit, on_too_long=model.on_too_long,
                           endpoint=f"/v1/models/{model.name}/embed")
    else:
        description.update(image_shape=[model.in_chans, model.image_size_px, model.image_size_px],
                           num_classes=model.num_classes, endpoint=f"/v1/models/{model.name}/classify")
    return description


@serve.deployment
@serve.ingress(app)
class Ingress:
    """Validates, tokenizes and forwards each request to the deployment of its model, or, for a model with
    `in_ingress`, to its engine in this replica. `device_resource`: what those engines compute on (the cluster's
    device resource when this replica reserved a share of it)."""

    def __init__(self, spec: dict, model_handles: dict[str, DeploymentHandle] | None = None,
                 group_handles: list[DeploymentHandle] | None = None, controller: DeploymentHandle | None = None,
                 device_resource: str = CPU_RESOURCE):
        self.spec: DeploymentSpec = parse_spec(spec)
        self.group_handles = group_handles or []
        layout = SlotLayout.from_placement(self.spec.placement, len(self.group_handles))
        self.groups = GroupBackend(self.spec, self.group_handles, layout) if self.group_handles else None
        self.controller = controller
        self.traffic = (TrafficReporter(controller, self.spec.controller.stats_report_period_s)
                        if controller and self.spec.controller else None)
        batched = {m.name for m in self.spec.models
                   if m.kind == "text" and polymorphing_params(self.spec, m.name) is None}
        #: Models with `in_ingress` "always" or "when_idle": their engines run here, one per ingress replica.
        local = {m.name: TextModelServer(m.model_dump(mode="json"), self.spec.policy("batching", m.name),
                                         device_resource)
                 for m in self.spec.models if m.in_ingress != "never"}
        self.singles = ModelDeploymentBackend(model_handles or {}, batched, local)
        self.backend: Backend = ModelRouterBackend(self.groups, self.singles)
        self.attainment = SloAttainment()
        self.tokenizers: dict[str, TextTokenizer] = {
            m.name: load_text_tokenizer(m.source) for m in self.spec.models if m.kind == "text"
        }
        self.text_limits = {name: self._text_limit(name, tok) for name, tok in self.tokenizers.items()}
        #: Width of each text model's embeddings (OpenAI's `dimensions` is checked against it before any compute).
        self.text_widths = {m.name: text_embedding_width(m.source) for m in self.spec.models if m.kind == "text"}
        serving = self.spec.serving
        ADMISSION.configure(serving.ingress_max_ongoing_requests, serving.ingress_max_queued_requests,
                            serving.ingress_retry_after_s,
                            slo_s_by_model={m.name: m.slo_ms / 1000.0 for m in self.spec.models},
                            turns_slo_fraction=serving.ingress_turns_slo_fraction,
                            wait_slo_fraction=serving.ingress_wait_slo_fraction)
        self.edge = native.Edge(self.spec)

    def _text_limit(self, model: str, tokenizer: TextTokenizer) -> int:
        """Most tokens a text of `model` may have: the spec's limit, the tokenizer's, and for a polymorphing model
        (in a deployment of its own or in a group) the longest runtime (Arlo: no runtime takes a longer input)."""
        limit = min(self.spec.model(model).max_input_length_tokens or tokenizer.max_length, tokenizer.max_length)
        params = polymorphing_params(self.spec, model)
        if params is not None:
            limit = min(limit, max(params.capacities))
        return limit

    def check_health(self) -> None:
        """Serve's health check: the engines of `in_ingress` models in this replica must still run."""
        for model, server in self.singles.local.items():
            if not server.engine.healthy():
                raise RuntimeError(f"the serving engine of {model!r} in the ingress died")

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Adopt the slots' groups and routes of a re-placement step without a restart; see `control/live_update.py`."""
        if user_config.get("layout") is None or self.groups is None:
            return
        layout = SlotLayout.model_validate(user_config["layout"])
        self.groups.set_layout(layout, user_config.get("routes", layout.routes()),
                               int(user_config.get("placement_version", 0)))
        metrics.placement_version().set(self.groups.version, tags={"group": "ingress"})

    def placement_version(self) -> int:
        """The placement version this replica routes by (the controller waits for it after each rollout step)."""
        return self.groups.version if self.groups is not None else 0

    # ---- Python API (also what the HTTP routes call) ----

    async def embed(self, model: str, texts: list[str], sent_at_s: float | None = None) -> dict[str, Any]:
        """Embed `texts`; `sent_at_s` (Unix seconds): when the client sent the call, where its clock starts
        (`request_clock.py`)."""
        received = received_at(sent_at_s)
        spec = find_model(self.spec, model, "text")
        texts = check_texts({"texts": texts}, self.spec.serving.max_items_per_request)
        tokenizer, limit = self.tokenizers[model], self.text_limits[model]
        if spec.on_too_long == "reject":
            token_ids = tokenizer.encode(texts)
            check_token_counts([len(ids) for ids in token_ids], limit, model)
        else:
            token_ids = tokenizer.encode(texts, truncate_to=limit)
        rows = await self._call(spec, "embed_token_ids", token_ids, received=received)
        return {"model": model, "embeddings": embedding_lists(rows), "ingress_latency_ms": received.elapsed_ms()}

    async def classify(self, model: str, images: Any, dtype: str = "float32", task: str | None = None,
                       slo_ms: float | None = None, utility: float | None = None,
                       sent_at_s: float | None = None) -> dict[str, Any]:
        """Classify images; `task`, `slo_ms` and `utility` describe the query to a token-adaptation (OTAS) model;
        `sent_at_s` as for `embed`."""
        received = received_at(sent_at_s)
        spec = find_model(self.spec, model, "vision")
        contract = ImageContract(spec.in_chans, spec.image_size_px or 224, spec.image_size_px or 224)
        body = {"images": images, "dtype": dtype, "task": task, "slo_ms": slo_ms, "utility": utility}
        array = check_images(body, contract, self.spec.serving.max_items_per_request)
        options = check_query_options(body)
        kwargs = {"task_id": options.get("task"), "slo_ms": options.get("slo_ms"), "utility": options.get("utility")}
        predictions = await self._call(spec, "classify", array, {k: v for k, v in kwargs.items() if v is not None},
                                       slo_ms=options.get("slo_ms"), received=received)
        return {"model": model, "predictions": predictions, "ingress_latency_ms": received.elapsed_ms()}

    def list_models(self) -> dict[str, Any]:
        return {"models": [describe_model(m, self.text_limits.get(m.name)) for m in self.spec.models]}

    async def placement(self) -> dict[str, Any]:
        """The live layout: the placement and, per group slot, what its replica reports."""
        layout = self.backend.describe()
        if self.group_handles:
            layout["groups"] = list(await asyncio.gather(*(group_info(handle, i)
                                                           for i, handle in enumerate(self.group_handles))))
        return layout

    async def placement_history(self, limit: int = DEFAULT_HISTORY_LIMIT) -> dict[str, Any]:
        """The placement controller's recent decisions, newest last."""
        if self.controller is None:
            raise RequestError(404, "no_controller",
                               "this application runs no placement controller (spec field 'controller')")
        return {"decisions": await self.controller.history.remote(limit)}

    async def placement_recommendation(self) -> dict[str, Any]:
        """The placement controller's last recommended Serve config (`config` None while it has none)."""
        if self.controller is None:
            raise RequestError(404, "no_controller",
                               "this application runs no placement controller (spec field 'controller')")
        return await self.controller.recommendation.remote()

    async def _call(self, spec: ModelSpec, method: str, payload: Any, options: dict[str, Any] | None = None,
                    slo_ms: float | None = None, received: Received | None = None) -> Any:
        """Send to the backend with the SLO (the request's, else the model's) as deadline; count outcomes and
        SLO attainment (on the model's SLO, refused requests included: `edge/attainment.py`). The deadline and the
        latency count from when the ingress received the request (`received`, else `request_clock.received_at()`),
        not from this call."""
        received = received or received_at()
        start, arrival = received.monotonic_s, received.wall_s
        model = spec.name
        slo_ms = spec.slo_ms if slo_ms is None else slo_ms
        tokens = max((len(ids) for ids in payload), default=0) if method == "embed_token_ids" else 0
        try:
            result = await self.backend.call(model, method, payload, start + slo_ms / 1000.0, options or {})
        except RequestError as error:
            outcome = "rejected" if error.status_code == 503 else "invalid"
            metrics.requests_total().inc(tags={"model": model, "outcome": outcome})
            self._report(RequestRecord(model, arrival, outcome, input_tokens=tokens))
            if outcome == "rejected":
                self._record_attainment(model, met=False)
            raise
        except BackPressureError:
            metrics.rejections_total().inc(tags={"model": model, "reason": "overloaded"})
            metrics.requests_total().inc(tags={"model": model, "outcome": "rejected"})
            self._report(RequestRecord(model, arrival, "rejected", input_tokens=tokens))
            self._record_attainment(model, met=False)
            raise
        except Exception:
            metrics.requests_total().inc(tags={"model": model, "outcome": "failed"})
            self._report(RequestRecord(model, arrival, "failed", input_tokens=tokens))
            self._record_attainment(model, met=False)
            raise
        latency_ms = received.elapsed_ms()
        met = latency_ms <= spec.slo_ms  # the model's SLO: a client's slo_ms sets its deadline, not what counts as met
        self._report(RequestRecord(model, arrival, "ok", latency_ms=latency_ms, slo_met=met, input_tokens=tokens))
        metrics.requests_total().inc(tags={"model": model, "outcome": "ok"})
        metrics.request_latency_ms().observe(latency_ms, tags={"model": model})
        if met:
            metrics.slo_met_total().inc(tags={"model": model})
        self._record_attainment(model, met)
        return result

    def _record_attainment(self, model: str, met: bool) -> None:
        metrics.slo_attainment().set(self.attainment.record(model, met), tags={"model": model})

    def _report(self, record: RequestRecord) -> None:
        if self.traffic is not None:
            self.traffic.add(record)

    # ---- HTTP ----

    @staticmethod
    async def _on_clock(request: Request, respond: Callable[[], Awaitable[Response]]) -> Response:
        """`respond()` with the request's clock started: before its body is read, or at the send time its client
        stamped in `X-Request-Start` (a 4xx for one that cannot be)."""
        try:
            received = Received.from_header(request.headers.get(REQUEST_START_HEADER))
        except RequestError as error:
            return error_response(error, protocol=protocol_of(request.url.path, request.method))
        with receiving(received):
            return await respond()

    async def _answer(self, request: Request, call: Callable[[dict[str, Any]], Awaitable[Any]],
                      protocol: Protocol = "native") -> Response:
        return await self._on_clock(request, lambda: answer(request, self.spec.serving.max_request_bytes, call,
                                                            protocol))

    @app.post("/v1/models/{name}/embed", response_model=EmbedResponse, responses=ERROR_RESPONSES,
              openapi_extra=json_body(EmbedRequest))
    async def http_embed(self, name: str, request: Request) -> Response:
        return await self._answer(request, lambda payload: native.embed(self, name, payload))

    @app.post("/v1/models/{name}/classify", response_model=ClassifyResponse, responses=ERROR_RESPONSES,
              openapi_extra=json_body(ClassifyRequest))
    async def http_classify(self, name: str, request: Request) -> Response:
        return await self._answer(request, lambda payload: native.classify(self, name, payload))

    @app.get("/v1/models")
    def http_models(self) -> dict[str, Any]:
        return openai_api.with_model_list(self.list_models())

    @app.get("/v1/models/{name}", response_model=openai_api.ModelObject, responses=openai_api.ERROR_RESPONSES)
    async def http_openai_model(self, name: str) -> Response:
        """OpenAI's model object of a served model (`client.models.retrieve`); 404 `model_not_found` otherwise."""
        async def work() -> dict[str, Any]:
            return openai_api.model_object(self.spec, name)

        return await guarded(work(), "openai")

    @app.get("/v1/placement")
    async def http_placement(self) -> dict[str, Any]:
        return await self.placement()

    @app.get("/v1/placement/history")
    async def http_placement_history(self, limit: int = DEFAULT_HISTORY_LIMIT) -> JSONResponse:
        try:
            if limit < 1:
                raise RequestError(422, "invalid_field", f"limit must be >= 1, got {limit}", field="limit")
            return JSONResponse(await self.placement_history(limit))
        except RequestError as error:
            return JSONResponse(error.to_json(), status_code=error.status_code)

    @app.get("/v1/placement/recommended")
    async def http_placement_recommended(self) -> JSONResponse:
        try:
            return JSONResponse(await self.placement_recommendation())
        except RequestError as error:
            return JSONResponse(error.to_json(), status_code=error.status_code)

    @app.get("/healthz")
    async def http_health(self) -> JSONResponse:
        """200 `{"status": "ok"}` when every model can answer, else 503 naming the models that cannot."""
        ready, models = await kserve.server_ready(self)
        if ready:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "not_ready": sorted(m for m, ok in models.items() if not ok)},
                            status_code=503)

    # ---- HTTP edge (issue 16): OpenAI embeddings and the KServe/Triton v2 protocol; logic in rayserve_apps/edge/ ----

    @app.post("/v1/embeddings", response_model=openai_api.EmbeddingsResponse, responses=openai_api.ERROR_RESPONSES,
              openapi_extra=json_body(openai_api.EmbeddingsRequest))
    async def http_openai_embeddings(self, request: Request) -> Response:
        return await self._answer(request, lambda payload: openai_api.embeddings(self, payload), "openai")

    @app.get("/v2")
    def http_v2_server_metadata(self) -> dict[str, Any]:
        return kserve.server_metadata()

    @app.get("/v2/health/live")
    def http_v2_live(self) -> dict[str, bool]:
        return {"live": True}

    @app.get("/v2/health/ready")
    async def http_v2_ready(self) -> JSONResponse:
        ready, models = await kserve.server_ready(self)
        return JSONResponse({"ready": ready, "models": models}, status_code=200 if ready else 503)

    @app.get("/v2/models/{name}", responses=kserve.ERROR_RESPONSES)
    async def http_v2_model_metadata(self, name: str) -> Response:
        return await self._v2_metadata(name, None)

    @app.get("/v2/models/{name}/versions/{version}", responses=kserve.ERROR_RESPONSES)
    async def http_v2_version_metadata(self, name: str, version: str) -> Response:
        return await self._v2_metadata(name, version)

    @app.get("/v2/models/{name}/ready", responses=kserve.ERROR_RESPONSES)
    async def http_v2_model_ready(self, name: str) -> Response:
        return await self._v2_ready(name, None)

    @app.get("/v2/models/{name}/versions/{version}/ready", responses=kserve.ERROR_RESPONSES)
    async def http_v2_version_ready(self, name: str, version: str) -> Response:
        return await self._v2_ready(name, version)

    @app.post("/v2/models/{name}/infer", responses=kserve.ERROR_RESPONSES,
              openapi_extra=json_body(kserve.InferRequest))
    async def http_v2_infer(self, name: str, request: Request) -> Response:
        return await self._on_clock(request, lambda: guarded(kserve.infer(self, name, request), "kserve"))

    @app.post("/v2/models/{name}/versions/{version}/infer", responses=kserve.ERROR_RESPONSES,
              openapi_extra=json_body(kserve.InferRequest))
    async def http_v2_version_infer(self, name: str, version: str, request: Request) -> Response:
        return await self._on_clock(request,
                                    lambda: guarded(kserve.infer(self, name, request, version), "kserve"))

    async def _v2_metadata(self, name: str, version: str | None) -> Response:
        async def work() -> dict[str, Any]:
            return kserve.model_metadata(self, name, version)

        return await guarded(work(), "kserve")

    async def _v2_ready(self, name: str, version: str | None) -> Response:
        async def work() -> JSONResponse:
            ready = await kserve.model_ready(self, name, version)
            return JSONResponse({"name": name, "ready": ready}, status_code=200 if ready else 503)

        return await guarded(work(), "kserve")
