"""Triton's system shared memory extension: POSIX shared memory regions that a client on this machine
registers by name, then names in inference requests, for inputs to be read from and outputs written into,
instead of sending their bytes.

A region is ``byte_size`` bytes from ``offset`` of a shared memory object ``key`` (what ``shm_open`` opens;
tritonclient's ``create_shared_memory_region`` makes one), mapped into this process once, at registration.
A tensor's parameters ``shared_memory_region``, ``shared_memory_byte_size`` and ``shared_memory_offset``
(default 0) place it in a region: an input is a read-only numpy view of those bytes (no copy; the batch that
runs it copies it once), an output is written there and answered without data (its name, datatype and
shape only), as Triton does. Every place is checked against its region, and the region against the size
its object has now, so nothing is read or written outside a region, nor past the end of an object that
its client shrank after registering it (which would fault); a client that shrinks it while a request reads
it is the one race left, as in Triton.

Regions belong to the server process: unregistering one takes it from the table at once, and a request
that holds a view of it keeps the mapping alive until it ends (the mapping is unmapped then); all are
unregistered at shutdown. Registering is off unless the server is started with ``--allow-client-shm``
(Triton's flag and default): a client that may register an object by name may read and write any shared
memory object this process may open.

CUDA shared memory is not supported: its status lists no region, unregistering succeeds, and registering a
region is refused, as by a Triton built without GPUs.
"""

from __future__ import annotations

import _posixshmem  # type: ignore[import-not-found]  # shm_open, as multiprocessing.shared_memory calls it
import errno
import math
import mmap
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ProtocolError
from .codec import BYTES, check_shape, decode_raw, dtype_of, raw_contents, shown

MAX_REGIONS = 256  # regions registered at once: each holds a mapping and an open file
DISABLED = ("client shared memory is disabled: start the server with --allow-client-shm to register and use "
            "shared memory regions")

REGION, OFFSET, BYTE_SIZE = "shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"


def _count(value: Any, what: str, where: str, least: int = 0) -> int:
    """A byte count or offset a client sent: an integer of at least ``least``, else a clear error."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ProtocolError(f"{where}: '{what}' must be an integer >= {least}, got {value!r:.40}")
    return int(value)


@dataclass(frozen=True)
class Placement:
    """Where a request puts a tensor: ``byte_size`` bytes from ``offset`` of the region named ``region``."""

    region: str
    offset: int
    byte_size: int


def placement(parameters: Mapping[str, Any], where: str) -> Placement | None:
    """The shared memory place a tensor's parameters give, or None when they name no region; an offset or
    size without a region, or a region without a size, is an error (as in Triton)."""
    region = parameters.get(REGION)
    if region is None:
        stray = [name for name in (OFFSET, BYTE_SIZE) if name in parameters]
        if stray:
            raise ProtocolError(f"{where}: '{stray[0]}' is given without '{REGION}'")
        return None
    if not isinstance(region, str) or not region:
        raise ProtocolError(f"{where}: '{REGION}' must be a region's name (a non-empty string), got {region!r:.40}")
    if BYTE_SIZE not in parameters:
        raise ProtocolError(f"{where}: '{REGION}' needs '{BYTE_SIZE}', the tensor's size in bytes")
    return Placement(region, _count(parameters.get(OFFSET, 0), OFFSET, where),
                     _count(parameters[BYTE_SIZE], BYTE_SIZE, where))


def output_placement(parameters: Mapping[str, Any], where: str) -> Placement | None:
    """:func:`placement` for a requested output, which then cannot be classified nor binary data too."""
    place = placement(parameters, where)
    also = "classified" if parameters.get("classification") else \
        "binary data" if parameters.get("binary_data") is True else None
    if place is not None and also is not None:
        raise ProtocolError(f"{where}: an output written into shared memory cannot also be {also}; send one")
    return place


class Region:
    """One registered region and its mapping (which covers the object from its start to the region's end)."""

    __slots__ = ("name", "key", "offset", "byte_size", "mapping")

    def __init__(self, name: str, key: str, offset: int, byte_size: int, mapping: mmap.mmap) -> None:
        self.name, self.key, self.offset, self.byte_size, self.mapping = name, key, offset, byte_size, mapping

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def view(self, place: Placement, where: str) -> memoryview:
        """The bytes of ``place``, checked against the region and the object's size now."""
        end = place.offset + place.byte_size
        if end > self.byte_size:
            raise ProtocolError(f"{where}: {OFFSET} {place.offset} + {BYTE_SIZE} {place.byte_size} = {end} runs past "
                                f"the end of shared memory region '{shown(self.name)}' ({self.byte_size} bytes)")
        self.check_object(where)
        start = self.offset + place.offset
        return memoryview(self.mapping)[start:start + place.byte_size]

    def check_object(self, where: str) -> None:
        """Refuse to touch a region whose object its client shrank since (reading past an object's end
        faults)."""
        size = self.mapping.size()  # fstat of the object: its size now
        if size < self.offset + self.byte_size:
            raise ProtocolError(f"{where}: shared memory object '{shown(self.key)}' of region "
                                f"'{shown(self.name)}' shrank to {size} bytes since the region was registered "
                                f"({self.offset + self.byte_size} needed); register the region again")

    def close(self) -> None:
        """Unmap now, unless a request still holds a view: then when the last one goes."""
        try:
            self.mapping.close()
        except BufferError:
            pass


class OutputSlot:
    """Where a request wants an output written: a view of a region, held from the request's start to its
    answer (so that the region's mapping outlives an unregister meanwhile)."""

    __slots__ = ("name", "region", "view")

    def __init__(self, name: str, region: Region, view: memoryview) -> None:
        self.name, self.region, self.view = name, region, view

    def write(self, array: np.ndarray) -> None:
        """Write the output's bytes (as the binary extension lays them out) at the start of the slot."""
        where = f"output '{self.name}'"
        data = raw_contents(array) if array.dtype.kind in "OSU" else None
        size = array.nbytes if data is None else len(data)
        if size > len(self.view):
            raise ProtocolError(f"{where}: the shared memory given for it ({BYTE_SIZE} {len(self.view)}) should be "
                                f"at least {size} bytes to hold the results")
        self.region.check_object(where)
        if data is not None:
            self.view[:size] = data
        else:
            target = np.frombuffer(self.view, array.dtype.newbyteorder("<"), count=array.size)
            np.copyto(target.reshape(array.shape), array)


class SystemSharedMemory:
    """The registered regions by name, shared by the HTTP and gRPC fronts (a lock orders their changes)."""

    def __init__(self, allowed: bool = False) -> None:
        self.allowed = allowed
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()

    def register(self, name: str, key: Any, offset: Any, byte_size: Any) -> None:
        """Map ``byte_size`` bytes from ``offset`` of the shared memory object ``key`` as region ``name``."""
        where = f"failed to register shared memory region '{shown(name)}'"
        if not self.allowed:
            raise ProtocolError(DISABLED)
        if not name:
            raise ProtocolError("a shared memory region needs a name to be registered under")
        if not isinstance(key, str) or not key or "\0" in key:
            raise ProtocolError(f"{where}: 'key' must be a shared memory object's name, such as '/my_region', "
                                f"got {key!r:.40}")
        offset, byte_size = _count(offset, "offset", where), _count(byte_size, "byte_size", where, least=1)
        with self._lock:
            held = self._regions.get(name)
            if held is not None:
                raise ProtocolError(f"{where}: a region of that name is already registered (key "
                                    f"'{shown(held.key)}', offset {held.offset}, {held.byte_size} bytes); "
                                    f"unregister it first")
            if len(self._regions) >= MAX_REGIONS:
                raise ProtocolError(f"{where}: {MAX_REGIONS} regions are registered, the most this server holds; "
                                    f"unregister one first")
            self._regions[name] = Region(name, key, offset, byte_size, _mapped(key, offset, byte_size, where))

    def unregister(self, name: str) -> None:
        """Unregister region ``name`` (every region when ``name`` is empty); a name not registered is no
        error, as in Triton."""
        if not self.allowed:
            raise ProtocolError(DISABLED)
        self._drop(name)

    def status(self, name: str = "") -> list[dict[str, Any]]:
        """Every region's name, key, offset and size, or region ``name``'s."""
        if not name:
            return [region.status() for region in list(self._regions.values())]
        return [self._region(name, "shared memory status").status()]

    def read(self, tensor: str, datatype: str, shape: Any, place: Placement) -> np.ndarray:
        """Input ``tensor`` from its place: a read-only view of the region for numbers (BYTES elements are
        parsed into objects); its size must be what ``datatype`` and ``shape`` take."""
        where = f"input '{tensor}'"
        dtype, dims = dtype_of(tensor, datatype), check_shape(tensor, shape)
        if datatype != BYTES and place.byte_size != math.prod(dims) * dtype.itemsize:
            raise ProtocolError(f"{where}: {BYTE_SIZE} {place.byte_size} does not match {datatype} {list(dims)}, "
                                f"which takes {math.prod(dims) * dtype.itemsize} bytes")
        with self._lock:
            view = self._region(place.region, where).view(place, where)
        return decode_raw(tensor, datatype, dims, view.toreadonly())

    def slot(self, tensor: str, place: Placement) -> OutputSlot:
        """Where output ``tensor`` goes, checked now (the output's own size is checked once it exists)."""
        where = f"output '{tensor}'"
        with self._lock:
            region = self._region(place.region, where)
            return OutputSlot(tensor, region, region.view(place, where))

    def close(self) -> None:
        """At shutdown: every region unregistered."""
        self._drop("")

    def _drop(self, name: str) -> None:
        """Unregister region ``name``, or every region when ``name`` is empty."""
        with self._lock:
            if name:
                gone = [self._regions.pop(name)] if name in self._regions else []
            else:
                gone, self._regions = list(self._regions.values()), {}
        for region in gone:
            region.close()

    def _region(self, name: str, where: str) -> Region:
        if not self.allowed:
            raise ProtocolError(f"{where}: {DISABLED}")
        region = self._regions.get(name)
        if region is None:
            raise ProtocolError(f"{where}: no system shared memory region '{shown(name)}' is registered")
        return region


# errno of shm_open or mmap -> what it means for the client
_OPEN_ERRORS = {
    errno.ENOENT: "no shared memory object of that key exists (create it first)",
    errno.EACCES: "this server may not open it (permission denied)",
    errno.EINVAL: "it is not a valid shared memory key (a name such as '/my_region', no '/' after the first "
                  "character, at most 255 characters)",
    errno.ENAMETOOLONG: "the key is too long (at most 255 characters)",
}


def _mapped(key: str, offset: int, byte_size: int, where: str) -> mmap.mmap:
    """The object ``key`` mapped from its start to the region's end, once checked to hold the region."""
    try:
        descriptor = _posixshmem.shm_open(key, os.O_RDWR, mode=0o600)
    except OSError as error:
        why = _OPEN_ERRORS.get(error.errno or 0, error.strerror)
        raise ProtocolError(f"{where}: cannot open shared memory object '{shown(key)}': {why}") from None
    try:
        size = os.fstat(descriptor).st_size
        if offset + byte_size > size:
            raise ProtocolError(f"{where}: offset {offset} + byte_size {byte_size} = {offset + byte_size} runs past "
                                f"the end of shared memory object '{shown(key)}' ({size} bytes)")
        try:
            return mmap.mmap(descriptor, offset + byte_size)
        except (OSError, ValueError) as error:
            raise ProtocolError(f"{where}: cannot map shared memory object '{shown(key)}': {error}") from None
    finally:
        os.close(descriptor)


def cuda_status(name: str) -> list[dict[str, Any]]:
    """CUDA shared memory regions: none (jitserve does not support them)."""
    if name:
        raise ProtocolError(f"no CUDA shared memory region '{shown(name)}' is registered: jitserve does not support "
                            f"CUDA shared memory; use system shared memory")
    return []


def cuda_register(name: str) -> None:
    raise ProtocolError(f"failed to register CUDA shared memory region '{shown(name)}': jitserve does not support "
                        f"CUDA shared memory; use system shared memory (tritonclient.utils.shared_memory)")


# Triton's shared memory calls, by their gRPC names -> the fields of each one's answer (None: an empty one), from
# the call's request (its fields as attributes)
CALLS: dict[str, Callable[[SystemSharedMemory, Any], dict[str, Any] | None]] = {
    "SystemSharedMemoryStatus": lambda memory, request: {
        "regions": {region["name"]: region for region in memory.status(request.name)}},
    "SystemSharedMemoryRegister": lambda memory, request: memory.register(request.name, request.key, request.offset,
                                                                          request.byte_size),
    "SystemSharedMemoryUnregister": lambda memory, request: memory.unregister(request.name),
    "CudaSharedMemoryStatus": lambda memory, request: {"regions": {r["name"]: r for r in cuda_status(request.name)}},
    "CudaSharedMemoryRegister": lambda memory, request: cuda_register(request.name),
    "CudaSharedMemoryUnregister": lambda memory, request: None,  # none is registered: done, as Triton answers
}
