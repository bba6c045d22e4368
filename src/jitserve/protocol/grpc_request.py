"""A gRPC inference request as tensors: the protocol's messages (from ``inference.proto``'s compiled
descriptor set, ``inference.binpb``, in a descriptor pool of their own: no generated code, and no clash with
a client such as tritonclient that registers the same names in the same process), a ``ModelInferRequest``
parsed (a large one's raw contents read where they lie) and decoded input by input, the outputs it asks
for, and the ``ModelInferResponse`` that answers it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from ..errors import ProtocolError
from .codec import datatype_of, decode_raw, decode_values, dtype_of, raw_contents, shown
from .parameters import class_count, refuse_unsupported
from .shared_memory import OutputSlot, SystemSharedMemory, output_placement, placement

SERVICE = "inference.GRPCInferenceService"
_DESCRIPTORS = Path(__file__).with_name("inference.binpb")


def _descriptor_pool() -> descriptor_pool.DescriptorPool:
    """The protocol's messages, and those of the health and reflection services (for reflection to describe
    every service this server has), in a pool of their own."""
    pool = descriptor_pool.DescriptorPool()
    for file in descriptor_pb2.FileDescriptorSet.FromString(_DESCRIPTORS.read_bytes()).file:
        pool.Add(file)
    for module in (health_pb2, reflection_pb2):
        pool.AddSerializedFile(module.DESCRIPTOR.serialized_pb)
    return pool


def _message_classes(pool: descriptor_pool.DescriptorPool) -> dict[str, Any]:
    service = pool.FindServiceByName(SERVICE)
    names = {m.input_type.full_name for m in service.methods} | {m.output_type.full_name for m in service.methods}
    return {name.split(".", 1)[1]: message_factory.GetMessageClass(pool.FindMessageTypeByName(name))
            for name in names}


POOL = _descriptor_pool()
MESSAGES = _message_classes(POOL)

# datatype -> the typed contents field that carries it
CONTENTS_FIELDS: dict[str, str] = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}


def infer_response(model: str, version: str, request_id: str, outputs: list[tuple[str, np.ndarray]],
                    slots: dict[str, OutputSlot]) -> Any:
    """The answer: each output's raw contents, or, for one written into its shared memory slot, none (an
    empty entry, as Triton's, so that the contents stay in the outputs' order)."""
    response = MESSAGES["ModelInferResponse"](model_name=model, model_version=version, id=request_id)
    for name, array in outputs:
        response.outputs.add(name=name, datatype=datatype_of(array.dtype), shape=list(array.shape))
        slot = slots.get(name)
        if slot is not None:
            slot.write(array)
        response.raw_output_contents.append(raw_contents(array) if slot is None else b"")
    return response


def flag(request: Any, name: str) -> bool:
    return name in request.parameters and request.parameters[name].WhichOneof("parameter_choice") == "bool_param" \
        and request.parameters[name].bool_param


def parameter_values(parameters: Any) -> dict[str, Any]:
    """A message's ``parameters`` map as plain values (tritonclient sends integers as ``int64_param``)."""
    return {name: getattr(parameter, parameter.WhichOneof("parameter_choice") or "bool_param")
            for name, parameter in parameters.items()}


def requested_outputs(request: Any, shared_memory: SystemSharedMemory
               ) -> tuple[dict[str, int] | None, dict[str, OutputSlot]]:
    """The outputs a request asks for, each with its classification count (0: the tensor), or None for all;
    and where in shared memory those it wants there go. An output parameter jitserve does not implement is
    refused, not ignored."""
    requested, slots = {}, {}
    for output in request.outputs:
        where = f"output '{shown(output.name)}'"
        parameters = parameter_values(output.parameters)
        refuse_unsupported(set(parameters) - {"classification", "binary_data"}, where)
        requested[output.name] = class_count(parameters.get("classification", 0), where)
        place = output_placement(parameters, where) if parameters else None
        if place is not None:
            slots[output.name] = shared_memory.slot(output.name, place)
    return requested or None, slots


def priority(parameters: Any) -> int | None:
    """The ``priority`` parameter of a request's ``parameters`` map (tritonclient sends it as ``uint64_param``)."""
    if "priority" not in parameters:
        return None
    parameter = parameters["priority"]
    kind = parameter.WhichOneof("parameter_choice")
    if kind not in ("int64_param", "uint64_param"):
        raise ProtocolError(f"the 'priority' parameter must be an integer, got a {kind}")
    return int(getattr(parameter, kind))


def decode_inputs(request: Any, shared_memory: SystemSharedMemory, raw: Sequence[bytes | memoryview] | None = None
                   ) -> dict[str, np.ndarray]:
    """The request's input tensors: from raw contents (one entry per input not in shared memory, in order;
    ``raw``: as :func:`parse_infer` read them, else the message's), typed contents, or the shared memory
    regions they name."""
    inputs = list(request.inputs)  # each access of the field makes new wrappers: read once
    places = {position: place for position, tensor in enumerate(inputs) if tensor.parameters and
              (place := placement(parameter_values(tensor.parameters), f"input '{shown(tensor.name)}'")) is not None}
    raw = list(request.raw_input_contents) if raw is None else raw
    if raw and len(raw) != len(inputs) - len(places):
        raise ProtocolError(f"raw_input_contents has {len(raw)} entries for {len(inputs) - len(places)} "
                            f"inputs{' not in shared memory' if places else ''}")
    if raw and any(tensor.HasField("contents") for tensor in inputs):
        raise ProtocolError("the request has both raw_input_contents and typed contents; the protocol allows one")
    tensors: dict[str, np.ndarray] = {}
    contents = iter(raw)
    for position, tensor in enumerate(inputs):
        name = tensor.name
        if name in tensors:
            raise ProtocolError(f"input '{name}' is given twice")
        shape = list(tensor.shape)
        place = places.get(position) if places else None
        if place is not None:
            if tensor.HasField("contents"):
                raise ProtocolError(f"input '{name}' has both contents and shared_memory_region; send one")
            tensors[name] = shared_memory.read(name, tensor.datatype, shape, place)
            continue
        if raw:
            tensors[name] = decode_raw(name, tensor.datatype, shape, next(contents))
            continue
        dtype_of(name, tensor.datatype)
        field = CONTENTS_FIELDS.get(tensor.datatype)
        if field is None:
            raise ProtocolError(f"input '{name}': {tensor.datatype} needs raw_input_contents")
        misplaced = [filled.name for filled, _ in tensor.contents.ListFields() if filled.name != field]
        if misplaced:
            raise ProtocolError(f"input '{name}': {tensor.datatype} values go in contents.{field}, but the "
                                f"request filled {', '.join(misplaced)}")
        tensors[name] = decode_values(name, tensor.datatype, shape, list(getattr(tensor.contents, field)))
    return tensors


def parse(request_class: Any, data: bytes) -> Any:
    """A request message from its bytes; bytes that are not one are the client's error (INVALID_ARGUMENT), not
    the INTERNAL that gRPC answers when its own deserializer fails."""
    try:
        return request_class.FromString(data)
    except DecodeError:
        raise ProtocolError(f"the request is not a valid {request_class.DESCRIPTOR.full_name} message") from None


def parse_infer(data: bytes) -> tuple[Any, list[memoryview] | None]:
    """A ``ModelInferRequest`` from its bytes, and, for one of ``LARGE_REQUEST_BYTES`` or more, its
    ``raw_input_contents`` as views of those bytes: protobuf's parser would copy them, and every read of
    the field copy them again. The other fields, found by walking the message's top level, are parsed as
    usual. None: the contents are the message's own (a small request, parsed whole)."""
    request_class = MESSAGES["ModelInferRequest"]
    if len(data) < LARGE_REQUEST_BYTES:
        return parse(request_class, data), None
    view = memoryview(data)
    rest: list[memoryview] = []
    raw: list[memoryview] = []
    at = 0
    while at < len(view):
        start = at
        tag, at = _varint(view, at, request_class)
        skip = _FIXED_WIDTHS.get(tag & 7, -1)
        if tag & 7 in (0, 2):  # a varint's value; a length, before that many bytes
            length, at = _varint(view, at, request_class)
            skip = length if tag & 7 == 2 else 0
        if skip < 0 or at + skip > len(view):
            raise ProtocolError(f"the request is not a valid {request_class.DESCRIPTOR.full_name} message")
        at += skip
        if tag == _RAW_CONTENTS_TAG:
            raw.append(view[at - skip:at])
        else:
            rest.append(view[start:at])
    return parse(request_class, b"".join(rest)), raw


LARGE_REQUEST_BYTES = 64 * 1024
_RAW_CONTENTS_TAG = 7 << 3 | 2  # ModelInferRequest.raw_input_contents (field 7), length-delimited
_FIXED_WIDTHS = {1: 8, 5: 4}  # wire types of a fixed width -> its bytes after the tag


def _varint(view: memoryview, at: int, request_class: Any) -> tuple[int, int]:
    """The varint at ``at`` (a tag or a length) and where it ends."""
    value = shift = 0
    while at < len(view) and shift < 64:
        byte = view[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
    raise ProtocolError(f"the request is not a valid {request_class.DESCRIPTOR.full_name} message")
