"""plexserve's own routes over the schemas: `POST /v1/models/{name}/embed` and `/classify`.

Each validates the whole body first (schema, then the spec's limits) inside `input_errors`, so whatever goes wrong
there is a 4xx; only then does it call the ingress's `embed` / `classify` (the same calls as the Python handle API).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import numpy as np

from placement.core.deployment_spec import DeploymentSpec, ModelSpec
from rayserve_apps.edge.errors import input_errors
from rayserve_apps.edge.images import ImageDecoder, load_label_names, with_label_names
from rayserve_apps.edge.schemas import ClassifyRequest, EmbedRequest, validate_body
from rayserve_apps.requests import (
    ImageContract,
    RequestError,
    check_images,
    check_query_options,
    check_texts,
    find_model,
)

if TYPE_CHECKING:
    from rayserve_apps.ingress.deployment import Ingress


class Edge:
    """What the HTTP edge keeps per ingress replica: per vision model (built on first use) its image decoder and
    its label names."""

    def __init__(self, spec: DeploymentSpec):
        self.spec = spec
        self._decoders: dict[str, ImageDecoder] = {}
        self._labels: dict[str, list[str] | None] = {}

    def decoder(self, model: ModelSpec) -> ImageDecoder:
        if model.name not in self._decoders:
            self._decoders[model.name] = ImageDecoder(model)
        return self._decoders[model.name]

    def label_names(self, model: ModelSpec) -> list[str] | None:
        if model.name not in self._labels:
            self._labels[model.name] = load_label_names(model)
        return self._labels[model.name]

    @staticmethod
    def contract(model: ModelSpec) -> ImageContract:
        side = model.image_size_px or 224
        return ImageContract(model.in_chans, side, side)


async def embed(ingress: "Ingress", name: str, payload: dict[str, Any]) -> dict[str, Any]:
    find_model(ingress.spec, name, "text")
    return await embed_texts(ingress, name, validate_body(EmbedRequest, payload).texts)


async def embed_texts(ingress: "Ingress", name: str, texts: list[str], field: str = "texts") -> dict[str, Any]:
    """Check the texts against the spec's limits (4xx naming `field`), then embed them through the ingress."""
    try:
        with input_errors(field):
            texts = check_texts({"texts": texts}, ingress.spec.serving.max_items_per_request)
        return await ingress.embed(name, texts)
    except RequestError as error:
        if field == "texts" or not error.field or not error.field.startswith("texts"):
            raise
        raise RequestError(error.status_code, error.error_type, error.message.replace("texts", field, 1),
                           field=error.field.replace("texts", field, 1)) from None


def checked_images(ingress: "Ingress", model: ModelSpec, images: Any, dtype: Any, field: str = "images") -> np.ndarray:
    """Nested lists or an array [N, C, H, W] of `dtype` as the model's float32 input, fully checked (4xx naming
    `field` for anything wrong)."""
    with input_errors(field):
        return check_images({"images": images, "dtype": dtype}, ingress.edge.contract(model),
                            ingress.spec.serving.max_items_per_request)


def pixel_array(images: Any, field: str = "images") -> np.ndarray:
    """Raw pixels: a 4-D array of integers in [0, 255] (checked; layout checked by `ImageDecoder.from_pixels`)."""
    with input_errors(field):
        array = np.asarray(images)
        if array.dtype.kind not in "iu" or array.ndim != 4 or not array.size:
            raise RequestError(422, "invalid_dtype",
                               "uint8 images must be a non-empty 4-D array of integers in [0, 255]", field=field)
        if array.min() < 0 or array.max() > np.iinfo(np.uint8).max:
            raise RequestError(422, "invalid_dtype", "uint8 images must hold integers in [0, 255]", field=field)
        return array.astype(np.uint8)


async def from_pixels(ingress: "Ingress", model: ModelSpec, pixels: np.ndarray, field: str = "images") -> np.ndarray:
    """Raw uint8 pixels (any size, channels first or last) resized and normalised like an image file."""
    limit = ingress.spec.serving.max_items_per_request
    if len(pixels) > limit:
        raise RequestError(413, "too_many_items", f"'{field}' has {len(pixels)} items; the limit is {limit}",
                           field=field)
    decoder = ingress.edge.decoder(model)
    with input_errors(field):
        return await asyncio.to_thread(decoder.from_pixels, pixels, field)


async def images_array(ingress: "Ingress", model: ModelSpec, body: ClassifyRequest) -> np.ndarray:
    """The request's images as the model's float32 input [N, C, H, W], fully checked: float32 tensors as given,
    uint8 pixels and files resized and normalised with the checkpoint's timm data config."""
    if body.images is not None and body.dtype == "uint8":
        return await from_pixels(ingress, model, pixel_array(body.images))
    if body.images_base64 is None:
        return checked_images(ingress, model, body.images, body.dtype)
    limit = ingress.spec.serving.max_items_per_request
    if len(body.images_base64) > limit:
        raise RequestError(413, "too_many_items",
                           f"'images_base64' has {len(body.images_base64)} items; the limit is {limit}",
                           field="images_base64")
    decoder = ingress.edge.decoder(model)
    with input_errors("images_base64"):
        return await asyncio.to_thread(decoder.decode, body.images_base64)


async def classify(ingress: "Ingress", name: str, payload: dict[str, Any]) -> dict[str, Any]:
    model = find_model(ingress.spec, name, "vision")
    body = validate_body(ClassifyRequest, payload)
    array = await images_array(ingress, model, body)
    with input_errors():
        options = check_query_options(body.query_options())
    answer = await ingress.classify(name, array, "float32",
                                    **{field: options.get(field) for field in ("task", "slo_ms", "utility")})
    names = ingress.edge.label_names(model)
    if names is not None or body.top_k is not None:
        answer = {**answer, "predictions": with_label_names(answer["predictions"], names, body.top_k)}
    return answer
