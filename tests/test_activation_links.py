"""Activation links between pipeline stages, without Ray: frames, the token handshake, a stage's loop (its
failures travel on as `StageFailure`, a closed link closes the stage's own)."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from models.layers import ActivationState
from parallel.activation_links import (
    LOOPBACK_HOST,
    StageFailure,
    accept,
    connect,
    listen,
    recv_frame,
    send_frame,
    serve_stage,
)

TOKEN = b"0123456789abcdef"
TIMEOUT_S = 10.0


def test_a_frame_carries_an_activation_state_exactly():
    left, right = socket.socketpair()
    with left, right:
        state = ActivationState(hidden=torch.randn(2, 5, 8), attention_mask=torch.ones(2, 5, dtype=torch.long))
        send_frame(left, (7, state))
        request_id, received = recv_frame(right)
    assert request_id == 7
    assert torch.equal(received.hidden, state.hidden) and torch.equal(received.attention_mask, state.attention_mask)


@pytest.mark.parametrize("tensor", [
    torch.randn(3, 5).t(),  # not contiguous
    torch.tensor(2.5),  # 0-dim
    torch.empty(0, 4),
    torch.ones(2, 3, dtype=torch.bfloat16),
    torch.arange(6, dtype=torch.int64).reshape(2, 3),
    torch.tensor([True, False]),
], ids=["transposed", "scalar", "empty", "bfloat16", "int64", "bool"])
def test_frames_carry_tensors_of_any_dtype_and_layout_exactly(tensor):
    left, right = socket.socketpair()
    with left, right:
        send_frame(left, {"t": tensor})
        received = recv_frame(right)["t"]
    assert received.dtype == tensor.dtype and received.shape == tensor.shape
    assert torch.equal(received, tensor)
    received += 1 if tensor.dtype != torch.bool else False  # a writable tensor of its own


def test_a_connection_without_the_group_token_is_dropped():
    listener = listen(LOOPBACK_HOST)
    address = listener.getsockname()[:2]
    stray = connect(address, b"not the token!!!")
    peer = connect(address, TOKEN)
    with listener, stray, peer:
        accepted = accept(listener, TOKEN, timeout_s=TIMEOUT_S)
        with accepted:
            send_frame(peer, "hello")
            assert recv_frame(accepted) == "hello"
        stray.settimeout(TIMEOUT_S)
        assert stray.recv(1) == b""  # the listener closed the stray connection


def _double(state: ActivationState) -> ActivationState:
    if state.hidden.dtype != torch.float32:
        raise ValueError("stage wants float32")
    return ActivationState(hidden=state.hidden * 2)


@pytest.fixture
def stage():
    """A stage loop in a thread between an upstream socket (the test) and a downstream listener (the test)."""
    owner = listen(LOOPBACK_HOST)
    stage_listener = listen(LOOPBACK_HOST)
    address = stage_listener.getsockname()[:2]
    thread = threading.Thread(target=serve_stage, args=(stage_listener, TOKEN, [owner.getsockname()[:2]], _double,
                                                        "stage 0 shard 0"), daemon=True)
    thread.start()
    downstream = accept(owner, TOKEN, timeout_s=TIMEOUT_S)
    upstream = connect(address, TOKEN)
    yield upstream, downstream, thread
    upstream.close()
    downstream.close()
    owner.close()
    thread.join(TIMEOUT_S)


def test_a_stage_runs_its_requests_in_order_and_passes_failures_on(stage):
    upstream, downstream, _ = stage
    send_frame(upstream, (0, ActivationState(hidden=torch.ones(3))))
    send_frame(upstream, (1, ActivationState(hidden=torch.ones(3, dtype=torch.long))))
    send_frame(upstream, (2, StageFailure("stage before failed")))
    send_frame(upstream, (3, ActivationState(hidden=torch.full((3,), 2.0))))
    answers = [recv_frame(downstream) for _ in range(4)]
    assert [request_id for request_id, _ in answers] == [0, 1, 2, 3]
    assert torch.equal(answers[0][1].hidden, torch.full((3,), 2.0))
    assert isinstance(answers[1][1], StageFailure) and "stage 0 shard 0 failed" in answers[1][1].message
    assert "stage wants float32" in answers[1][1].message
    assert answers[2][1] == StageFailure("stage before failed")  # passed on, not computed
    assert torch.equal(answers[3][1].hidden, torch.full((3,), 4.0))  # the stage survived the failure


def test_a_closed_upstream_link_closes_the_stage_downstream(stage):
    upstream, downstream, thread = stage
    upstream.close()
    thread.join(TIMEOUT_S)
    assert not thread.is_alive()
    downstream.settimeout(TIMEOUT_S)
    assert downstream.recv(1) == b""
