"""Images at the edge: base64 PNG/JPEG files and raw uint8 pixels -> the model's input tensor; label names.

Decoding uses Pillow; the transform is timm's for the checkpoint's architecture (`resolve_data_config` over the
architecture's pretrained config with the served model's input size, then `create_transform`): resize the shorter
side to size / crop_pct, centre-crop, scale to [0, 1], normalise with the config's mean and std. An image that
already has the model's size is only scaled and normalised (no resize or crop), so a file and the nested-list
tensor it was made from classify the same.

Label names come from the model's metadata when it has some: a `labels.json` (a JSON list of names, one per class)
beside the checkpoint, else ImageNet's class names for a 1000-class timm model.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image, UnidentifiedImageError

from placement.core.deployment_spec import ModelSpec
from rayserve_apps.requests import RequestError

logger = logging.getLogger("ray.serve")

#: Image file formats accepted in `images_base64`.
ACCEPTED_FORMATS = ("PNG", "JPEG")
#: Largest decoded image accepted, pixels (refused before decoding, so a small file cannot inflate into gigabytes).
MAX_IMAGE_PIXELS = 4096 * 4096
#: Pillow image mode for each channel count a model may take.
MODE_FOR_CHANNELS = {1: "L", 3: "RGB", 4: "RGBA"}
#: File beside a checkpoint that names its classes.
LABELS_FILE = "labels.json"
#: Classes of ImageNet-1k, whose names timm ships.
IMAGENET_CLASSES = 1000
#: Prefix of a data URL that may precede the base64 text.
DATA_URL_MARK = ";base64,"


def load_label_names(spec: ModelSpec) -> list[str] | None:
    """The class names of a vision model, or None when its metadata has none."""
    if spec.checkpoint_path:
        path = Path(spec.checkpoint_path).parent / LABELS_FILE
        if path.is_file():
            names = json.loads(path.read_text())
            if isinstance(names, list) and len(names) == spec.num_classes and all(isinstance(n, str) for n in names):
                return names
            logger.warning("model %s: %s is not a list of %s class names; ignored", spec.name, path, spec.num_classes)
    if spec.num_classes == IMAGENET_CLASSES:
        from timm.data import ImageNetInfo

        info = ImageNetInfo()
        return [info.index_to_description(index) for index in range(IMAGENET_CLASSES)]
    return None


def timm_data_config(spec: ModelSpec) -> dict[str, Any]:
    """timm's eval data config of the model's architecture at the served input size; mean/std fitted to its channels."""
    from timm.data import resolve_data_config
    from timm.models import get_pretrained_cfg

    architecture = spec.source.removeprefix("timm:")
    pretrained = get_pretrained_cfg(architecture)
    side = spec.image_size_px or 224
    config = resolve_data_config(args={"input_size": (spec.in_chans, side, side)},
                                 pretrained_cfg=pretrained.to_dict() if pretrained is not None else {})
    for key in ("mean", "std"):
        values = tuple(config[key])
        if len(values) != spec.in_chans:  # e.g. a one-channel model of an RGB architecture: the channels' average
            config[key] = (float(np.mean(values)),) * spec.in_chans
    return config


class ImageDecoder:
    """base64 PNG/JPEG files -> float32 [N, C, H, W] in the model's normalisation."""

    def __init__(self, spec: ModelSpec):
        from timm.data import create_transform

        self.config = timm_data_config(spec)
        self.channels, self.height, self.width = self.config["input_size"]
        self.mode = MODE_FOR_CHANNELS.get(self.channels)
        self.transform = create_transform(**self.config)
        self.mean = np.asarray(self.config["mean"], dtype=np.float32).reshape(-1, 1, 1)
        self.std = np.asarray(self.config["std"], dtype=np.float32).reshape(-1, 1, 1)

    def decode(self, items: Sequence[str], field: str = "images_base64") -> np.ndarray:
        return np.stack([self.decode_one(item, f"{field}[{index}]") for index, item in enumerate(items)])

    def decode_one(self, item: str, field: str) -> np.ndarray:
        if self.mode is None:
            raise RequestError(422, "unsupported_field",
                               f"image files cannot feed a {self.channels}-channel model; send 'images'", field=field)
        if DATA_URL_MARK in item[:100]:
            item = item.split(DATA_URL_MARK, 1)[1]
        try:
            raw = base64.b64decode(item, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(422, "invalid_image", "not base64 text", field=field) from None
        try:
            image = Image.open(io.BytesIO(raw))
        except (UnidentifiedImageError, OSError):
            raise RequestError(422, "invalid_image", "not a PNG or JPEG file", field=field) from None
        if image.format not in ACCEPTED_FORMATS:
            raise RequestError(422, "invalid_image",
                               f"image format {image.format} is not accepted; send one of {list(ACCEPTED_FORMATS)}",
                               field=field)
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise RequestError(413, "image_too_large",
                               f"image has {image.width}x{image.height} pixels; the limit is {MAX_IMAGE_PIXELS} pixels",
                               field=field)
        try:
            image = image.convert(self.mode)
        except (OSError, ValueError, SyntaxError) as error:  # a truncated or corrupt file fails while decoding
            raise RequestError(422, "invalid_image", f"the image cannot be decoded ({error})", field=field) from None
        return self.model_input(image)

    def model_input(self, image: Image.Image) -> np.ndarray:
        """A decoded image (in the model's mode) -> float32 [C, H, W]: timm's transform, or only scaling and
        normalisation when the image already has the model's size."""
        if image.size == (self.width, self.height):
            pixels = np.asarray(image, dtype=np.float32).reshape(self.height, self.width, self.channels) / 255.0
            return (pixels.transpose(2, 0, 1) - self.mean) / self.std
        return self.transform(image).numpy().astype(np.float32)

    def from_pixels(self, pixels: np.ndarray, field: str = "images") -> np.ndarray:
        """Raw uint8 pixels [N, C, H, W] or [N, H, W, C] of any size -> float32 [N, C, H, W] like a file's."""
        if pixels.ndim != 4 or self.channels not in (pixels.shape[1], pixels.shape[3]):
            raise RequestError(422, "invalid_shape",
                               f"uint8 images must be [N, {self.channels}, H, W] or [N, H, W, {self.channels}], "
                               f"got {list(pixels.shape)}", field=field)
        if self.mode is None:
            raise RequestError(422, "unsupported_field",
                               f"uint8 images cannot feed a {self.channels}-channel model; send float32", field=field)
        channels_last = pixels if pixels.shape[1] != self.channels else pixels.transpose(0, 2, 3, 1)
        if channels_last.shape[1] * channels_last.shape[2] > MAX_IMAGE_PIXELS:
            raise RequestError(413, "image_too_large",
                               f"images have {channels_last.shape[1]}x{channels_last.shape[2]} pixels; "
                               f"the limit is {MAX_IMAGE_PIXELS} pixels", field=field)
        images = [Image.fromarray(np.ascontiguousarray(image[..., 0] if self.channels == 1 else image))
                  for image in channels_last.astype(np.uint8)]
        return np.stack([self.model_input(image) for image in images])


def with_label_names(predictions: list[dict[str, Any]], names: list[str] | None,
                     top_k: int | None) -> list[dict[str, Any]]:
    """Predictions with `label_name` (when the model names its classes) and the `top_k` most probable classes."""
    answered = []
    for prediction in predictions:
        prediction = dict(prediction)
        if names is not None:
            prediction["label_name"] = names[prediction["label"]]
        if top_k is not None:
            probabilities = np.asarray(prediction["probabilities"])
            ranked = np.argsort(-probabilities, kind="stable")[:top_k]
            prediction["top_k"] = [{"label": int(i), "probability": float(probabilities[i]),
                                    "label_name": names[i] if names is not None else None} for i in ranked]
        answered.append(prediction)
    return answered
