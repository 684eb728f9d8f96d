"""Edge validation without Ray: each bad input becomes a RequestError naming the field or limit."""

import numpy as np
import pytest

from placement.core.deployment_spec import parse_spec
from rayserve_apps.requests import (
    ImageContract,
    RequestError,
    check_images,
    check_query_options,
    check_texts,
    check_token_counts,
    find_model,
    parse_json_body,
)

SPEC = parse_spec({"models": [
    {"name": "minilm", "kind": "text", "source": "package:all-minilm-l6-v2"},
    {"name": "vit", "kind": "vision", "source": "timm:vit_tiny_patch16_224", "checkpoint_path": "x.pt",
     "num_classes": 3, "image_size_px": 16},
]})
CONTRACT = ImageContract(3, 16, 16)


def error_of(call, *args):
    with pytest.raises(RequestError) as info:
        call(*args)
    return info.value


def test_body_too_large_and_malformed_json():
    assert error_of(parse_json_body, b"x" * 2000, 1024).status_code == 413
    assert error_of(parse_json_body, b"{not json", 1024).status_code == 400
    assert error_of(parse_json_body, b"[1, 2]", 1024).status_code == 400
    assert parse_json_body(b'{"texts": ["a"]}', 1024) == {"texts": ["a"]}


def test_unknown_model_and_wrong_kind():
    assert error_of(find_model, SPEC, "bert", "text").status_code == 404
    wrong = error_of(find_model, SPEC, "vit", "text")
    assert wrong.status_code == 400 and "/classify" in wrong.message


@pytest.mark.parametrize("payload, field", [
    ({}, "texts"), ({"texts": []}, "texts"), ({"texts": "abc"}, "texts"),
    ({"texts": ["ok", 3]}, "texts[1]"), ({"texts": ["ok", "  "]}, "texts[1]"), ({"texts": ["a"], "x": 1}, "x"),
])
def test_bad_texts_name_the_field(payload, field):
    error = error_of(check_texts, payload, 8)
    assert error.status_code == 422 and error.field == field


def test_too_many_texts_and_too_long_text():
    assert error_of(check_texts, {"texts": ["a"] * 9}, 8).status_code == 413
    error = error_of(check_token_counts, [3, 300], 256, "minilm")
    assert error.status_code == 413 and error.field == "texts[1]" and "256" in error.message


def test_images_shape_dtype_and_values():
    good = np.zeros((2, 3, 16, 16)).tolist()
    assert check_images({"images": good}, CONTRACT, 8).dtype == np.float32
    assert error_of(check_images, {"images": np.zeros((2, 1, 16, 16)).tolist()}, CONTRACT, 8).field == "images"
    assert error_of(check_images, {"images": [[[[1.0]]], [[[1.0, 2.0]]]]}, CONTRACT, 8).error_type == "invalid_shape"
    assert error_of(check_images, {"images": good, "dtype": "float16"}, CONTRACT, 8).field == "dtype"
    assert error_of(check_images, {"images": [[[["a"] * 16] * 16] * 3]}, CONTRACT,
                    8).error_type in {"invalid_dtype", "invalid_shape"}
    assert error_of(check_images, {"images": np.full((1, 3, 16, 16), 300).tolist(), "dtype": "uint8"}, CONTRACT,
                    8).field == "images"
    scaled = check_images({"images": np.full((1, 3, 16, 16), 255).tolist(), "dtype": "uint8"}, CONTRACT, 8)
    assert np.allclose(scaled, 1.0)


def test_request_error_survives_pickling():
    import pickle

    error = pickle.loads(pickle.dumps(RequestError(413, "input_too_long", "too long", "texts[0]")))
    assert (error.status_code, error.field, str(error)) == (413, "texts[0]", "too long")
    assert isinstance(error, ValueError)


def test_query_options_are_checked():
    assert (check_query_options({"images": [], "task": "parity", "slo_ms": 50, "utility": 0})
            == {"task": "parity", "slo_ms": 50, "utility": 0})
    assert check_query_options({"images": []}) == {}
    for bad, field in (({"task": 3}, "task"), ({"slo_ms": 0}, "slo_ms"), ({"slo_ms": "fast"}, "slo_ms"),
                       ({"utility": -1}, "utility")):
        assert error_of(check_query_options, bad).field == field
