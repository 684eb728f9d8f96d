"""Direct activation links between pipeline stages: every stage actor reads its input from a socket and writes its
output straight to the next stage's; the group's owner writes each request once to the first stage and reads the
answer from the last.

AlpaServe §3 pipelines consecutive requests through the stages of inter-op parallelism, and §3.3 prices the
communication between stages as a point-to-point send of the activation. Relaying each activation through Ray actor
calls would cost, per stage, a task submission by the owner, the object's trip through its owner, and the worker's
task overhead: milliseconds of CPU per hop on a CPU host, a sizeable share of a stage's compute, plus more per
request in the owner and the raylet. Over a link a hop is one pickled frame on a socket. Ray still creates, places,
sets up and kills the actors and carries their control calls (`setup`, `ping`, `memory_report`).

Wiring (`PipelineLinks`): every actor opens a listener (`StageLinkEndpoint.open_link`), on 127.0.0.1 when the whole
group and its owner share one node, else on the node's address; each actor then connects to every shard of the next
stage (shard 0 only: the other shards of a stage compute the same output for their collectives and send nothing),
the last stage to the owner; the owner connects to every shard of the first stage. The first frame on every
connection is the group's random token, so a stray connection to a listener is dropped.

Frames: an 8-byte big-endian length, then a pickle of `(request_id, body)`, where body is an `ActivationState` or
a `StageFailure` (a stage's exception as text, passed on to the owner without computing). A stage runs its requests
in arrival order. When a peer dies its sockets close, every stage closes its own in turn, and the owner fails every
request in flight with a `LinkError` naming the dead actor (its `diagnose` callback asks Ray).
"""

from __future__ import annotations

import hmac
import io
import itertools
import logging
import pickle
import queue
import secrets
import socket
import struct
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

logger = logging.getLogger(__name__)

#: Frame header: the payload's length in bytes.
FRAME_HEADER = struct.Struct("!Q")
#: Random bytes of a group's token (the first frame on every connection).
TOKEN_BYTES = 16
#: Listen address when the whole group and its owner share one node.
LOOPBACK_HOST = "127.0.0.1"
#: How long a listener waits for its peer to connect, and the owner for the actors' link calls.
CONNECT_TIMEOUT_S = 60.0

Address = tuple[str, int]


class LinkError(RuntimeError):
    """A request could not complete over the links: a stage failed on it, or a link broke (a dead actor)."""


@dataclass(frozen=True)
class StageFailure:
    """A stage's exception on one request, passed down the pipeline to the owner instead of an activation."""

    message: str


# ---- frames ----


def _tensor_from_bytes(data: bytes, dtype_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    dtype = getattr(torch, dtype_name)
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


class _FramePickler(pickle.Pickler):
    """Pickles CPU tensors as their raw bytes, dtype and shape: a tenth of the CPU of torch's own reducer (which
    writes each storage through `torch.save`) for an activation of 64 x 384 floats."""

    def reducer_override(self, obj: Any) -> Any:
        if (isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.layout == torch.strided
                and not obj.requires_grad and type(obj) is torch.Tensor):
            raw = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            return _tensor_from_bytes, (raw, str(obj.dtype).removeprefix("torch."), tuple(obj.shape))
        return NotImplemented


def send_frame(sock: socket.socket, obj: Any) -> None:
    buffer = io.BytesIO()
    buffer.write(bytes(FRAME_HEADER.size))
    _FramePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    frame = buffer.getbuffer()
    FRAME_HEADER.pack_into(frame, 0, len(frame) - FRAME_HEADER.size)
    sock.sendall(frame)
    frame.release()


def _recv_exactly(sock: socket.socket, num_bytes: int) -> bytearray:
    buffer = bytearray(num_bytes)
    view, received = memoryview(buffer), 0
    while received < num_bytes:
        count = sock.recv_into(view[received:])
        if count == 0:
            raise EOFError("the peer closed the link")
        received += count
    return buffer


def recv_frame(sock: socket.socket) -> Any:
    (length,) = FRAME_HEADER.unpack(_recv_exactly(sock, FRAME_HEADER.size))
    return pickle.loads(_recv_exactly(sock, length))


def _no_delay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def listen_host(loopback: bool) -> str:
    """Where a link listens: 127.0.0.1 when the whole group and its owner share one node, else this node's address."""
    if loopback:
        return LOOPBACK_HOST
    import ray

    return ray.util.get_node_ip_address()


def listen(host: str) -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen()
    return listener


def connect(address: Address, token: bytes, timeout_s: float = CONNECT_TIMEOUT_S) -> socket.socket:
    """Connect to a listener and present the group's token."""
    sock = _no_delay(socket.create_connection(tuple(address), timeout=timeout_s))
    sock.settimeout(None)
    send_frame(sock, token)
    return sock


def accept(listener: socket.socket, token: bytes, timeout_s: float = CONNECT_TIMEOUT_S) -> socket.socket:
    """The first connection that presents the group's token (others are closed); TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        listener.settimeout(max(0.0, deadline - time.monotonic()))
        sock, peer = listener.accept()
        sock.settimeout(max(0.0, deadline - time.monotonic()))
        try:
            presented = recv_frame(sock)
        except (OSError, EOFError, pickle.UnpicklingError):
            presented = None
        if isinstance(presented, bytes) and hmac.compare_digest(presented, token):
            sock.settimeout(None)
            return _no_delay(sock)
        logger.warning("activation link: dropped a connection from %s without the group's token", peer)
        sock.close()


# ---- the stage side ----


def serve_stage(listener: socket.socket, token: bytes, downstream: Sequence[Address],
                forward: Callable[[Any], Any], label: str) -> None:
    """A stage's link loop: connect to the next stage's shards (or the owner), accept the upstream peer, then run
    every request that arrives and send its output on. Ends when a link closes, closing the stage's own links."""
    sockets: list[socket.socket] = []
    try:
        outputs = [connect(address, token) for address in downstream]
        sockets += outputs
        upstream = accept(listener, token)
        sockets.append(upstream)
        while True:
            request_id, body = recv_frame(upstream)
            if not isinstance(body, StageFailure):
                try:
                    body = forward(body)
                except Exception as error:  # noqa: BLE001 - the request fails, the stage goes on
                    logger.exception("%s failed on request %d", label, request_id)
                    body = StageFailure(f"{label} failed: {error!r}")
            for sock in outputs:
                send_frame(sock, (request_id, body))
    except (OSError, EOFError) as error:
        logger.info("%s: activation link closed (%s)", label, error)
    finally:
        listener.close()
        for sock in sockets:
            sock.close()


class StageLinkEndpoint:
    """Mixed into an actor body with a `forward(state)` method: lets `PipelineLinks` wire it into a pipeline."""

    def link_label(self) -> str:
        return type(self).__name__

    def link_node_id(self) -> str:
        """The Ray node this actor runs on, for the owner's choice between loopback and node addresses."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def open_link(self, loopback: bool) -> Address:
        """Open this actor's listener, on 127.0.0.1 or on its node's address; returns the listener's address."""
        self._link_listener = listen(listen_host(loopback))
        return self._link_listener.getsockname()[:2]

    def start_link(self, token: bytes, downstream: list[Address]) -> None:
        """Start the link loop (a thread: the actor keeps answering its control calls)."""
        threading.Thread(target=serve_stage, name=f"activation-link {self.link_label()}", daemon=True,
                         args=(self._link_listener, token, downstream, self.forward, self.link_label())).start()

    def rendezvous_address(self) -> Address:
        """This actor's node address and a free port on it, where a stage's shards meet to form their process group
        (`torch.distributed`'s TCP rendezvous)."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return listen_host(loopback=False), port


# ---- the owner side ----


class PipelineLinks:
    """The owner's end of a pipeline of `StageLinkEndpoint` actors: rows[s] are the shards of stage s.

    `submit` returns a `concurrent.futures.Future` of the last stage's output; requests pipeline through the
    stages. `diagnose` (optional) is called once when a link breaks and returns the reason the pending requests
    fail with (e.g. which actor died)."""

    def __init__(self, rows: Sequence[Sequence], diagnose: Callable[[], str] | None = None,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S):
        import ray

        if not rows or not all(rows):
            raise ValueError("PipelineLinks needs at least one stage with at least one actor")
        self._diagnose = diagnose
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._broken: str | None = None
        self._breaking = False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        token = secrets.token_bytes(TOKEN_BYTES)
        nodes = ray.get([actor.link_node_id.remote() for row in rows for actor in row], timeout=connect_timeout_s)
        one_node = set(nodes) == {ray.get_runtime_context().get_node_id()}
        listener = listen(listen_host(one_node))
        try:
            addresses = [ray.get([actor.open_link.remote(one_node) for actor in row], timeout=connect_timeout_s)
                         for row in rows]
            for s, row in enumerate(rows):
                following = addresses[s + 1] if s + 1 < len(rows) else [listener.getsockname()[:2]]
                ray.get([actor.start_link.remote(token, following if rank == 0 else [])
                         for rank, actor in enumerate(row)], timeout=connect_timeout_s)
            self._inputs = [connect(address, token, connect_timeout_s) for address in addresses[0]]
            self._output = accept(listener, token, connect_timeout_s)
        finally:
            listener.close()
        threading.Thread(target=self._send_loop, name="activation-link sender", daemon=True).start()
        threading.Thread(target=self._receive_loop, name="activation-link receiver", daemon=True).start()

    def submit(self, state: Any) -> Future:
        """Queue one request for the first stage; the future holds the last stage's output or a `LinkError`."""
        future: Future = Future()
        with self._lock:
            if self._broken is not None:
                raise LinkError(self._broken)
            request_id = next(self._ids)
            self._pending[request_id] = future
        self._outbox.put((request_id, state))
        return future

    def close(self) -> None:
        """Fail what is pending, stop the threads and close the owner's sockets (the stages then close theirs)."""
        self._break("the pipeline's links were closed", diagnose=False)

    @property
    def broken(self) -> str | None:
        """Why the links broke, None while they work."""
        return self._broken

    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            try:
                for sock in self._inputs:
                    send_frame(sock, item)
            except OSError as error:
                self._break(f"sending to the first stage failed: {error}")
                return

    def _receive_loop(self) -> None:
        while True:
            try:
                request_id, body = recv_frame(self._output)
            except (OSError, EOFError) as error:
                self._break(f"the last stage's link closed: {error}")
                return
            with self._lock:
                future = self._pending.pop(request_id, None)
            if future is None:
                continue
            try:
                if isinstance(body, StageFailure):
                    future.set_exception(LinkError(body.message))
                else:
                    future.set_result(body)
            except InvalidStateError:
                pass  # the caller gave up on it (timeout, cancellation)

    def _break(self, reason: str, diagnose: bool = True) -> None:
        """Once: find out why (requests submitted meanwhile still queue), then fail every pending request with it
        and close the owner's sockets."""
        with self._lock:
            if self._breaking:
                return
            self._breaking = True
        if diagnose and self._diagnose is not None:
            try:
                reason = self._diagnose() or reason
            except Exception as error:  # noqa: BLE001 - the diagnosis is best effort
                logger.warning("activation link: diagnosing a broken link failed: %s", error)
        with self._lock:
            self._broken = reason
            pending, self._pending = self._pending, {}
        if diagnose:
            logger.warning("activation link broken: %s", reason)
        self._outbox.put(None)
        for sock in [*self._inputs, self._output]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        for future in pending.values():
            try:
                future.set_exception(LinkError(reason))
            except InvalidStateError:
                pass
