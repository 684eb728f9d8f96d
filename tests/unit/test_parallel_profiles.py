"""Profiler, configurations and the emitted ProfileSet: plans run exactly, budgets bind, placement/ reads them."""

from __future__ import annotations

import pytest
import torch

from models.layers import parameter_bytes, run_layers
from parallel.comm_model import AlphaBeta, CommModel
from parallel.configurations import emit_profile_set, enumerate_configs, model_configurations
from parallel.plan import ParallelPlan
from parallel.profiler import LayerProfileSet, profile_layers, shape_key
from parallel.stage_layers import example_input, load_model, run_plan_in_process, standalone_layers
from parallel.tiny_models import make_tiny_bert, make_tiny_vit
from placement.core.profiles import ParallelConfig, ProfileSet

MAX_ABS_DIFF = 1e-5
SEQ_LEN_TOKENS = 8
BATCH_SIZES = (1, 2)
DEGREE = 2
#: Synthetic stand-in communication costs (the real ones come from `profile_comm` on Ray actors).
FREE = AlphaBeta(alpha_s=0.0, beta_s_per_byte=0.0)
COSTLY = AlphaBeta(alpha_s=1.0, beta_s_per_byte=0.0)
STAND_IN_FREE_COMM = CommModel(send=AlphaBeta(alpha_s=1e-4, beta_s_per_byte=1e-10), all_reduce={DEGREE: FREE},
                               all_gather={DEGREE: FREE})
STAND_IN_COSTLY_COMM = CommModel(send=AlphaBeta(alpha_s=1e-4, beta_s_per_byte=1e-10), all_reduce={DEGREE: COSTLY},
                                 all_gather={DEGREE: COSTLY})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.set_num_threads(1)
    bert_source = make_tiny_bert(tmp_path_factory.mktemp("bert"))
    vit_source = make_tiny_vit(tmp_path_factory.mktemp("vit"))
    bert, vit = load_model(bert_source), load_model(vit_source)
    profiles = {
        "tiny-bert": profile_layers(bert_source, BATCH_SIZES, [SEQ_LEN_TOKENS], warmup=0, repeats=1, model=bert),
        "tiny-vit": profile_layers(vit_source, BATCH_SIZES, warmup=0, repeats=1, model=vit),
    }
    return {"tiny-bert": bert, "tiny-vit": vit}, profiles


def test_layer_profile_covers_every_layer_and_shape(models):
    loaded, profiles = models
    for name, profile in profiles.items():
        layers = standalone_layers(loaded[name])
        assert [m.kind for m in profile.layers] == [layer.kind for layer in layers]
        assert sum(m.weight_bytes for m in profile.layers) == sum(parameter_bytes(layer) for layer in layers)
        tokens = SEQ_LEN_TOKENS if name == "tiny-bert" else profile.tokens_per_sequence
        for batch in BATCH_SIZES:
            key = shape_key(batch, tokens)
            assert all(m.latency_s[key] > 0 for m in profile.layers)
            hidden = profile.layers[1].block_shape.hidden_size
            assert profile.layers[1].output_bytes[key] >= batch * tokens * hidden * 4
        assert all((m.block_shape is not None) == (m.kind == "block") for m in profile.layers)
    assert profiles["tiny-vit"].tokens_per_sequence == (32 // 16) ** 2 + 1
    assert sum(m.weight_bytes for m in profiles["tiny-vit"].layers) == loaded["tiny-vit"].weight_bytes()


def test_repeated_runs_merge_by_sample_weighted_mean(models, tmp_path):
    _, profiles = models
    first = profiles["tiny-bert"]
    key = shape_key(1, SEQ_LEN_TOKENS)
    second = first.model_copy(deep=True)
    second.layers[0].latency_s[key] = first.layers[0].latency_s[key] * 3
    second.layers[0].samples[key] = 2
    path = tmp_path / "layers.json"
    LayerProfileSet(device="cpu", models={"tiny-bert": first}, comm=STAND_IN_FREE_COMM).save_merged(path)
    merged = LayerProfileSet(device="cpu", models={"tiny-bert": second}).save_merged(path)
    merged = LayerProfileSet.load(path)
    assert merged.models["tiny-bert"].layers[0].samples[key] == 3
    assert merged.models["tiny-bert"].layers[0].latency_s[key] == pytest.approx(first.layers[0].latency_s[key] * 7 / 3)
    assert merged.comm == STAND_IN_FREE_COMM


def test_a_merge_averages_sharded_latencies_and_the_co_run_slowdown_by_their_timed_runs(models):
    """A merge weighs each run's sharded latencies and co-run slowdown by its timed runs, rather than keeping the
    newer run's whole."""
    _, profiles = models
    key = shape_key(1, SEQ_LEN_TOKENS)
    first = profiles["tiny-bert"].model_copy(deep=True)
    block = next(i for i, layer in enumerate(first.layers) if layer.kind == "block")
    first.layers[block].sharded_latency_s = {2: {key: 0.010}}
    first.layers[block].sharded_samples = {2: {key: 3}}
    first.co_run_slowdown, first.co_run_samples = 1.2, 1
    second = first.model_copy(deep=True)
    second.layers[block].sharded_latency_s = {2: {key: 0.020}, 4: {key: 0.008}}
    second.layers[block].sharded_samples = {2: {key: 1}, 4: {key: 5}}
    second.co_run_slowdown, second.co_run_samples = 1.5, 2
    merged = first.merge(second)
    assert merged.layers[block].sharded_latency_s[2][key] == pytest.approx((3 * 0.010 + 0.020) / 4)
    assert merged.layers[block].sharded_samples[2][key] == 4
    assert merged.layers[block].sharded_latency_s[4][key] == 0.008  # measured by one run only
    assert merged.co_run_slowdown == pytest.approx((1.2 + 2 * 1.5) / 3) and merged.co_run_samples == 3
    unmeasured = second.model_copy(update={"co_run_slowdown": None, "co_run_samples": 0})
    assert first.merge(unmeasured).co_run_slowdown == 1.2 and unmeasured.merge(unmeasured).co_run_slowdown is None


def test_enumerate_configs():
    assert [(c.intra_op_degree, c.pipeline_stages) for c in enumerate_configs(4)] == [(1, 4), (2, 2), (4, 1)]
    with pytest.raises(ValueError, match="group_size"):
        enumerate_configs(0)


def _run_plan(model, plan: ParallelPlan, state):
    return run_plan_in_process(model, plan, state).hidden


@pytest.mark.parametrize("comm", [STAND_IN_FREE_COMM, STAND_IN_COSTLY_COMM], ids=["free-comm", "costly-comm"])
def test_every_planned_configuration_runs_exactly(models, comm):
    loaded, profiles = models
    for name, model in loaded.items():
        planned = model_configurations(profiles[name], comm, group_sizes=[1, 2], seq_len_tokens=SEQ_LEN_TOKENS)
        assert [p.config.key() for p in planned] == ["op1-pp1", "op1-pp2", "op2-pp1"]
        state = example_input(model, 2, SEQ_LEN_TOKENS)
        with torch.inference_mode():
            expected = run_layers(model.layers(), state).hidden
        for p in planned:
            sharded = [s for stage in p.plan.stages for b in stage.block_shardings.values() for s in b.values()
                       if s != "replicated"]
            if p.config.intra_op_degree == DEGREE:
                # Free collectives: the ILP splits every linear; costly ones: it keeps everything whole.
                assert bool(sharded) == (comm is STAND_IN_FREE_COMM)
            assert (_run_plan(model, p.plan, state) - expected).abs().max().item() <= MAX_ABS_DIFF
            assert set(p.stage_latency_s) == set(BATCH_SIZES)


def test_memory_budget_drops_configs_that_do_not_fit(models):
    _, profiles = models
    whole = sum(m.weight_bytes for m in profiles["tiny-vit"].layers)
    budget = 0.75 * whole
    planned = {p.config.key(): p for p in model_configurations(profiles["tiny-vit"], STAND_IN_COSTLY_COMM, [1, 2],
                                                               memory_budget_bytes=budget)}
    assert "op1-pp1" not in planned
    assert "op1-pp2" in planned and "op2-pp1" in planned
    for p in planned.values():
        assert max(p.stage_weight_bytes) <= budget
    # Under the tight budget the single stage on 2 devices must shard although collectives are costly.
    op2 = planned["op2-pp1"].plan.stages[0]
    assert any(s != "replicated" for b in op2.block_shardings.values() for s in b.values())
    assert sum(planned["op1-pp2"].stage_weight_bytes) == whole


def test_emitted_profile_set_round_trips_and_plans_a_small_cluster(models, tmp_path):
    from placement.alpaserve.planner import PlannerConfig, plan
    from placement.core.workload import gamma_workload

    _, profiles = models
    layer_set = LayerProfileSet(device="cpu: 1 thread per actor", models=profiles, comm=STAND_IN_COSTLY_COMM)
    emitted = emit_profile_set(layer_set, group_sizes=[1, 2], seq_len_tokens={"tiny-bert": SEQ_LEN_TOKENS})
    assert emitted.source == "measured"
    path = tmp_path / "measured.json"
    emitted.save(path)
    loaded = ProfileSet.load(path)
    assert loaded == emitted
    for name in profiles:
        assert loaded.models[name].has(ParallelConfig(intra_op_degree=1, pipeline_stages=2))
        assert loaded.models[name].single_device_latency(1) > 0
    names = sorted(profiles)
    slo_s = 10 * max(loaded.models[n].single_device_latency(1) for n in names)
    rate = 0.5 / max(loaded.models[n].single_device_latency(1) for n in names)
    workload = gamma_workload(names, total_rate=rate, cv=1.0, slo_s=slo_s, duration_s=20 * slo_s, seed=0)
    memory = int(1.1 * sum(loaded.models[n].get(ParallelConfig()).weight_bytes_per_device() for n in names))
    placement = plan(names, loaded, workload, num_devices=2, device_memory_bytes=memory,
                     config=PlannerConfig(group_sizes=(1, 2), max_group_devices=2))
    hosted = {m for group in placement.groups for m in group.models}
    assert hosted == set(names)
    assert 0.0 <= placement.predicted_slo_attainment <= 1.0


def test_cli_profiles_merge_and_configs_write_a_profile_set(tmp_path, capsys):
    from parallel.__main__ import main

    source = make_tiny_bert(tmp_path / "bert")
    layers = tmp_path / "layers.json"
    args = ["profile", "--text", source.source, "--name", "tiny-bert", "--batch-sizes", "1", "--seq-lens", "8",
            "--repeats", "1", "--no-comm", "--out", str(layers)]
    assert main(args) == 0 and main(args) == 0
    merged = LayerProfileSet.load(layers)
    assert merged.models["tiny-bert"].layers[0].samples[shape_key(1, 8)] == 2
    with pytest.raises(ValueError, match="communication model"):
        main(["configs", "--layers", str(layers), "--group-sizes", "2", "--out", str(tmp_path / "p.json")])
    LayerProfileSet(device="cpu", comm=STAND_IN_COSTLY_COMM).save_merged(layers)
    out = tmp_path / "measured.json"
    assert main(["configs", "--layers", str(layers), "--group-sizes", "1", "2", "--seq-len", "tiny-bert=8", "--out",
                 str(out)]) == 0
    profiles = ProfileSet.load(out)
    assert [c.config.key() for c in profiles.models["tiny-bert"].configs] == ["op1-pp1", "op1-pp2", "op2-pp1"]
    assert "op1-pp2" in capsys.readouterr().out


def test_co_run_probe_alternates_alone_and_together_phases(tmp_path):
    from parallel.profiler import measure_co_run_slowdown

    source = make_tiny_vit(tmp_path / "vit")
    assert measure_co_run_slowdown(source, 1, phase_seconds=0.05, phases=4) >= 1.0
    with pytest.raises(ValueError, match="phases"):
        measure_co_run_slowdown(source, 1, phases=3)
    with pytest.raises(ValueError, match="processes"):
        measure_co_run_slowdown(source, 1, processes=1)


def _fake_proc(root, host_ticks: int, processes: dict[int, tuple[int, int]]) -> None:
    """A /proc with the host's busy ticks (all in user time) and processes {pid: (parent pid, ticks)}."""
    root.mkdir(exist_ok=True)
    (root / "stat").write_text(f"cpu  {host_ticks} 0 0 1000 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n")
    for pid, (parent, ticks) in processes.items():
        (root / str(pid)).mkdir(exist_ok=True)
        fields = ["S", str(parent)] + ["0"] * 9 + [str(ticks), "0"] + ["0"] * 10
        (root / str(pid) / "stat").write_text(f"{pid} (python) " + " ".join(fields) + "\n")


def test_the_foreign_load_meter_counts_the_host_cpu_outside_our_process_tree(tmp_path, monkeypatch):
    from parallel import profiler

    proc = tmp_path / "proc"
    clock = iter([10.0, 12.0])  # start, stop: a 2 s span
    monkeypatch.setattr(profiler, "PROC_ROOT", proc)
    monkeypatch.setattr(profiler, "_clock_ticks_per_s", lambda: 100)
    monkeypatch.setattr(profiler.time, "perf_counter", lambda: next(clock))
    # Ours: the driver (pid 10) and an actor under it (11); a stranger (20) that is not ours.
    _fake_proc(proc, host_ticks=1000, processes={10: (1, 100), 11: (10, 100), 20: (1, 500)})
    meter = profiler.ForeignLoadMeter(root_pid=10)
    meter.start()
    # Over 2 s: ours spend 1.5 + 1.0 CPU seconds, a new process of ours (12) 0.5, the host 4.0 in all.
    _fake_proc(proc, host_ticks=1400, processes={10: (1, 250), 11: (10, 200), 12: (11, 50), 20: (1, 500)})
    assert meter.stop() == pytest.approx((4.0 - 1.5 - 1.0 - 0.5) / 2)  # 0.5 foreign cores
    assert profiler.host_busy_cpu_s() == pytest.approx(14.0)


def test_the_host_cpu_reader_splits_idle_from_busy(tmp_path):
    from parallel.host_cpu import read_host_cpu_s

    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice: guest time is inside user, not added again.
    stat.write_text("cpu  100 10 50 800 40 5 3 2 70 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    cpu = read_host_cpu_s(stat, ticks_per_s=100)
    assert cpu.idle_s == pytest.approx(8.4) and cpu.total_s == pytest.approx(10.1)
    assert cpu.busy_s == pytest.approx(1.7)
    stat.write_text("cpu  100 0 50 800\n")  # an older kernel's shorter line
    assert read_host_cpu_s(stat, ticks_per_s=100) == (pytest.approx(8.0), pytest.approx(9.5))
    stat.write_text("intr 1 2 3\n")
    assert read_host_cpu_s(stat) is None
    assert read_host_cpu_s(tmp_path / "missing") is None
