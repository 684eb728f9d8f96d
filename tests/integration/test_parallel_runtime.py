"""The model-parallel runtime on real Ray actors: exact outputs, pipelining, failure and rebuild, Serve bundles."""

from __future__ import annotations

import pytest
import ray
import torch
from waiting import wait_until

from models.layers import ActivationState, run_layers
from parallel.group_runtime import GroupFailedError, ModelParallelGroup
from parallel.plan import ParallelPlan
from parallel.stage_layers import example_input, load_model
from parallel.tiny_models import make_tiny_bert

pytestmark = pytest.mark.ray

MAX_ABS_DIFF = 1e-5
NUM_REQUESTS = 4
SEQ_LEN_TOKENS = 12
#: Seconds to wait for a killed actor to be gone, and between pings meanwhile.
KILL_TIMEOUT_S = 30.0
KILL_POLL_S = 0.05


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    source = make_tiny_bert(tmp_path_factory.mktemp("bert"))
    model = load_model(source)
    states = [example_input(model, 2, SEQ_LEN_TOKENS, seed=i) for i in range(NUM_REQUESTS)]
    with torch.inference_mode():
        expected = [run_layers(model.layers(), state).hidden for state in states]
    return source, model, states, expected


@pytest.fixture(scope="module")
def group(ray_serve, tiny):
    source, model, _, _ = tiny
    # 2 pipeline stages x 2 tensor-parallel shards: 4 actors, each stage's shards in one gloo group.
    plan = ParallelPlan.even(len(model.layers()), pipeline_stages=2, intra_op_degree=2)
    group = ModelParallelGroup(source, plan)
    yield group
    group.shutdown()


def _max_diff(outputs, expected) -> float:
    return max((out.hidden - exp).abs().max().item() for out, exp in zip(outputs, expected))


def test_pipelined_tensor_parallel_group_matches_unsplit_model(group, tiny):
    _, _, states, expected = tiny
    outputs = group.infer_many(states)
    assert _max_diff(outputs, expected) <= MAX_ABS_DIFF
    # Each actor holds only its stage's share: stage 0 has the (whole) embeddings, stage 1 half a block.
    (first0, first1), (second0, second1) = group.weight_bytes
    assert first0 == first1 and second0 == second1
    assert second0 < first0


def test_stage_one_runs_the_next_request_while_stage_two_runs_the_previous(group, tiny):
    _, _, states, _ = tiny
    before = [len(ray.get(row[0].call_log.remote())) for row in group.actors]
    group.infer_many(states)
    first = ray.get(group.actors[0][0].call_log.remote())[before[0]:]
    second = ray.get(group.actors[1][0].call_log.remote())[before[1]:]
    assert len(first) == len(second) == NUM_REQUESTS
    # Requests run in order on every stage, and stage 0 started request i+1 before stage 1 finished request i.
    assert all(a[1] <= b[0] for a, b in zip(first, first[1:]))
    assert any(first[i + 1][0] < second[i][1] for i in range(NUM_REQUESTS - 1))


def test_a_request_a_stage_fails_on_fails_alone_and_the_group_goes_on(group, tiny):
    _, _, states, expected = tiny
    bad = ActivationState(hidden=torch.ones(2, SEQ_LEN_TOKENS))  # float where the embeddings take token ids
    pending = [group.submit(states[0]), group.submit(bad), group.submit(states[1])]
    assert _max_diff([group.result(pending[0])], expected[:1]) <= MAX_ABS_DIFF
    with pytest.raises(GroupFailedError, match=r"stage 0 shard \d of 'tiny-bert' failed"):
        group.result(pending[1])
    assert _max_diff([group.result(pending[2])], expected[1:2]) <= MAX_ABS_DIFF
    assert group.transport.broken is None


def test_no_answer_within_the_timeout_is_a_group_failure_naming_it(group):
    from concurrent.futures import Future

    with pytest.raises(GroupFailedError, match=r"'tiny-bert': no result within 0.01 s"):
        group.result(Future(), timeout_s=0.01)  # a future nothing ever answers


def _process_gone(pid: int) -> bool:
    """The process has exited (or is a zombie waiting for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _kill_and_wait(actor, timeout_s: float = KILL_TIMEOUT_S) -> None:
    """Kill `actor` and wait until its process is gone. `ray.kill` returns at once, and Ray reports the actor dead
    before its process exits: a request over the stage transport (which bypasses Ray) could still pass through it."""
    from ray.exceptions import RayActorError

    pid = ray.get(actor.ping.remote())
    ray.kill(actor)

    def gone() -> bool:
        try:
            ray.get(actor.ping.remote(), timeout=timeout_s)
        except RayActorError:
            return _process_gone(pid)
        return False

    wait_until(gone, timeout_s, interval_s=KILL_POLL_S, message=f"actor process {pid} still there after ray.kill")


def test_dead_actor_is_a_clear_error_and_the_group_rebuilds(group, tiny):
    _, _, states, expected = tiny
    _kill_and_wait(group.actors[1][0])
    with pytest.raises(GroupFailedError, match=r"stage 1 shard 0 .*died"):
        group.infer(states[0])
    group.rebuild()
    assert _max_diff([group.infer(states[0])], expected[:1]) <= MAX_ABS_DIFF


def test_group_inside_a_serve_replica_uses_its_placement_group_bundles(ray_serve, tiny):
    from ray import serve

    source, model, states, expected = tiny
    plan = ParallelPlan.even(len(model.layers()), pipeline_stages=2)

    @serve.deployment(ray_actor_options={"num_cpus": 0.25},
                      placement_group_bundles=[{"CPU": 0.25}, {"CPU": 0.5}, {"CPU": 0.5}],
                      placement_group_strategy="PACK")
    class GroupReplica:
        def __init__(self):
            placement_group = ray.util.get_current_placement_group()
            self.placement_group_id = placement_group.id.hex()
            self.group = ModelParallelGroup(source, plan, placement_group=placement_group, bundle_indices=[1, 2])

        def placement(self) -> dict:
            actor_groups = ray.get([row[0].placement_group_id.remote() for row in self.group.actors])
            return {"replica": self.placement_group_id, "actors": actor_groups}

        def __call__(self, state):
            return self.group.infer(state).hidden

    handle = serve.run(GroupReplica.bind(), name="parallel-group-test", route_prefix=None)
    try:
        output = handle.remote(states[1]).result(timeout_s=120)
        assert (output - expected[1]).abs().max().item() <= MAX_ABS_DIFF
        placement = handle.placement.remote().result(timeout_s=60)
        assert placement["actors"] == [placement["replica"]] * 2
    finally:
        serve.delete("parallel-group-test")


def test_bad_bundle_indices_are_refused(tiny):
    source, model, _, _ = tiny
    with pytest.raises(ValueError, match="bundle_indices"):
        ModelParallelGroup(source, ParallelPlan.even(len(model.layers()), 2), bundle_indices=[0, 1])


def test_comm_profile_fits_sends_and_collectives_between_actors(ray_serve):
    from parallel.profiler import profile_comm

    sizes = (4_096, 262_144, 1_048_576)
    comm = profile_comm(degrees=(2,), sizes_bytes=sizes, repeats=2, warmup=1)
    assert comm.send.num_samples == len(sizes)
    assert set(comm.all_reduce) == set(comm.all_gather) == {2}
    assert comm.send_s(sizes[-1]) > 0 and comm.all_reduce_s(sizes[-1], 2) > 0 and comm.all_gather_s(sizes[-1], 2) > 0
    assert comm.all_reduce_s(sizes[-1], 1) == 0.0
    # Degrees that were not measured extrapolate along a ring from the nearest measured one.
    assert comm.all_reduce_s(sizes[-1], 4) >= comm.all_reduce_s(sizes[-1], 2)
    # The per-hop overhead of the runtime's call pattern is measured with the sends and stored with them.
    from parallel.profiler import DEFAULT_HOP_PAYLOAD_BYTES, host_cores

    assert comm.hop is not None and comm.hop.payload_bytes >= DEFAULT_HOP_PAYLOAD_BYTES
    assert comm.hop.host_cores == host_cores()
    assert comm.hop.cpu_s + comm.hop.request_cpu_s > 0  # relaying costs some CPU in some Ray process
    assert comm.hop.latency_s + comm.hop.request_latency_s > 0
    assert 0 <= comm.hop.background_cpu_cores < comm.hop.host_cores


def test_sharded_block_profile_times_every_block_and_prices_the_megatron_stage(ray_serve, tiny):
    from parallel.comm_model import AlphaBeta, CommModel
    from parallel.configurations import ModelPlanner, block_prefix
    from parallel.profiler import profile_layers, shape_key
    from parallel.sharded_profile import profile_sharded_blocks
    from parallel.tensor_parallel import BlockShardingPlan

    source, model, _, _ = tiny
    profile = profile_layers(source, [2], [SEQ_LEN_TOKENS], warmup=1, repeats=2, model=model)
    sharded = profile_sharded_blocks(profile, degrees=(2,), warmup=1, repeats=2)
    key = shape_key(2, SEQ_LEN_TOKENS)
    blocks = [layer for layer in sharded.layers if layer.kind == "block"]
    assert blocks and all(layer.sharded_latency_s[2][key] > 0 for layer in blocks)
    assert all(not layer.sharded_latency_s for layer in sharded.layers if layer.kind != "block")
    assert all(not layer.sharded_latency_s for layer in profile.layers)  # the input profile is left as it was
    # The planner prices a Megatron-sharded stage at the blocks' measured latency plus the rest of its layers.
    fit = AlphaBeta(alpha_s=1e-4, beta_s_per_byte=0.0)
    planner = ModelPlanner(sharded, CommModel(send=fit, all_reduce={2: fit}, all_gather={2: fit}), SEQ_LEN_TOKENS)
    megatron = {f"{block_prefix(layer.index)}{name}": choice for layer in blocks
                for name, choice in BlockShardingPlan.megatron().as_dict().items()}
    rest = sum(layer.latency_s[key] for layer in sharded.layers if layer.kind != "block")
    expected = planner.receive_s(0, 2) + rest + sum(layer.sharded_latency_s[2][key] for layer in blocks)
    assert planner.predict_stage_s(0, len(sharded.layers), 2, 2, megatron) == pytest.approx(expected)
    # What each shard computes leaves the collectives out: half of every block's whole latency, plus the rest.
    compute = rest + sum(layer.latency_s[key] for layer in blocks) / 2
    assert planner.predict_stage_compute_s(0, len(sharded.layers), 2, 2, megatron) == pytest.approx(compute)
