"""The stage transport without Ray: headers, a two-stage pipeline over gloo in threads of this process (variable
shapes and dtypes, a stage's failure passed on, the stop), and a dead stage process that breaks the pipeline."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import threading

import pytest
import torch

from models.layers import ActivationState
from parallel.stage_transport import (
    INLINE,
    INLINE_LIMIT_BYTES,
    KIND_BROKEN,
    KIND_FAILURE,
    KIND_STATE,
    KIND_STOP,
    MAX_NDIM,
    Member,
    Message,
    TransportSpec,
    as_bytes,
    build_state,
    decode_header,
    device_key,
    encode_header,
    nccl_edge,
    pack_header,
    serve_stage,
    unpack_header,
)

#: Generous: a spawned stage process imports torch on a machine that may be busy.
TIMEOUT_S = 120.0
LOOPBACK = "127.0.0.1"


def _store():
    import torch.distributed as dist

    return dist.TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _join_all(spec: TransportSpec, store, ranks: list[int]) -> dict[int, Member]:
    """Every rank in `ranks` joins in its own thread (a join returns once every member joined)."""
    members: dict[int, Member] = {}
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        try:
            members[rank] = Member.join(spec, rank, torch.device("cpu"), f"rank {rank}",
                                        store if rank == 0 else None)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert not errors, errors
    return members


def _state_equal(a: ActivationState, b: ActivationState) -> bool:
    def same(x, y):
        return (x is None and y is None) or (x is not None and y is not None and x.dtype == y.dtype
                                             and x.shape == y.shape and torch.equal(x, y))

    return (same(a.hidden, b.hidden) and same(a.attention_mask, b.attention_mask)
            and same(a.attention_bias, b.attention_bias) and a.extras.keys() == b.extras.keys()
            and all(same(a.extras[k], b.extras[k]) for k in a.extras))


STATES = {
    "text": ActivationState(hidden=torch.randn(2, 7, 16), attention_mask=torch.ones(2, 7, dtype=torch.long),
                            attention_bias=torch.zeros(2, 1, 1, 7)),
    "other-length": ActivationState(hidden=torch.randn(3, 12, 16), attention_mask=torch.ones(3, 12, dtype=torch.long)),
    "extras": ActivationState(hidden=torch.randn(1, 5, 8), extras={
        "gamma": torch.tensor(3), "sizes": torch.ones(1, 5, 1, dtype=torch.bfloat16),
        "keep": torch.tensor([True, False, True])}),
    "transposed": ActivationState(hidden=torch.randn(4, 6).t()),
    "empty": ActivationState(hidden=torch.empty(0, 4), extras={"half": torch.ones(2, dtype=torch.float16)}),
}


@pytest.mark.parametrize("name", list(STATES))
def test_a_header_message_describes_every_tensor_and_carries_the_small_ones(name):
    state = STATES[name]
    header, text, inline, payloads = encode_header(Message(KIND_STATE, 41, state))
    kind, request_id, specs, text_out, carried = unpack_header(pack_header(header, text, inline))
    assert (kind, request_id, text_out) == (KIND_STATE, 41, text.decode())
    assert len(carried) == len(inline) and not payloads  # every tensor of these states is small
    rebuilt = build_state(specs, carried, text_out)
    assert _state_equal(rebuilt, state)


def test_a_large_tensor_travels_as_its_own_payload_from_its_own_memory():
    hidden = torch.randn(64, 384)
    state = ActivationState(hidden=hidden, attention_mask=torch.ones(1, 64, dtype=torch.long))
    header, text, inline, payloads = encode_header(Message(KIND_STATE, 3, state))
    assert hidden.numel() * 4 > INLINE_LIMIT_BYTES
    assert len(payloads) == 1 and as_bytes(payloads[0]).data_ptr() == hidden.data_ptr()  # no copy
    _, _, specs, _, carried = unpack_header(pack_header(header, text, inline))
    assert [spec.where == INLINE for spec in specs] == [False, True]
    assert torch.equal(carried[0], state.attention_mask)
    assert not encode_header(Message(KIND_STATE, 3, state), inline=False)[2]  # NCCL edges: every tensor apart


def test_a_state_the_header_cannot_describe_is_refused_naming_the_limit():
    deep = ActivationState(hidden=torch.zeros((1,) * (MAX_NDIM + 1)))
    with pytest.raises(ValueError, match=f"'hidden' has {MAX_NDIM + 1} dimensions; the transport's limit is"):
        encode_header(Message(KIND_STATE, 0, deep))
    with pytest.raises(ValueError, match="not a stage transport header"):
        decode_header(torch.zeros_like(encode_header(Message(KIND_STOP))[0]))


def test_edges_between_two_gpus_take_nccl_and_every_other_edge_gloo():
    assert device_key(torch.device("cpu")) == "cpu"
    assert nccl_edge("cuda:a", "cuda:b")
    assert not nccl_edge("cuda:a", "cuda:a")  # NCCL refuses two ranks on one GPU
    assert not nccl_edge("cuda:a", "cpu") and not nccl_edge("cpu", "cpu")


def _double(state: ActivationState) -> ActivationState:
    if state.hidden.dtype != torch.float32:
        raise ValueError("stage wants float32")
    return ActivationState(hidden=state.hidden * 2, attention_mask=state.attention_mask, extras=state.extras)


def test_two_stages_pipeline_requests_of_any_shape_pass_failures_on_and_stop():
    store = _store()
    spec = TransportSpec(host=LOOPBACK, port=store.port, key="t", rows=((0,), (1,)), timeout_s=TIMEOUT_S)
    members = _join_all(spec, store, [0, 1, 2])
    stages = [threading.Thread(target=serve_stage, args=(members[rank], _double), daemon=True) for rank in (0, 1)]
    for stage in stages:
        stage.start()
    owner = members[spec.owner_rank]
    inputs = [STATES["text"], STATES["other-length"], ActivationState(hidden=torch.ones(3, dtype=torch.long)),
              STATES["extras"], ActivationState(hidden=torch.randn(512, 1024)),  # 2 MB: larger payload receives
              ActivationState(hidden=torch.randn(300, 1024), extras={"big": torch.randn(1200, 1024)}),  # 2 payloads
              STATES["text"]]
    sender = threading.Thread(target=lambda: [owner.send(Message(KIND_STATE, i, s), [0]) for i, s in enumerate(inputs)]
                              + [owner.send(Message(KIND_FAILURE, 9, text="upstream failed"), [0]),
                                 owner.send(Message(KIND_STOP), [0])])
    sender.start()
    answers = [owner.receive(1) for _ in range(len(inputs) + 2)]
    sender.join(TIMEOUT_S)
    assert [a.request_id for a in answers[:8]] == [0, 1, 2, 3, 4, 5, 6, 9]
    for answer, state in zip(answers[:2], inputs[:2]):
        assert answer.kind == KIND_STATE and torch.equal(answer.state.hidden, state.hidden * 4)
        assert torch.equal(answer.state.attention_mask, state.attention_mask)
    assert answers[2].kind == KIND_FAILURE and answers[2].text.startswith("rank 0 failed")
    assert "stage wants float32" in answers[2].text
    assert _state_equal(answers[3].state, _double(_double(STATES["extras"])))  # the stage survived the failure
    assert torch.equal(answers[4].state.hidden, inputs[4].hidden * 4)
    assert _state_equal(answers[5].state, _double(_double(inputs[5])))
    assert torch.equal(answers[6].state.hidden, inputs[6].hidden * 4)  # small again after the large ones
    assert (answers[7].kind, answers[7].text) == (KIND_FAILURE, "upstream failed")  # passed on, not computed
    assert answers[8].kind == KIND_STOP
    for stage in stages:
        stage.join(TIMEOUT_S)
        assert not stage.is_alive()
    for member in members.values():
        member.close()


def _stage_process(port: int, rank: int) -> None:
    spec = TransportSpec(host=LOOPBACK, port=port, key="d", rows=((0,), (1,)), timeout_s=TIMEOUT_S)
    serve_stage(Member.join(spec, rank, torch.device("cpu"), f"stage {rank}"), _double)


def test_a_dead_stage_breaks_the_pipeline_and_the_owner_hears_it_naming_the_stage_after_it():
    store = _store()
    spec = TransportSpec(host=LOOPBACK, port=store.port, key="d", rows=((0,), (1,)), timeout_s=TIMEOUT_S)
    process = multiprocessing.get_context("spawn").Process(target=_stage_process, args=(store.port, 0), daemon=True)
    process.start()
    try:
        members = _join_all(spec, store, [1, 2])
        members[1].label = "stage 1"
        stage = threading.Thread(target=serve_stage, args=(members[1], _double), daemon=True)
        stage.start()
        owner = members[spec.owner_rank]
        owner.send(Message(KIND_STATE, 0, ActivationState(hidden=torch.ones(2))), [0])
        assert torch.equal(owner.receive(1).state.hidden, torch.full((2,), 4.0))
        os.kill(process.pid, signal.SIGKILL)
        broken = owner.receive(1)
        assert broken.kind == KIND_BROKEN and broken.text.startswith("stage 1: its link from upstream broke")
        assert "the link from stage 0 (rank 0) broke" in broken.text  # names the dead peer
        stage.join(TIMEOUT_S)
        assert not stage.is_alive()
    finally:
        process.kill()
        process.join(TIMEOUT_S)
