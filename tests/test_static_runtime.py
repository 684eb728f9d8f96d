"""Static-shape runtimes of MiniLM (exact vs eager), the DT runtime, and staircase-based runtime lengths."""

from __future__ import annotations

import pytest
import torch

from ops.static_runtime import DynamicRuntime, StaticRuntime, compare_backends, fastest_exact_backend
from placement.arlo_paper_profiles import staircase_latency_s
from placement.arlo_runtimes import RuntimeProfile, choose_runtime_lengths

TEXTS = ["a short one", "a somewhat longer sentence about serving transformer models on a cluster", "hi"]


@pytest.fixture(scope="module")
def encoder():
    torch.set_num_threads(1)
    from models.text_encoder import load_text_encoder

    return load_text_encoder()


@pytest.mark.parametrize("backend", ["eager", "trace"])
def test_static_runtime_matches_eager_encoder(encoder, backend):
    runtime = StaticRuntime(encoder, max_length_tokens=32, batch_size=2, backend=backend)
    expected = encoder.embed(TEXTS)
    got = runtime.embed(TEXTS)  # two batches: one full, one padded with an empty row
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=1e-5)


def test_static_runtime_rejects_too_long_and_too_many(encoder):
    runtime = StaticRuntime(encoder, max_length_tokens=8, batch_size=1, backend="eager")
    with pytest.raises(ValueError, match="max length 8 tokens"):
        runtime.run_tokens([list(range(101, 111))])
    with pytest.raises(ValueError, match="batch size 1"):
        runtime.run_tokens([[101, 102], [101, 102]])
    with pytest.raises(ValueError, match="max_length_tokens"):
        StaticRuntime(encoder, max_length_tokens=10_000)


def test_dynamic_runtime_matches_eager(encoder):
    ids = [encoder.tokenizer(t)["input_ids"] for t in TEXTS]
    assert torch.allclose(DynamicRuntime(encoder).run_tokens(ids), encoder.embed(TEXTS), atol=1e-5)


def test_backend_comparison_picks_an_exact_backend(encoder):
    results = compare_backends(encoder, max_length_tokens=16, batch_size=1, backends=("eager", "trace"), repeats=1)
    assert all(r.exact for r in results)
    assert fastest_exact_backend(results) in {"eager", "trace"}


def test_runtime_lengths_follow_the_paper_staircase():
    lengths = list(range(16, 513, 16))
    latencies = [staircase_latency_s("bert-base", length) for length in lengths]
    assert choose_runtime_lengths(lengths, latencies) == list(range(64, 513, 64))  # Arlo §3.3: eight runtimes


def test_runtime_lengths_follow_an_irregular_staircase_and_cap():
    lengths = [8, 16, 24, 32, 40, 48, 56, 64]
    latencies = [1.0, 1.01, 1.02, 1.5, 1.52, 2.5, 2.55, 2.56]
    assert choose_runtime_lengths(lengths, latencies) == [24, 40, 64]
    assert choose_runtime_lengths(lengths, latencies, max_runtimes=2) == [40, 64]  # tolerance doubled until it fits
    linear = [float(x) for x in lengths]  # no flat steps: a runtime wherever latency grows by more than 5%
    assert choose_runtime_lengths(lengths, linear) == lengths


def test_capacity_and_mean_latency_follow_the_profile():
    runtime = RuntimeProfile(max_length_tokens=64, batch_latency_s={1: 0.01, 4: 0.02}, max_batch_size=4, slo_s=0.1)
    assert runtime.capacity_requests == 20  # 5 batches of 4 within 100 ms
    assert runtime.mean_latency_s(0) == pytest.approx(0.01)  # idle: one request's own latency
    rho = 10 * 0.02 / (0.1 * 4)  # 10 requests per SLO period on a 20-request capacity
    assert runtime.mean_latency_s(10) == pytest.approx(0.01 + 0.02 * rho / (2 * (1 - rho)))
    loads = [0, 5, 10, 18, 19, 25, 100]
    values = [runtime.mean_latency_s(x) for x in loads]
    assert values == sorted(values) and values[-1] > 10 * values[2]  # overload is priced steeply, never infinite
    with pytest.raises(ValueError, match="max_batch_size"):
        RuntimeProfile(max_length_tokens=64, batch_latency_s={1: 0.01}, max_batch_size=4, slo_s=0.1)
