"""Stage transport: activations between pipeline stages over `torch.distributed` point-to-point.

AlpaServe §3 pipelines consecutive requests through the stages of inter-op parallelism, and §3.3 prices the
communication between stages as a point-to-point send of the activation. Here every stage actor of a group and the
group's owner (the driver or Ray Serve replica that submits requests) form one process group; each actor runs its
requests in arrival order in a thread: it receives a request's `ActivationState` from the previous stage (stage 0:
from the owner), runs its layers and sends the output to every shard of the next stage (the last stage: to the
owner). Ray still creates, places, sets up and kills the actors and carries their control calls.

Process groups (`torch.distributed.ProcessGroupGloo` / `ProcessGroupNCCL` built on a `TCPStore`, never the default
group, which a tensor-parallel stage's shards use for their collectives):

* gloo, every actor and the owner: each message's header message, of a fixed `HEADER_MESSAGE_BYTES` (int64 header:
  kind, request id, and every tensor's field, dtype, shape and where it travels, so shapes vary from request to
  request; then its text: the names of `extras`, or a failure's message; then its tensors of at most
  `INLINE_LIMIT_BYTES`, an attention mask or a scalar, copied in). On a gloo edge every larger tensor (the hidden
  state) follows as its own message, sent from the tensor's own memory (no pickling, no copy) under its own tag into
  a payload receive the receiver posted ahead and reuses. A gloo send completes only once its receive is posted, so
  each member keeps `HEADERS_PREPOSTED` header receives and `PAYLOAD_PREPOSTED` payload receives posted per peer it
  hears from, re-posted as each message is taken: a stage sends on while the next one still computes. A payload
  larger than those receives is announced by a RESIZE message, followed by one filler per receive posted at the old
  size. An idle stage waits for its next header without a time limit;
* NCCL, the actors only: the tensors between two actors on two different CUDA devices, device to device, after
  their header message on gloo. Every other edge is a gloo edge: the owner's, CPU stages', and two CUDA actors on one
  GPU (NCCL refuses two ranks on one device), whose tensors go through host memory. One code path: an edge's backend
  follows its ends' devices (`nccl_edge`).

Ranks: actor k (stage-major: stage s shard r is k = s * degree + r) is rank k, the owner the last rank. Shard 0 of
a stage sends its output on; the other shards compute the same output for their collectives and send nothing.

Rendezvous (`PipelineTransport`): the first stage's shard 0 starts a `TCPStore` on a free port of its node
(`StageTransportEndpoint.open_rendezvous`) and the owner hands its address, a random key for this pipeline's
entries, the ranks and the world size to every actor (`join_transport`), joining itself at the same time.

Failures: a stage's exception on one request travels on as a FAILURE message and fails only that request. A dead
peer closes its connections: the gloo operation of every peer waiting on it fails at once with a `TransportError`
naming the peer (its label and rank, exchanged at the rendezvous); a stage whose upstream broke sends a BROKEN
message on, and the owner fails every request in flight with a `TransportError` whose text names the dead actor (its
`diagnose` callback asks Ray). Sends (which wait for the receiver to be ready, so they cover
one stage's compute) and NCCL receives give up after `TRANSFER_TIMEOUT_S`; the owner's own wait for an answer has its
own limit (`ModelParallelGroup.result`). Peers on other nodes reach each other on the address gloo and NCCL pick
for the host (set `GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME` to choose the interface).
"""

from __future__ import annotations

import collections
import datetime
import itertools
import json
import logging
import queue
import secrets
import socket
import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from models.layers import ActivationState

logger = logging.getLogger(__name__)

#: How long a send waits for its receiver, and an NCCL receive for its tensors once their header came; also the
#: process groups' own timeout. A send completes when the receiver takes it, so it covers one stage's compute.
TRANSFER_TIMEOUT_S = 300.0
#: How long the rendezvous (store connections, every member joining) may take.
RENDEZVOUS_TIMEOUT_S = 60.0
#: How long the owner waits for its actors to answer at all before the rendezvous (a new actor starts its process).
ACTOR_START_TIMEOUT_S = 300.0
#: An idle stage's wait for its next request's header: no limit in practice (a dead peer ends it at once).
IDLE_WAIT = datetime.timedelta(days=365)
#: Header layout: magic, kind, request id, tensor count, text bytes, then per tensor: field, dtype, where it travels
#: (inline in the header message or as its own payload message), ndim, dims.
MAGIC = 0x504C5853
MAX_TENSORS = 8
MAX_NDIM = 6
TENSOR_SLOTS = 4 + MAX_NDIM
HEADER_FIXED_SLOTS = 5
HEADER_SLOTS = HEADER_FIXED_SLOTS + MAX_TENSORS * TENSOR_SLOTS
#: Message kinds (RESIZE: the next payloads need larger receive buffers; its request id slot holds the bytes).
KIND_STATE, KIND_FAILURE, KIND_BROKEN, KIND_STOP, KIND_RESIZE = 1, 2, 3, 4, 5
KINDS = (KIND_STATE, KIND_FAILURE, KIND_BROKEN, KIND_STOP, KIND_RESIZE)
HEADER_BYTES = HEADER_SLOTS * 8
#: Where inline tensors start in a header message: offsets aligned for any dtype's view.
ALIGN_BYTES = 64
#: The fixed size of a header message (header, text, inline tensors), and so of the receive buffers posted for them.
HEADER_MESSAGE_BYTES = 1 << 16
#: A tensor of at most this many bytes travels inline in its header message (copied: an attention mask, a scalar);
#: a larger one as its own payload message, sent from its own memory.
INLINE_LIMIT_BYTES = 1 << 13
#: The receive buffer a member posts for a peer's payloads until the peer announces a larger one (RESIZE).
INITIAL_PAYLOAD_CAPACITY_BYTES = 1 << 20
#: Header and payload receives a member keeps posted per peer ahead of the messages that take them: a stage may send
#: this many messages on before the next stage takes the first of them, so a spell of jitter in one stage does not
#: stall the other.
HEADERS_PREPOSTED = 2
PAYLOAD_PREPOSTED = 2
#: Where a tensor travels: in its header message, or as its own message (gloo payload tag, or NCCL).
INLINE, OUT_OF_BAND = 0, 1
#: Fields of an `ActivationState`; an extra's name travels in the message text.
FIELD_HIDDEN, FIELD_ATTENTION_MASK, FIELD_ATTENTION_BIAS, FIELD_EXTRA = 0, 1, 2, 3
FIELD_NAMES = ("hidden", "attention_mask", "attention_bias")
#: The dtypes a message carries, by code (the header's dtype slot).
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)
DTYPE_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}
#: gloo tags: header messages and payload messages match their own posted receives, in order per peer.
TAG_HEADER, TAG_PAYLOAD = 0, 1
#: Device key of a member that holds its tensors in host memory.
HOST_DEVICE = "cpu"

Address = tuple[str, int]


class TransportError(RuntimeError):
    """A request could not complete over the stage transport: a stage failed on it, or a peer died."""


@dataclass
class Message:
    """One message between stages: a request's state, a stage's failure on it, a broken pipeline, or the stop."""

    kind: int
    request_id: int = 0
    state: ActivationState | None = None
    text: str = ""


# ---- messages as tensors ----


def _state_tensors(state: ActivationState) -> list[tuple[int, str, torch.Tensor]]:
    fields = [(FIELD_HIDDEN, "", state.hidden), (FIELD_ATTENTION_MASK, "", state.attention_mask),
              (FIELD_ATTENTION_BIAS, "", state.attention_bias)]
    fields += [(FIELD_EXTRA, name, tensor) for name, tensor in state.extras.items()]
    return [(code, name, tensor) for code, name, tensor in fields if tensor is not None]


def _num_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN_BYTES) * ALIGN_BYTES


def inline_offsets(text_len: int, sizes: Sequence[int]) -> list[int]:
    """Byte offsets of a header message's inline tensors: after the header and the text, each aligned."""
    offsets, offset = [], HEADER_BYTES + text_len
    for size in sizes:
        offset = _aligned(offset)
        offsets.append(offset)
        offset += size
    return offsets


def encode_header(message: Message, inline: bool = True) -> tuple[torch.Tensor, bytes, list[torch.Tensor],
                                                                 list[torch.Tensor]]:
    """(header, text bytes, inline tensors, out-of-band tensors, each in order) of a message. With `inline`, every
    tensor of at most `INLINE_LIMIT_BYTES` that still fits the header message travels in it; the others travel as
    payload messages. ValueError when a state has more tensors than `MAX_TENSORS`, a tensor more dimensions than
    `MAX_NDIM`, or a dtype outside `DTYPES`, or its extras' names do not fit the header message; a failure's text
    that does not fit is cut."""
    slots = [0] * HEADER_SLOTS
    inline_tensors: list[torch.Tensor] = []
    payloads: list[torch.Tensor] = []
    text = message.text
    entries = _state_tensors(message.state) if message.kind == KIND_STATE else []
    if len(entries) > MAX_TENSORS:
        raise ValueError(f"an activation state carries {len(entries)} tensors; the transport's limit is "
                         f"{MAX_TENSORS}")
    if message.kind == KIND_STATE:
        names = [name for code, name, _ in entries if code == FIELD_EXTRA]
        text = json.dumps(names) if names else ""
    raw = text.encode()
    room = HEADER_MESSAGE_BYTES - HEADER_BYTES
    if len(raw) > room:
        if message.kind == KIND_STATE:
            raise ValueError(f"the names of an activation state's extras take {len(raw)} bytes; the transport's "
                             f"limit is {room}")
        raw = raw[:room - 3].decode(errors="ignore").encode() + b"..."
    end = HEADER_BYTES + len(raw)
    for index, (code, name, tensor) in enumerate(entries):
        label = name or FIELD_NAMES[code]
        if tensor.dim() > MAX_NDIM:
            raise ValueError(f"activation tensor {label!r} has {tensor.dim()} dimensions; the transport's "
                             f"limit is {MAX_NDIM}")
        if tensor.dtype not in DTYPE_CODES:
            raise ValueError(f"activation tensor {label!r} has dtype {tensor.dtype}; the transport carries "
                             f"{[str(d) for d in DTYPES]}")
        size = _num_bytes(tensor)
        where = OUT_OF_BAND
        if inline and size <= INLINE_LIMIT_BYTES and _aligned(end) + size <= HEADER_MESSAGE_BYTES:
            where, end = INLINE, _aligned(end) + size
            inline_tensors.append(tensor)
        else:
            payloads.append(tensor)
        base = HEADER_FIXED_SLOTS + index * TENSOR_SLOTS
        slots[base:base + 4 + tensor.dim()] = [code, DTYPE_CODES[tensor.dtype], where, tensor.dim(), *tensor.shape]
    slots[:HEADER_FIXED_SLOTS] = [MAGIC, message.kind, message.request_id, len(entries), len(raw)]
    return torch.tensor(slots, dtype=torch.int64), raw, inline_tensors, payloads


@dataclass(frozen=True)
class TensorSpec:
    field: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    where: int = INLINE

    @property
    def num_bytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


def decode_header(header: torch.Tensor) -> tuple[int, int, list[TensorSpec], int]:
    """(kind, request id, tensor specs, text bytes) of a received header; ValueError when it is not one."""
    values = header.tolist()
    magic, kind, request_id, count, text_len = values[:HEADER_FIXED_SLOTS]
    if magic != MAGIC or kind not in KINDS or not 0 <= count <= MAX_TENSORS:
        raise ValueError(f"not a stage transport header (magic {magic:#x}, kind {kind}, {count} tensors)")
    specs = []
    for index in range(count):
        base = HEADER_FIXED_SLOTS + index * TENSOR_SLOTS
        code, dtype, where, ndim = values[base:base + 4]
        specs.append(TensorSpec(code, DTYPES[dtype], tuple(values[base + 4:base + 4 + ndim]), where))
    return kind, request_id, specs, text_len


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's data as a flat uint8 tensor on its device (a view when it is contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=tensor.device)


def pack_header(header: torch.Tensor, text: bytes, inline: Sequence[torch.Tensor],
                out: torch.Tensor | None = None) -> torch.Tensor:
    """A header message as one host buffer: the header, the text, then each inline tensor (as bytes, on the host) at
    its offset; written into `out` (a buffer of `HEADER_MESSAGE_BYTES` reused message after message) when given.
    Returns the used front of the buffer."""
    payloads = [as_bytes(t.cpu()) for t in inline]
    offsets = inline_offsets(len(text), [p.numel() for p in payloads])
    total = offsets[-1] + payloads[-1].numel() if payloads else HEADER_BYTES + len(text)
    if total > HEADER_MESSAGE_BYTES:
        raise ValueError(f"a header message of {total} bytes exceeds the transport's {HEADER_MESSAGE_BYTES}")
    buffer = out[:total] if out is not None else torch.empty(total, dtype=torch.uint8)
    buffer[:HEADER_BYTES] = header.view(torch.uint8)
    if text:
        buffer[HEADER_BYTES:HEADER_BYTES + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    for offset, payload in zip(offsets, payloads):
        buffer[offset:offset + payload.numel()] = payload
    return buffer


def unpack_header(buffer: torch.Tensor) -> tuple[int, int, list[TensorSpec], str, list[torch.Tensor]]:
    """(kind, request id, specs, text, inline tensors copied out of `buffer`) of a received header message."""
    kind, request_id, specs, text_len = decode_header(buffer[:HEADER_BYTES].view(torch.int64))
    text = buffer[HEADER_BYTES:HEADER_BYTES + text_len].numpy().tobytes().decode() if text_len else ""
    inline = [spec for spec in specs if spec.where == INLINE]
    offsets = inline_offsets(text_len, [spec.num_bytes for spec in inline])
    tensors = [buffer[offset:offset + spec.num_bytes].clone().view(spec.dtype).reshape(spec.shape)
               for offset, spec in zip(offsets, inline)]
    return kind, request_id, specs, text, tensors


def build_state(specs: Sequence[TensorSpec], tensors: Sequence[torch.Tensor], text: str) -> ActivationState:
    names = iter(json.loads(text)) if text else iter(())
    state: dict[str, Any] = {"extras": {}}
    for spec, tensor in zip(specs, tensors, strict=True):
        if spec.field == FIELD_EXTRA:
            state["extras"][next(names)] = tensor
        else:
            state[FIELD_NAMES[spec.field]] = tensor
    return ActivationState(**state)


# ---- the process groups of one member ----


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def device_key(device: torch.device) -> str:
    """What decides an edge's backend: 'cpu', or 'cuda:<uuid of the physical GPU>'."""
    if device.type != "cuda":
        return HOST_DEVICE
    return f"cuda:{torch.cuda.get_device_properties(device).uuid}"


def nccl_edge(a: str, b: str) -> bool:
    """NCCL carries an edge between two CUDA members on two different GPUs; gloo every other."""
    return a.startswith("cuda:") and b.startswith("cuda:") and a != b


@dataclass(frozen=True)
class TransportSpec:
    """What every member of one pipeline's transport needs: the store's address, this pipeline's key in it, the
    ranks of each stage's shards (stage-major) and the world size (actors + the owner, the last rank)."""

    host: str
    port: int
    key: str
    rows: tuple[tuple[int, ...], ...]
    timeout_s: float = TRANSFER_TIMEOUT_S

    @property
    def world_size(self) -> int:
        return sum(len(row) for row in self.rows) + 1

    @property
    def owner_rank(self) -> int:
        return self.world_size - 1

    def position(self, rank: int) -> tuple[int, int]:
        """(stage, shard) of an actor's rank."""
        for s, row in enumerate(self.rows):
            if rank in row:
                return s, row.index(rank)
        raise ValueError(f"rank {rank} is no actor of this pipeline (ranks {self.rows})")

    def upstream(self, rank: int) -> int:
        s, _ = self.position(rank)
        return self.rows[s - 1][0] if s > 0 else self.owner_rank

    def downstream(self, rank: int) -> list[int]:
        s, shard = self.position(rank)
        if shard != 0:
            return []
        return list(self.rows[s + 1]) if s + 1 < len(self.rows) else [self.owner_rank]


@dataclass
class Member:
    """One process's end of a pipeline's transport: its rank, its process groups, every member's device and label,
    and the receives it keeps posted for each peer it hears from."""

    spec: TransportSpec
    rank: int
    device: torch.device
    label: str
    store: Any = None
    control: Any = None
    nccl: Any = None
    devices: list[str] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    #: Whether a received message's payload buffers are reused once `release` hands them back (a stage's loop, once
    #: the message's output was sent on); the owner hands its answers out and never does.
    recycle_buffers: bool = False
    #: Per peer: the capacity of the payload receives it posts for this member (as this member announced it), and
    #: of those this member posts for it.
    _send_capacity: dict[int, int] = field(default_factory=dict)
    _receive_capacity: dict[int, int] = field(default_factory=dict)
    #: Per peer: the header receives posted for its next messages, in order, and free header buffers.
    _header_posted: dict[int, collections.deque] = field(default_factory=dict)
    _header_free: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    #: Per peer: payload receives posted, in the order its payload messages will match them; free payload buffers;
    #: the buffers of the message last taken (lent to its state until the next one is taken).
    _payload_posted: dict[int, collections.deque] = field(default_factory=dict)
    _payload_free: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    _payload_lent: dict[int, collections.deque] = field(default_factory=dict)
    #: Header messages are packed into these in turn: a send may still be in flight while the next is packed.
    _header_send_buffers: list[torch.Tensor] = field(default_factory=lambda: [
        torch.empty(HEADER_MESSAGE_BYTES, dtype=torch.uint8) for _ in range(2)])

    @classmethod
    def join(cls, spec: TransportSpec, rank: int, device: torch.device, label: str, store: Any = None) -> "Member":
        """Connect to the store (or use this process's own, the master) and build the process groups; returns once
        every member joined (RENDEZVOUS_TIMEOUT_S)."""
        import torch.distributed as dist

        if store is None:
            store = dist.TCPStore(spec.host, spec.port, is_master=False, timeout=_timedelta(RENDEZVOUS_TIMEOUT_S))
        prefixed = dist.PrefixStore(spec.key, store)
        member = cls(spec=spec, rank=rank, device=device, label=label, store=store)
        prefixed.set(f"device/{rank}", device_key(device))
        prefixed.set(f"label/{rank}", label)
        member.control = dist.ProcessGroupGloo(dist.PrefixStore("gloo", prefixed), rank, spec.world_size,
                                               _timedelta(spec.timeout_s))
        member.devices = [prefixed.get(f"device/{r}").decode() for r in range(spec.world_size)]
        member.labels = [prefixed.get(f"label/{r}").decode() for r in range(spec.world_size)]
        mine = member.devices[rank]
        if any(nccl_edge(mine, other) for other in member.devices):
            # The actors' ranks only (the owner, the last rank, holds no GPU of the pipeline); communicators are
            # created per pair on the first send between them.
            member.nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", prefixed), rank, spec.world_size - 1,
                                                _timedelta(spec.timeout_s))
        return member

    def peer_name(self, peer: int) -> str:
        """A peer as errors name it: its label and rank."""
        label = self.labels[peer] if peer < len(self.labels) else "rank"
        return f"{label} (rank {peer})"

    def edge_device(self, peer: int) -> torch.device:
        """Where a tensor to or from `peer` lives while it travels."""
        return self.device if nccl_edge(self.devices[self.rank], self.devices[peer]) else torch.device("cpu")

    # ---- sending ----

    def send(self, message: Message, peers: Sequence[int], wait: bool = True) -> "PendingSend":
        """Send one message to each of `peers`: its header message (header, text, small tensors) on gloo, then each
        larger tensor as its own message straight from its memory, on gloo into a receive the peer posted ahead, or
        on NCCL device to device. ValueError (nothing sent) for a state the header cannot describe. With `wait`, returns
        once every send completed; else at once, the sends in flight (`PendingSend.wait` before the next `send`: the
        header buffers alternate between two sends). A failed send raises TransportError naming the peer."""
        pending = PendingSend(self)
        if not peers:
            return pending
        self._header_send_buffers.reverse()
        out = self._header_send_buffers[0]
        for gloo in sorted({not nccl_edge(self.devices[self.rank], self.devices[peer]) for peer in peers}):
            header, text, inline, payloads = encode_header(message, inline=gloo)
            packed = pack_header(header, text, inline if gloo else [], out if gloo else out.clone())
            data = [as_bytes(t.cpu() if gloo else t.to(self.device)) for t in payloads]
            pending.keep += [packed, *data]
            for peer in peers:
                if gloo != (not nccl_edge(self.devices[self.rank], self.devices[peer])):
                    continue
                try:
                    if gloo:
                        self._resize_if_needed(peer, max((d.numel() for d in data), default=0), pending)
                        pending.works.append((self.control.send([packed], peer, TAG_HEADER), peer))
                        pending.works += [(self.control.send([d], peer, TAG_PAYLOAD), peer) for d in data if d.numel()]
                    else:
                        pending.works.append((self.control.send([packed], peer, TAG_HEADER), peer))
                        pending.works += [(self.nccl.send([d], peer, 0), peer) for d in data if d.numel()]
                except (RuntimeError, AttributeError) as error:  # a dead peer, a closed group (None after close)
                    raise TransportError(f"{self.label}: sending to {self.peer_name(peer)} failed: {error}") from error
        if wait:
            pending.wait()
        return pending

    def _resize_if_needed(self, peer: int, largest: int, pending: "PendingSend") -> None:
        """When a payload exceeds the receives `peer` posts for this member: announce larger ones (RESIZE), then
        fill the `PAYLOAD_PREPOSTED` receives it posted already, so the payloads after them match the larger ones."""
        capacity = self._send_capacity.get(peer, INITIAL_PAYLOAD_CAPACITY_BYTES)
        if largest <= capacity:
            return
        capacity = max(largest, 2 * capacity)
        self._send_capacity[peer] = capacity
        resize, text, _, _ = encode_header(Message(KIND_RESIZE, capacity))
        packed = pack_header(resize, text, [])
        filler = torch.zeros(1, dtype=torch.uint8)
        pending.keep += [packed, filler]
        pending.works.append((self.control.send([packed], peer, TAG_HEADER), peer))
        pending.works += [(self.control.send([filler], peer, TAG_PAYLOAD), peer) for _ in range(PAYLOAD_PREPOSTED)]

    # ---- receiving ----

    def _top_up_headers(self, peer: int) -> None:
        posted = self._header_posted.setdefault(peer, collections.deque())
        free = self._header_free.setdefault(peer, [])
        while len(posted) < HEADERS_PREPOSTED:
            buffer = free.pop() if free else torch.empty(HEADER_MESSAGE_BYTES, dtype=torch.uint8)
            posted.append((self.control.recv([buffer], peer, TAG_HEADER), buffer))

    def _post_payload(self, peer: int) -> None:
        capacity = self._receive_capacity.get(peer, INITIAL_PAYLOAD_CAPACITY_BYTES)
        free = self._payload_free.setdefault(peer, [])
        buffer = free.pop() if free and free[-1].numel() == capacity else None
        if buffer is None:
            free.clear()
            buffer = torch.empty(capacity, dtype=torch.uint8)
        self._payload_posted[peer].append((self.control.recv([buffer], peer, TAG_PAYLOAD), buffer))

    def _top_up_payloads(self, peer: int) -> None:
        posted = self._payload_posted.setdefault(peer, collections.deque())
        while len(posted) < PAYLOAD_PREPOSTED:
            self._post_payload(peer)

    def _take_payload(self, peer: int, timeout: datetime.timedelta) -> torch.Tensor:
        posted = self._payload_posted.setdefault(peer, collections.deque())
        if not posted:
            self._post_payload(peer)
        work, buffer = posted.popleft()
        work.wait(timeout)
        return buffer

    def receive(self, peer: int) -> Message:
        """The next message from `peer`: waits without limit for its header (posted as soon as the previous one
        arrived, as are the receives of its payloads, so a sender never waits for this side to ask), then at most
        the transfer timeout for each payload. TransportError naming the peer when the link breaks."""
        try:
            return self._receive(peer)
        except (RuntimeError, AttributeError) as error:  # a dead peer, a closed group (None after close)
            if isinstance(error, TransportError):
                raise
            raise TransportError(f"{self.label}: the link from {self.peer_name(peer)} broke: {error}") from error

    def _receive(self, peer: int) -> Message:
        timeout = _timedelta(self.spec.timeout_s)
        self._top_up_payloads(peer)
        while True:
            self._top_up_headers(peer)
            work, buffer = self._header_posted[peer].popleft()
            work.wait(IDLE_WAIT)
            kind, request_id, specs, text, inline = unpack_header(buffer)  # inline tensors copied out
            self._header_free[peer].append(buffer)
            if kind in (KIND_STOP, KIND_BROKEN):
                break
            self._top_up_headers(peer)
            if kind != KIND_RESIZE:
                break
            for _ in range(PAYLOAD_PREPOSTED):  # the fillers of the receives posted at the old capacity
                self._take_payload(peer, timeout)
            self._receive_capacity[peer] = request_id
            self._payload_free.pop(peer, None)
            self._top_up_payloads(peer)
        if kind != KIND_STATE:
            if self.recycle_buffers and kind == KIND_FAILURE:  # one `release` per message a stage passes on
                self._payload_lent.setdefault(peer, collections.deque()).append([])
            return Message(kind, request_id, text=text)
        gloo = not nccl_edge(self.devices[self.rank], self.devices[peer])
        inline_tensors = iter(inline)
        tensors, taken = [], []
        for spec in specs:
            if spec.where == INLINE:
                tensors.append(next(inline_tensors))
            elif not spec.num_bytes:
                tensors.append(torch.empty(spec.shape, dtype=spec.dtype, device=self.edge_device(peer)))
            elif gloo:
                buffer = self._take_payload(peer, timeout)
                taken.append(buffer)
                tensors.append(buffer[:spec.num_bytes].view(spec.dtype).reshape(spec.shape))
            else:
                buffer = torch.empty(spec.num_bytes, dtype=torch.uint8, device=self.device)
                self.nccl.recv([buffer], peer, 0).wait(timeout)
                tensors.append(buffer.view(spec.dtype).reshape(spec.shape))
        if self.recycle_buffers:
            self._payload_lent.setdefault(peer, collections.deque()).append(taken)
        self._top_up_payloads(peer)
        return Message(kind, request_id, build_state(specs, tensors, text), text)

    def release(self, peer: int) -> None:
        """The oldest message taken from `peer` is done with (its output was sent on): its payload buffers take
        payloads again (`recycle_buffers` only)."""
        lent = self._payload_lent.get(peer)
        if lent:
            self._payload_free.setdefault(peer, []).extend(lent.popleft())

    def close(self) -> None:
        """Drop the process groups (aborting what is in flight) and the store connection."""
        for group in (self.nccl, self.control):
            if group is not None:
                try:
                    group.abort()
                except Exception as error:  # noqa: BLE001 - best effort on a group that may be broken
                    logger.debug("%s: aborting a process group failed: %s", self.label, error)
        self.nccl = self.control = None
        self.store = None


class PendingSend:
    """The sends of one message in flight, and the tensors whose memory they read (kept alive until they complete)."""

    def __init__(self, member: Member):
        self.member = member
        self.works: list[tuple[Any, int]] = []
        self.keep: list[torch.Tensor] = []

    def wait(self) -> None:
        """Wait until every send completed (at most the transfer timeout each); TransportError naming the peer whose
        send failed."""
        timeout = _timedelta(self.member.spec.timeout_s)
        works, self.works = self.works, []
        for work, peer in works:
            try:
                work.wait(timeout)
            except RuntimeError as error:  # a dead peer, an aborted group
                raise TransportError(f"{self.member.label}: sending to {self.member.peer_name(peer)} failed: "
                                     f"{error}") from error
        self.keep = []


# ---- the stage side ----


def serve_stage(member: Member, forward: Callable[[ActivationState], Any]) -> None:
    """A stage's loop: receive each request from upstream, run it, send the output on (shard 0). The loop does not
    wait for the output's sends to complete (gloo's send call itself returns once the socket took the bytes, which
    the next stage's receive posted ahead drains): it waits for them before it sends the next output, and only then
    does the request's input buffer take payloads again. A stage's failure on a request travels on as a FAILURE
    message; a broken upstream ends the loop after passing BROKEN on."""
    spec, rank, label = member.spec, member.rank, member.label
    upstream, downstream = spec.upstream(rank), spec.downstream(rank)
    member.recycle_buffers = True
    in_flight: PendingSend | None = None

    def settle() -> None:
        nonlocal in_flight
        if in_flight is not None:
            in_flight.wait()
            member.release(upstream)
            in_flight = None

    try:
        while True:
            try:
                message = member.receive(upstream)
            except Exception as error:  # noqa: BLE001 - a dead or broken peer upstream
                reason = f"{label}: its link from upstream broke: {error}"
                logger.warning(reason)
                settle()
                member.send(Message(KIND_BROKEN, text=reason), downstream)
                return
            if message.kind == KIND_STATE:
                try:
                    output = forward(message.state)
                    message = Message(KIND_STATE, message.request_id, output)
                except Exception as error:  # noqa: BLE001 - the request fails, the stage goes on
                    logger.exception("%s failed on request %d", label, message.request_id)
                    message = Message(KIND_FAILURE, message.request_id, text=f"{label} failed: {error!r}")
            settle()
            try:
                in_flight = member.send(message, downstream, wait=False)
            except ValueError as error:  # a state the header cannot describe: that request fails
                in_flight = member.send(Message(KIND_FAILURE, message.request_id, text=f"{label}: {error}"),
                                        downstream, wait=False)
            if message.kind in (KIND_STOP, KIND_BROKEN):
                settle()
                return
    except Exception as error:  # noqa: BLE001 - a dead peer downstream: the owner learns it from its own links
        logger.warning("%s: stage transport closed: %s", label, error)
    finally:
        logger.info("%s: stage transport loop ends", label)


def node_address() -> str:
    """This node's address as Ray knows it (where peers on other nodes reach this process)."""
    import ray

    return ray.util.get_node_ip_address()


class StageTransportEndpoint:
    """Mixed into an actor body with a `forward(state)` method and a `device`: lets `PipelineTransport` wire it in.
    An actor may serve in several pipelines at once (the profiler's probes do), each under its own key."""

    device = torch.device("cpu")

    def transport_label(self) -> str:
        return type(self).__name__

    def _transport_state(self) -> tuple[dict[str, Any], dict[str, Member]]:
        if "_transport_members" not in self.__dict__:
            self._transport_stores: dict[str, Any] = {}
            self._transport_members: dict[str, Member] = {}
        return self._transport_stores, self._transport_members

    def open_rendezvous(self, key: str) -> Address:
        """Start the store of pipeline `key` on a free port of this node (the first stage's shard 0); returns its
        address."""
        import torch.distributed as dist

        host = node_address()
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                              timeout=_timedelta(RENDEZVOUS_TIMEOUT_S))
        self._transport_state()[0][key] = store
        return host, store.port

    def join_transport(self, spec: TransportSpec, rank: int) -> str:
        """Join the pipeline's process groups (blocks until every member joined); returns this member's device."""
        stores, members = self._transport_state()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
        members[spec.key] = Member.join(spec, rank, self.device, self.transport_label(), stores.pop(spec.key, None))
        return device_key(self.device)

    def start_transport(self, key: str) -> None:
        """Start pipeline `key`'s stage loop (a thread: the actor keeps answering its control calls)."""
        member = self._transport_state()[1][key]
        threading.Thread(target=self._run_transport, args=(member,), name=f"stage-transport {member.label}",
                         daemon=True).start()

    def _run_transport(self, member: Member) -> None:
        try:
            serve_stage(member, self.forward)
        finally:
            self._transport_state()[1].pop(member.spec.key, None)
            member.close()

    def rendezvous_address(self) -> Address:
        """This actor's node address and a free port on it, where a stage's shards meet to form their process group
        for tensor-parallel collectives (`torch.distributed`'s TCP rendezvous)."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return node_address(), port


# ---- the owner side ----


class PipelineTransport:
    """The owner's end of a pipeline of `StageTransportEndpoint` actors: rows[s] are the shards of stage s.

    `submit` returns a `concurrent.futures.Future` of the last stage's output; requests pipeline through the
    stages. `diagnose` (optional) is called once when the pipeline breaks and returns what the pending requests fail
    with (e.g. which actor died; '' when it finds nothing), the transport's own reason beside it."""

    def __init__(self, rows: Sequence[Sequence], diagnose: Callable[[], str] | None = None,
                 rendezvous_timeout_s: float = RENDEZVOUS_TIMEOUT_S, timeout_s: float = TRANSFER_TIMEOUT_S):
        import ray

        if not rows or not all(rows):
            raise ValueError("PipelineTransport needs at least one stage with at least one actor")
        self._diagnose = diagnose
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._broken: str | None = None
        self._breaking = False
        self._closing = False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        ray.get([actor.transport_label.remote() for row in rows for actor in row], timeout=ACTOR_START_TIMEOUT_S)
        ranks = itertools.count()
        key = secrets.token_hex(8)
        host, port = ray.get(rows[0][0].open_rendezvous.remote(key), timeout=rendezvous_timeout_s)
        self.spec = TransportSpec(host=host, port=port, key=key,
                                  rows=tuple(tuple(next(ranks) for _ in row) for row in rows), timeout_s=timeout_s)
        joins = [actor.join_transport.remote(self.spec, rank)
                 for row, row_ranks in zip(rows, self.spec.rows) for actor, rank in zip(row, row_ranks)]
        self._member = Member.join(self.spec, self.spec.owner_rank, torch.device("cpu"), "the group's owner")
        #: Every actor's device key ('cpu' or 'cuda:<uuid>'), stage-major.
        self.devices = ray.get(joins, timeout=rendezvous_timeout_s)
        ray.get([actor.start_transport.remote(key) for row in rows for actor in row], timeout=rendezvous_timeout_s)
        self._first = list(self.spec.rows[0])
        self._last = self.spec.rows[-1][0]
        self._receiver = threading.Thread(target=self._receive_loop, name="stage-transport receiver", daemon=True)
        threading.Thread(target=self._send_loop, name="stage-transport sender", daemon=True).start()
        self._receiver.start()

    def submit(self, state: ActivationState) -> Future:
        """Queue one request for the first stage; the future holds the last stage's output or a `TransportError`."""
        future: Future = Future()
        with self._lock:
            if self._broken is not None:
                raise TransportError(self._broken)
            request_id = next(self._ids)
            self._pending[request_id] = future
        self._outbox.put(Message(KIND_STATE, request_id, state))
        return future

    def close(self, stop_stages: bool = True, timeout_s: float = 10.0) -> None:
        """Stop the stages' loops (`stop_stages`: a STOP message follows the requests queued, and the actors stay
        up, ready to join another pipeline; else the caller kills them), fail what is still pending and drop the
        owner's process groups."""
        with self._lock:
            healthy = self._broken is None and not self._breaking
            self._closing = True
        if healthy and stop_stages:
            self._outbox.put(Message(KIND_STOP))
            self._receiver.join(timeout_s)
        self._break("the pipeline's transport was closed", diagnose=False)

    @property
    def broken(self) -> str | None:
        """Why the pipeline broke, None while it works."""
        return self._broken

    def _send_loop(self) -> None:
        """Send each queued message to the first stage; a message's sends stay in flight until the next is sent."""
        in_flight: PendingSend | None = None
        while True:
            message = self._outbox.get()
            if message is None:
                return
            try:
                if in_flight is not None:
                    in_flight.wait()
                in_flight = self._member.send(message, self._first, wait=message.kind == KIND_STOP)
            except ValueError as error:  # a state the header cannot describe: that request fails
                in_flight = None
                self._resolve(message.request_id, error=TransportError(str(error)))
            except Exception as error:  # noqa: BLE001 - a dead peer, a closed group
                self._break(f"sending to the first stage failed: {error}")
                return
            if message.kind == KIND_STOP:
                return

    def _receive_loop(self) -> None:
        while True:
            try:
                message = self._member.receive(self._last)
            except Exception as error:  # noqa: BLE001 - a dead peer, a closed group
                self._break(f"the last stage's link broke: {error}")
                return
            if message.kind == KIND_STOP:
                return
            if message.kind == KIND_BROKEN:
                self._break(message.text)
                return
            if message.kind == KIND_FAILURE:
                self._resolve(message.request_id, error=TransportError(message.text))
            else:
                self._resolve(message.request_id, result=message.state)

    def _resolve(self, request_id: int, result: Any = None, error: Exception | None = None) -> None:
        with self._lock:
            future = self._pending.pop(request_id, None)
        if future is None:
            return
        try:
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
        except InvalidStateError:
            pass  # the caller gave up on it (timeout, cancellation)

    def _break(self, reason: str, diagnose: bool = True) -> None:
        """Once: find out why (requests submitted meanwhile still queue), then fail every pending request with it
        and drop the owner's process groups."""
        with self._lock:
            if self._breaking:
                return
            self._breaking = True
            diagnose = diagnose and not self._closing
        if diagnose and self._diagnose is not None:
            try:
                found = self._diagnose()
                reason = f"{found} ({reason})" if found else reason
            except Exception as error:  # noqa: BLE001 - the diagnosis is best effort
                logger.warning("stage transport: diagnosing a broken pipeline failed: %s", error)
        with self._lock:
            self._broken = reason
            pending, self._pending = self._pending, {}
        if diagnose:
            logger.warning("stage transport broken: %s", reason)
        self._outbox.put(None)
        self._member.close()
        for future in pending.values():
            try:
                future.set_exception(TransportError(reason))
            except InvalidStateError:
                pass
