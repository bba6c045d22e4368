"""The hand-over between an HTTP front process and the engine: a ring of slots in shared memory, and the
frames on a socket that pass each slot back and forth.

Each front has a region of ``SLOTS`` slots of ``SLOT_BYTES`` bytes, an anonymous file (``memfd``) that
both processes map: nothing to unlink, and freed once both have closed it, a SIGKILL included. A front
takes a free slot, writes its request into it (a small JSON header, then each tensor's bytes as the binary
tensor extension lays them out: nothing is pickled) and sends a frame naming the slot; the engine reads
the request, runs it, writes the answer into the same slot and sends a frame back; the front reads the
answer and frees the slot. The frames pass each slot's ownership, so neither side locks anything. A
message larger than a slot, or one sent while every slot is taken, travels inside its frame instead.

A frame: its kind (1 byte), the front's tag of the request (4), the slot the request holds (4; -1 for
none), the length of what follows inline (4), then that many bytes. A message: the length of its JSON
header (4 bytes), the header, then each tensor's bytes at the offset the header gives (8-byte aligned).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import struct
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import orjson

from ..codec import BYTES, DATATYPES, datatype_of, decode_raw, raw_contents

SLOTS = 128
SLOT_BYTES = 64 * 1024  # a request or answer up to this size travels in shared memory; larger, inline
NO_SLOT = -1
HEAD = struct.Struct("<BIiI")  # kind, tag, slot, inline length
_LENGTH = struct.Struct("<I")
_ALIGN = 8
_NUMBERS = {name: (dtype.newbyteorder("<"), dtype) for name, dtype in DATATYPES.items()}  # how a slot holds them

# the frames' kinds, front -> engine
INFER, CANCEL, COUNT, READY, RELAY, RELAY_BODY, RELAY_LAST, RELAY_GONE, LISTENING = range(9)
# engine -> front
CONFIG, GO, ANSWER, FAILED, DONE, RELAY_HEAD, RELAY_CHUNK, RELAY_END, RELAY_ABORT = range(9, 18)

ENGINE_GONE = "the engine process of this server exited before answering; retry once it is back"

Tensors = list[tuple[str, np.ndarray]]
Frame = tuple[int, int, int, bytes]  # kind, tag, slot, inline bytes
Handler = Callable[[int, int, int, bytes], None]


class Ring:
    """One front's slots: a region of shared memory both processes map (``fd`` is the memfd's descriptor,
    passed to the front process, which maps it too)."""

    def __init__(self, fd: int, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES) -> None:
        self.fd = fd
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.mapping = mmap.mmap(fd, slots * slot_bytes)  # it holds a descriptor of its own
        self.view = memoryview(self.mapping)

    @classmethod
    def create(cls) -> Ring:
        fd = os.memfd_create("jitserve-http-ring", os.MFD_CLOEXEC)  # subprocess's pass_fds hands it over
        os.ftruncate(fd, SLOTS * SLOT_BYTES)  # pages are taken as slots are first written
        return cls(fd)

    def slot(self, index: int) -> memoryview:
        return self.view[index * self.slot_bytes:(index + 1) * self.slot_bytes]

    def close_file(self) -> None:
        """Close the descriptor once the front process has its own (the mapping stays)."""
        os.close(self.fd)

    def close(self) -> None:
        """Unmap the slots and close the mapping's descriptor, once the other process is gone: the memory is
        freed now, not whenever the garbage collector frees what refers to the ring."""
        self.view.release()
        self.mapping.close()


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


class Message:
    """A header (a JSON object) and named tensors, laid out to be written into a slot or sent inline."""

    __slots__ = ("head", "blobs", "start", "size")

    def __init__(self, header: dict[str, Any], tensors: Iterable[tuple[str, np.ndarray]] = ()) -> None:
        described: list[tuple[str, str, tuple[int, ...], int, int]] = []
        self.blobs: list[tuple[int, Any]] = []
        at = 0
        for name, array in tensors:
            datatype = datatype_of(array.dtype)
            blob: Any = raw_contents(array) if datatype == BYTES else \
                np.ascontiguousarray(array, array.dtype.newbyteorder("<")).reshape(-1).view(np.uint8)
            described.append((name, datatype, array.shape, at, len(blob)))
            self.blobs.append((at, blob))
            at = _aligned(at + len(blob))
        header["t"] = described
        self.head = orjson.dumps(header)
        self.start = _aligned(_LENGTH.size + len(self.head))
        self.size = self.start + at

    def write(self, into: memoryview) -> None:
        _LENGTH.pack_into(into, 0, len(self.head))
        into[_LENGTH.size:_LENGTH.size + len(self.head)] = self.head
        for at, blob in self.blobs:
            into[self.start + at:self.start + at + len(blob)] = blob

    def inline(self) -> bytearray:
        data = bytearray(self.size)
        self.write(memoryview(data))
        return data


def read_message(view: memoryview | bytes) -> tuple[dict[str, Any], Tensors]:
    """A message's header and tensors, copied out of ``view`` (its slot is reused once answered)."""
    (length,) = _LENGTH.unpack_from(view, 0)
    header = orjson.loads(view[_LENGTH.size:_LENGTH.size + length])
    start = _aligned(_LENGTH.size + length)
    tensors = []
    for name, datatype, shape, at, size in header.pop("t"):
        if datatype == BYTES:
            tensors.append((name, decode_raw(name, datatype, shape, view[start + at:start + at + size])))
            continue
        wire, native = _NUMBERS[datatype]  # written by the other side: no checks needed, one copy made
        tensors.append((name, np.frombuffer(view, wire, size // wire.itemsize, start + at).astype(native)
                        .reshape(shape)))
    return header, tensors


class Frames:
    """Frames out of the bytes of a stream, as they arrive."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        buffer = self._buffer
        buffer += data
        frames, at, size = [], 0, len(buffer)
        with memoryview(buffer) as view:
            while size - at >= HEAD.size:
                kind, tag, slot, length = HEAD.unpack_from(view, at)
                end = at + HEAD.size + length
                if end > size:
                    break
                frames.append((kind, tag, slot, bytes(view[at + HEAD.size:end])))
                at = end
        del buffer[:at]
        return frames


class Outbox:
    """Frames to the peer, written together once per turn of the event loop: the answers of a whole batch
    leave in one system call."""

    __slots__ = ("transport", "_loop", "_parts")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self._loop = loop
        self._parts: list[bytes | bytearray] = []

    def send(self, kind: int, tag: int = 0, slot: int = NO_SLOT, payload: bytes | bytearray = b"") -> None:
        parts = self._parts
        if not parts:
            self._loop.call_soon(self._flush)
        parts.append(HEAD.pack(kind, tag, slot, len(payload)))
        if payload:
            parts.append(payload)

    def _flush(self) -> None:
        parts, self._parts = self._parts, []
        if not self.transport.is_closing():
            self.transport.writelines(parts)


class Peer(asyncio.Protocol):
    """Either end of the socket between a front and the engine: frames out through an :class:`Outbox`, frames
    in handed to ``handlers`` by kind."""

    handlers: dict[int, Handler]

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.frames = Frames()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.outbox = Outbox(transport, self.loop)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        for kind, tag, slot, payload in self.frames.feed(data):
            self.handlers[kind](kind, tag, slot, payload)
