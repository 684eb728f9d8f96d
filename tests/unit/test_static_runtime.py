"""Static-shape runtimes of MiniLM (exact vs eager), padded and packed (ConcatBatching), the DT runtime, and
staircase-based runtime lengths."""

from __future__ import annotations

import pytest
import torch

from models.runtimes.static_runtime import (
    BackendComparison,
    DynamicRuntime,
    PackedStaticRuntime,
    StaticRuntime,
    compare_backends,
    fastest_exact_backend,
)
from placement.arlo.paper_profiles import staircase_latency_s
from placement.arlo.runtimes import RuntimeProfile, choose_runtime_lengths

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


PACKED_TEXTS = TEXTS + ["ok then", "yet another short request", "packing keeps requests apart", "a", "fine"]


@pytest.mark.parametrize("backend", ["eager", "trace"])
def test_packed_static_runtime_matches_eager_encoder_per_request(encoder, backend):
    runtime = PackedStaticRuntime(encoder, max_length_tokens=32, rows=2, backend=backend)
    ids = [encoder.tokenizer(t)["input_ids"] for t in PACKED_TEXTS]
    expected = torch.cat([encoder.embed([text]) for text in PACKED_TEXTS])  # each request alone, plain eager model
    result = runtime.run_tokens(ids)
    assert result.embeddings.shape == expected.shape
    assert torch.allclose(result.embeddings, expected, atol=1e-5)
    assert torch.nn.functional.cosine_similarity(result.embeddings, expected).min() >= 0.9999


def test_packed_rows_hold_several_requests_and_the_graph_sees_one_shape(encoder):
    runtime = PackedStaticRuntime(encoder, max_length_tokens=32, rows=2, backend="trace")
    shapes = []
    compiled = runtime._fn
    runtime._fn = lambda *args: (shapes.append([tuple(a.shape) for a in args]), compiled(*args))[1]
    ids = [encoder.tokenizer(t)["input_ids"] for t in PACKED_TEXTS]
    result = runtime.run_tokens(ids)
    assert result.rows_used < len(ids)  # rows hold several short requests ...
    assert result.forward_passes < -(-len(ids) // runtime.rows)  # ... so fewer passes than one request per row
    assert result.forward_passes == len(shapes) == runtime.num_passes([len(x) for x in ids])
    assert all(s == [(2, 32)] * 4 for s in shapes)  # every pass padded to exactly [rows, L], the last one included
    alone = runtime.run_tokens(ids[:1])  # one request: a row of its own, the other row all padding
    assert alone.forward_passes == 1 and alone.rows_used == 1
    assert torch.allclose(alone.embeddings, result.embeddings[:1], atol=1e-5)


def test_packed_static_runtime_rejects_bad_shapes(encoder):
    runtime = PackedStaticRuntime(encoder, max_length_tokens=8, rows=1, backend="eager")
    with pytest.raises(ValueError, match="max_length_tokens=8"):
        runtime.run_tokens([list(range(101, 111))])
    with pytest.raises(ValueError, match="rows"):
        PackedStaticRuntime(encoder, max_length_tokens=8, rows=0)
    with pytest.raises(ValueError, match="max_length_tokens"):
        PackedStaticRuntime(encoder, max_length_tokens=10_000)


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


class ScriptedClock:
    """A clock whose timed intervals last the given durations in turn (a start and a stop reading each)."""

    def __init__(self, durations_s):
        self.durations_s = list(durations_s)
        self.now_s = 0.0
        self.started = False

    def __call__(self) -> float:
        if self.started:
            self.now_s += self.durations_s.pop(0)
        self.started = not self.started
        return self.now_s


@pytest.mark.parametrize("durations_s, fastest", [((0.005, 0.001), "trace"), ((0.001, 0.005), "eager")])
def test_backend_comparison_times_on_the_given_clock_and_picks_the_fastest(encoder, durations_s, fastest):
    clock = ScriptedClock(durations_s)
    results = compare_backends(encoder, max_length_tokens=16, batch_size=1, backends=("eager", "trace"), repeats=1,
                               clock=clock)
    assert [r.backend for r in results] == ["eager", "trace"]
    assert [r.latency_s for r in results] == pytest.approx(list(durations_s))
    assert all(r.exact for r in results)
    assert fastest_exact_backend(results) == fastest
    assert not clock.durations_s  # one timed run per backend, nothing else read the clock


def test_fastest_exact_backend_skips_inexact_backends():
    comparisons = [BackendComparison("eager", 0.0, 0.003, 0.0), BackendComparison("trace", 0.0, 0.001, 1.0),
                   BackendComparison("compile", 0.0, 0.002, 0.0)]
    assert fastest_exact_backend(comparisons) == "compile"
    with pytest.raises(ValueError, match="no backend"):
        fastest_exact_backend(comparisons[1:2])


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
