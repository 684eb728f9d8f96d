"""The baseline of `parallel_runtime`'s per-hop comparison: the pickled-socket activation links that the stage transport
(`parallel.stage_transport`) replaced, rebuilt for the benchmark only.

As the former `parallel/activation_links.py` did: every relay actor listens on 127.0.0.1, connects to the next
actor's listener (the last to the owner's), and its loop reads a frame, runs `forward` and writes the output as a
frame to the next socket; the owner writes each request once to the first actor from a sender thread and a receiver
thread resolves each request's future from the last actor's frames. A frame is an 8-byte big-endian length and a
pickle of `(request_id, body)`, CPU tensors pickled as their raw bytes, dtype and shape (the links' own reducer,
`_FramePickler`) and rebuilt from a copy of those bytes. The links' token handshake, failure frames and multi-node
addresses are left out: they cost nothing per request.
"""

from __future__ import annotations

import io
import itertools
import pickle
import queue
import socket
import struct
import threading
from concurrent.futures import Future
from typing import Any, Sequence

import torch

#: Frame header: the payload's length in bytes (a format string: a `struct.Struct` does not pickle, and Ray pickles
#: the relay class by value when the benchmark runs as a script).
FRAME_FORMAT = "!Q"
FRAME_HEADER_BYTES = struct.calcsize(FRAME_FORMAT)
LOOPBACK_HOST = "127.0.0.1"


def _tensor_from_bytes(data: bytes, dtype_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    dtype = getattr(torch, dtype_name)
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


class _FramePickler(pickle.Pickler):
    """Pickles CPU tensors as their raw bytes, dtype and shape (the links' reducer)."""

    def reducer_override(self, obj: Any) -> Any:
        if (isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.layout == torch.strided
                and not obj.requires_grad and type(obj) is torch.Tensor):
            raw = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            return _tensor_from_bytes, (raw, str(obj.dtype).removeprefix("torch."), tuple(obj.shape))
        return NotImplemented


def send_frame(sock: socket.socket, obj: Any) -> None:
    buffer = io.BytesIO()
    buffer.write(bytes(FRAME_HEADER_BYTES))
    _FramePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    frame = buffer.getbuffer()
    struct.pack_into(FRAME_FORMAT, frame, 0, len(frame) - FRAME_HEADER_BYTES)
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
    (length,) = struct.unpack(FRAME_FORMAT, _recv_exactly(sock, FRAME_HEADER_BYTES))
    return pickle.loads(_recv_exactly(sock, length))


def _no_delay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _listen() -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((LOOPBACK_HOST, 0))
    listener.listen()
    return listener


def _serve_stage(listener: socket.socket, downstream: tuple[str, int], forward) -> None:
    """A relay's link loop: connect downstream, accept upstream, then read, run and write on every frame."""
    sockets: list[socket.socket] = []
    try:
        out = _no_delay(socket.create_connection(downstream))
        sockets.append(out)
        upstream = _no_delay(listener.accept()[0])
        sockets.append(upstream)
        while True:
            request_id, body = recv_frame(upstream)
            send_frame(out, (request_id, forward(body)))
    except (OSError, EOFError):
        pass
    finally:
        listener.close()
        for sock in sockets:
            sock.close()


class PickleSocketRelay:
    """A Ray actor body: one stage of the former links whose `forward` relays its input unchanged."""

    def __init__(self):
        torch.set_num_threads(1)

    def forward(self, state: Any) -> Any:
        return state

    def open_link(self) -> tuple[str, int]:
        self._listener = _listen()
        return self._listener.getsockname()[:2]

    def start_link(self, downstream: tuple[str, int]) -> None:
        threading.Thread(target=_serve_stage, args=(self._listener, tuple(downstream), self.forward),
                         name="activation-link", daemon=True).start()


class PickleSocketLinks:
    """The owner's end of a chain of `PickleSocketRelay` actors (the former `PipelineLinks`, one shard per stage):
    `submit` returns a future of the last actor's output."""

    def __init__(self, actors: Sequence):
        import ray

        listener = _listen()
        try:
            addresses = ray.get([actor.open_link.remote() for actor in actors])
            following = [*addresses[1:], listener.getsockname()[:2]]
            ray.get([actor.start_link.remote(address) for actor, address in zip(actors, following)])
            self._input = _no_delay(socket.create_connection(tuple(addresses[0])))
            self._output = _no_delay(listener.accept()[0])
        finally:
            listener.close()
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._send_loop, name="activation-link sender", daemon=True).start()
        threading.Thread(target=self._receive_loop, name="activation-link receiver", daemon=True).start()

    def submit(self, state: Any) -> Future:
        future: Future = Future()
        with self._lock:
            request_id = next(self._ids)
            self._pending[request_id] = future
        self._outbox.put((request_id, state))
        return future

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            try:
                send_frame(self._input, item)
            except OSError:
                return

    def _receive_loop(self) -> None:
        while True:
            try:
                request_id, body = recv_frame(self._output)
            except (OSError, EOFError) as error:
                with self._lock:
                    pending, self._pending = self._pending, {}
                for future in pending.values():
                    future.set_exception(RuntimeError(f"the last relay's link closed: {error}"))
                return
            with self._lock:
                future = self._pending.pop(request_id)
            future.set_result(body)

    def close(self) -> None:
        self._outbox.put(None)
        for sock in (self._input, self._output):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
