"""benchmarks/serve_e2e.py without Ray or servers: its text mixes, request bodies, figures, merging of per-mix runs
and argument errors."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from benchmarks import serve_e2e as e2e

VOCAB = ["alpha", "beta", "gamma", "delta"]


def test_short_and_long_mixes_have_the_issues_word_counts():
    short = e2e.word_counts(4000, "short")
    long = e2e.word_counts(4000, "long")
    assert statistics.mean(short) == pytest.approx(20, abs=1) and statistics.stdev(short) == pytest.approx(8, abs=1)
    assert statistics.mean(long) == pytest.approx(100, abs=4) and statistics.stdev(long) == pytest.approx(50, abs=4)
    assert min(short + long) >= 1 and max(long) <= e2e.MAX_WORDS_PER_TEXT


def test_the_mixed_mix_draws_short_and_long_texts_with_even_odds():
    counts = e2e.word_counts(4000, "mixed")
    long_share = sum(words > 60 for words in counts) / len(counts)
    assert long_share == pytest.approx(0.5 * 0.79, abs=0.05)  # P(N(100, 50) > 60) = 0.79
    assert sum(words <= 40 for words in counts) / len(counts) > 0.45


def test_texts_follow_their_word_counts_and_repeat_with_the_seed():
    texts = e2e.make_texts(50, "long", seed=3, vocab=VOCAB)
    assert [len(text.split()) for text in texts] == e2e.word_counts(50, "long", seed=3)
    assert set(" ".join(texts).split()) <= set(VOCAB)
    assert texts == e2e.make_texts(50, "long", seed=3, vocab=VOCAB)
    assert texts != e2e.make_texts(50, "long", seed=4, vocab=VOCAB)


def test_an_unknown_mix_is_refused_naming_it():
    with pytest.raises(ValueError, match="unknown text mix 'medium'; known: short, long, mixed"):
        e2e.word_counts(10, "medium")


def test_each_side_gets_its_protocols_body():
    assert json.loads(e2e.request_body("a b", "texts")) == {"texts": ["a b"]}
    assert json.loads(e2e.request_body("a b", "openai")) == {"model": e2e.INFINITY_MODEL_NAME, "input": ["a b"]}
    with pytest.raises(ValueError, match="unknown body format 'xml'"):
        e2e.request_body("a", "xml")


def closed(system: str, mix: str, clients: int, ok_per_s: float, p50_ms: float = 10.0) -> dict:
    return {"system": system, "mode": "closed", "mix": mix, "load": clients, "ok_per_s": ok_per_s,
            "goodput_per_s": ok_per_s, "p50_ms": p50_ms, "p99_ms": 2 * p50_ms, "statuses": {"200": 1}, "errors": 0,
            "load_generator_cpu_share": 0.1}


def points_of(mix: str) -> list[dict]:
    points = []
    for clients, plex, plain, infinity in ((1, 30, 20, 40), (16, 90, 60, 60), (64, 100, 50, 80)):
        points += [closed("plexserve", mix, clients, plex, p50_ms=30), closed("plain", mix, clients, plain),
                   closed("infinity", mix, clients, infinity, p50_ms=25)]
    points.append({"system": "plexserve", "mode": "open", "mix": mix, "load": 400, "factor": 4.0,
                   "goodput_per_s": 95.0, "statuses": {"200": 5, "503": 7, "500": 1}, "errors": 2,
                   "load_generator_cpu_share": 0.3})
    return points


def test_the_figures_of_a_mix_are_plexserves_ratios_over_each_side():
    figures = e2e.mix_figures(points_of("short"), "short", [1, 16, 64])
    assert figures["ratio_vs_infinity_1"] == pytest.approx(30 / 40)
    assert figures["ratio_vs_plain_16"] == pytest.approx(90 / 60)
    assert figures["ratio_vs_infinity_64"] == pytest.approx(100 / 80)
    assert (figures["p50_ms_1_client_plexserve"], figures["p50_ms_1_client_infinity"]) == (30, 25)
    assert figures["goodput_ratio_overload_4x"] == pytest.approx(95 / 100)
    assert figures["load_generator_cpu_share_max"] == pytest.approx(0.3)


def test_a_side_that_was_not_measured_has_no_ratio():
    points = [p for p in points_of("long") if p["system"] != "infinity"]
    figures = e2e.mix_figures(points, "long", [1, 16, 64])
    assert "ratio_vs_infinity_1" not in figures and "p50_ms_1_client_infinity" not in figures
    assert figures["ratio_vs_plain_64"] == pytest.approx(2.0)


def test_the_soak_reports_the_largest_replica_growth_and_the_p99_change():
    figures = e2e.soak_figures({"a": 100.0, "b": 200.0, "gone": 50.0}, {"a": 103.0, "b": 220.0, "new": 10.0},
                               p99_start_ms=100.0, p99_end_ms=130.0)
    assert figures["rss_growth"] == pytest.approx(0.10)
    assert set(figures["rss_growth_by_replica"]) == {"a", "b"}
    assert figures["p99_growth"] == pytest.approx(0.30)


def test_the_p99_of_a_window_counts_only_requests_sent_in_it():
    point = e2e.Point("plexserve", "soak", 10.0, 10.0, latencies_ms=[1.0, 2.0, 100.0, 200.0],
                      sent_at_s=[0.5, 1.0, 9.0, 9.5])
    assert e2e.percentile_of_window(point, 0.0, 2.0, q=100) == 2.0
    assert e2e.percentile_of_window(point, 8.0, 10.0, q=100) == 200.0
    assert e2e.percentile_of_window(point, 3.0, 4.0) != e2e.percentile_of_window(point, 3.0, 4.0)  # NaN: none


def test_the_run_figures_hold_every_mix_the_soak_and_the_error_counts():
    soak = {"system": "plexserve", "mode": "soak", "mix": "mixed", "statuses": {"200": 3}, "errors": 0,
            **e2e.soak_figures({"a": 100.0}, {"a": 101.0}, 10.0, 11.0)}
    points = points_of("short") + points_of("long") + [soak]
    figures = e2e.run_figures(points, ["short", "long"], [1, 16, 64], {"short": {"texts_per_s": 200.0}})
    assert {"short", "long"} <= set(figures) and "mixed" not in figures
    assert figures["short"]["fraction_of_compute_bound_64"] == pytest.approx(0.5)
    assert figures["rss_growth"] == pytest.approx(0.01) and figures["p99_growth"] == pytest.approx(0.1)
    assert figures["errors_5xx_not_503"] == 2 and figures["client_errors_and_timeouts"] == 4


def test_a_one_mix_run_merges_into_the_mixes_and_soak_measured_before():
    before = e2e.run_figures(points_of("short") + points_of("long"), ["short", "long"], [1, 16, 64], {})
    before.update(points=points_of("short") + points_of("long"), soak={"rss_growth": 0.0}, rss_growth=0.0,
                  p99_growth=0.1)
    now = e2e.run_figures(points_of("long"), ["long"], [1, 16, 64], {})
    now["points"] = points_of("long")
    merged = e2e.merge_figures(before, now, ["long"])
    assert merged["mixes"] == ["short", "long"]
    assert merged["short"] == before["short"] and merged["long"] == now["long"]
    assert merged["soak"] == {"rss_growth": 0.0} and merged["p99_growth"] == 0.1
    assert len(merged["points"]) == len(before["points"])
    assert merged["errors_5xx_not_503"] == 2


def test_a_run_of_some_sides_keeps_the_earlier_figures_of_the_others_and_says_whence():
    before = e2e.run_figures(points_of("long"), ["long"], [1, 16, 64], {})
    before["long"]["command"] = "python -m benchmarks.serve_e2e --quick"
    before["points"] = points_of("long")
    plexserve_only = [p for p in points_of("long") if p["system"] == "plexserve" and p["load"] != 1]
    now = e2e.run_figures(plexserve_only, ["long"], [16, 64], {})
    now["long"]["command"] = "python -m benchmarks.serve_e2e --quick --skip-plain --skip-infinity --merge"
    now["points"] = plexserve_only
    before["infinity_emb"], now["infinity_emb"] = "measured", "skipped (--skip-infinity)"
    merged = e2e.merge_figures(before, now, ["long"])
    assert merged["infinity_emb"] == "skipped (--skip-infinity) in this run; earlier figures kept (kept_figures)"
    long = merged["long"]
    assert long["command"] == now["long"]["command"]
    assert long["ok_per_s_plexserve_64"] == now["long"]["ok_per_s_plexserve_64"]
    assert long["ratio_vs_infinity_64"] == before["long"]["ratio_vs_infinity_64"]  # kept, and listed as such
    (kept,) = long["kept_figures"].values()
    assert list(long["kept_figures"]) == [before["long"]["command"]]
    assert "ratio_vs_infinity_64" in kept and "ok_per_s_plexserve_64" not in kept
    systems = [(p["system"], p["load"]) for p in merged["points"] if p["mode"] == "closed"]
    assert systems.count(("infinity", 16)) == 1 and systems.count(("plexserve", 16)) == 1  # this run's, once
    assert ("plexserve", 1) not in systems  # a side this run measured keeps only this run's points
    again = e2e.merge_figures(merged, now, ["long"])  # a second partial run: the kept figures keep their source
    assert again["long"]["kept_figures"] == long["kept_figures"]


def test_three_runs_report_each_figure_as_its_median_and_keep_the_values_per_run():
    runs = []
    for plex_16, growth in ((90, 0.3), (60, 0.1), (120, 0.2)):
        points = [dict(p, ok_per_s=plex_16) if p["system"] == "plexserve" and p["load"] == 16 else p
                  for p in points_of("short")]
        figures = e2e.run_figures(points, ["short"], [1, 16, 64], {})
        figures.update(points=points, rss_growth=growth, p99_growth=growth, infinity_emb="measured",
                       soak={"p99_growth": growth})
        figures["short"]["command"] = "python -m benchmarks.serve_e2e --quick --median-of 3"
        runs.append(figures)
    merged = e2e.median_of_runs(runs)
    assert merged["runs"] == 3 and merged["short"]["ratio_vs_plain_16"] == pytest.approx(90 / 60)
    assert merged["short"]["per_run"]["ratio_vs_plain_16"] == pytest.approx([90 / 60, 60 / 60, 120 / 60])
    assert merged["p99_growth"] == pytest.approx(0.2) and merged["soak"]["p99_growth"] == pytest.approx(0.2)
    assert merged["per_run"]["rss_growth"] == pytest.approx([0.3, 0.1, 0.2])
    assert merged["short"]["command"].endswith("--median-of 3") and merged["infinity_emb"] == "measured"
    assert len(merged["points"]) == 3 * len(points_of("short"))
    assert merged["errors_5xx_not_503"] == 3 * e2e.error_counts(points_of("short"))["errors_5xx_not_503"]
    assert e2e.median_of_runs(runs[:1]) == runs[0]


def test_every_other_run_measures_the_sides_in_the_reverse_order(monkeypatch):
    order = []
    monkeypatch.setattr(e2e, "compute_bound", lambda texts, seconds, device="cpu": {"texts_per_s": 1.0})
    monkeypatch.setattr(e2e, "ensure_infinity_venv", lambda: (Path("/venv/bin/infinity_emb"), ""))
    monkeypatch.setattr(e2e, "run_infinity", lambda binary, args, log: order.append("infinity") or [])
    monkeypatch.setattr("subprocess.run", lambda argv, **kwargs: order.append(argv[argv.index("--session") + 1])
                        or Path(argv[argv.index("--session-out") + 1]).write_text("[]"))
    args = e2e.parse_args(["--quick", "--mixes", "short", "--median-of", "2"])
    infinity = e2e.infinity_environment(args)
    for run in range(args.median_of):
        e2e.measure_run(args, run, infinity)
    assert order == ["infinity", "serve_proxy", "fast_ingress", "fast_ingress", "serve_proxy", "infinity"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--median-of", "0"], "--median-of must be >= 1, got 0"),
    (["--soak-s", "-1"], "--soak-s must be >= 0, got -1"),
    (["--clients", "0", "16"], "--clients: every client count must be >= 1"),
    (["--mixes", "medium"], "argument --mixes: invalid choice: 'medium'"),
    (["--mixes"], "argument --mixes: expected at least one argument"),
])
def test_bad_arguments_are_refused_naming_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        e2e.parse_args(argv)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_the_soak_lasts_ten_minutes_or_one_with_quick():
    assert e2e.parse_args([]).soak_s == 600
    assert e2e.parse_args(["--quick"]).soak_s == 60
    assert e2e.parse_args(["--quick", "--soak-s", "0"]).soak_s == 0


def test_a_session_gets_this_runs_mixes_soak_and_flags():
    args = e2e.parse_args(["--quick", "--mixes", "long", "short", "--soak-s", "5", "--skip-plain"])
    argv = e2e.session_argv(args, "fast_ingress", Path("/tmp/out.json"))
    session = e2e.parse_args(argv)
    assert session.mixes == ["long", "short"] and session.soak_s == 5 and session.quick and session.skip_plain
    assert session.session == "fast_ingress"
    assert e2e.session_systems("fast_ingress", session) == ["plexserve"]
    assert e2e.session_systems("serve_proxy", session) == []
    assert e2e.session_systems("serve_proxy", e2e.parse_args([])) == ["plain"]


def test_infinity_emb_runs_as_the_issue_compares_it():
    command = e2e.infinity_command(Path("/venv/bin/infinity_emb"), Path("/models/minilm"), 7997)
    assert command[:2] == ["/venv/bin/infinity_emb", "v2"]
    joined = " ".join(command)
    assert "--engine torch --device cpu --batch-size 32" in joined and "--model-id /models/minilm" in joined
    assert "--host 127.0.0.1 --port 7997" in joined
    assert "infinity-emb[server,torch]==0.0.78" in e2e.INFINITY_REQUIREMENTS


def test_an_environment_that_cannot_be_made_says_why(tmp_path):
    blocker = tmp_path / "venv"
    blocker.write_text("a file where the environment would go")
    binary, why = e2e.ensure_infinity_venv(blocker)
    assert binary is None and why


def test_on_cuda_every_model_reserves_a_gpu_share_and_groups_fit_the_gpus(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: type("Properties", (), {"total_memory": 141 * 2**30})())
    from placement.core.deployment_spec import DeploymentSpec
    from rayserve_apps.app import ingress_actor_options

    spec = e2e.plexserve_args(device="cuda")
    parsed = DeploymentSpec.model_validate(spec)
    assert spec["cluster"]["device_resource"] == "GPU" and spec["cluster"]["num_devices"] == 1
    assert all(model["device_share_per_replica"] == e2e.PLEXSERVE_GPU_SHARE for model in spec["models"])
    # Every model's replica, the ingress (holding the engines of in_ingress models) and the plain app on one GPU.
    ingress_share = ingress_actor_options(parsed).get("num_gpus", 0.0)
    assert len(spec["models"]) * e2e.PLEXSERVE_GPU_SHARE + ingress_share + e2e.PLAIN_GPU_SHARE <= 1.0
    assert all(group["num_devices"] <= 1 for group in (spec.get("placement") or {}).get("groups", []))
    assert all("device_share_per_replica" not in model for model in e2e.plexserve_args()["models"])
