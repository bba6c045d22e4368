"""An HTTP inference request's body as tensors: its JSON header (small ones read by orjson, large ones by
simdjson, each input's flat list of numbers straight into an array), the binary tensor extension's
blobs after it and the system shared memory regions it names, checked input by input; and the outputs it
asks for, and how (JSON, binary, classes, or written into a shared memory region)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import orjson
import simdjson

from ..errors import ProtocolError
from .codec import DATATYPES, decode_numbers, decode_raw, decode_values, number_kind
from .parameters import class_count, refuse_unsupported
from .shared_memory import OutputSlot, SystemSharedMemory, output_placement, placement

# a JSON document up to this size (a binary request's header, a tiny tensor) is read by orjson into Python objects
# at once, which costs less than simdjson's per-key conversions; larger ones by simdjson, which reads each
# input's data into an array without a Python object per value
SMALL_JSON_BYTES = 512
# numeric datatype -> how the JSON parser reads a flat list of them into memory (as_buffer's of_type), and its dtype
_BUFFER_KIND_OF: dict[str, Literal["d", "i", "u"]] = {"f": "d", "i": "i", "u": "u"}  # by numpy dtype kind
BUFFER_KINDS = {name: _BUFFER_KIND_OF[number_kind(dtype)] for name, dtype in DATATYPES.items()
                if number_kind(dtype) in _BUFFER_KIND_OF}
BUFFER_DTYPES = {"d": np.float64, "i": np.int64, "u": np.uint64}
# an output the request asks for: its name, binary or not (None: the request's default), its classification
# count (0: the tensor) and the shared memory it goes into, if any
Requested = tuple[str, bool | None, int, OutputSlot | None]


def parse_request(body: bytes, header_length: int | None, shared_memory: SystemSharedMemory
                  ) -> tuple[dict[str, Any], dict[str, np.ndarray], list[Requested], bool]:
    """The request object, its input tensors, the outputs it asks for (and how), and whether binary output is
    its default."""
    request, binary = _split_body(body, header_length)
    return (request, *_decode_request(request, binary, shared_memory))


def _split_body(body: bytes, header_length: int | None) -> tuple[dict[str, Any], memoryview]:
    if header_length is not None and header_length > len(body):
        raise ProtocolError(f"Inference-Header-Content-Length is {header_length}, but the body has {len(body)} bytes")
    view = memoryview(body)
    header = view[:header_length] if header_length is not None else view
    binary = view[header_length:] if header_length is not None else view[:0]
    if len(header) <= SMALL_JSON_BYTES:
        return _json_object(orjson.loads, header, dict), binary
    # a parser per request: its values stay valid however long the request keeps them
    document = _json_object(simdjson.Parser().parse, header, simdjson.Object)
    return {key: _inputs(document[key]) if key == "inputs" else _plain(document[key]) for key in document}, binary


def _json_object(parse: Callable[[memoryview], Any], header: memoryview, kind: type) -> Any:
    """The request's JSON header parsed by ``parse``, which must give a ``kind`` (the parser's JSON object)."""
    try:
        document = parse(header)
    except (ValueError, RuntimeError) as error:  # orjson.JSONDecodeError is a ValueError
        raise ProtocolError(f"the request body is not valid JSON: {error}") from None
    if not isinstance(document, kind):
        raise ProtocolError("the request must be a JSON object with an 'inputs' list")
    return document


def _plain(value: Any) -> Any:
    """A parsed JSON value as Python objects."""
    if isinstance(value, simdjson.Object):
        return value.as_dict()
    return value.as_list() if isinstance(value, simdjson.Array) else value


def _inputs(value: Any) -> Any:
    """The request's inputs as Python objects, but each ``data`` as the parser's array, which
    :func:`_json_tensor` reads into numpy without a Python object per value."""
    if not isinstance(value, simdjson.Array):
        return _plain(value)
    return [{key: tensor[key] if key == "data" else _plain(tensor[key]) for key in tensor}
            if isinstance(tensor, simdjson.Object) else _plain(tensor) for tensor in value]


def _json_tensor(name: str, datatype: str, shape: Any, data: Any) -> np.ndarray:
    """An input's JSON ``data``: a flat list of numbers that simdjson parsed is read straight into an array;
    anything else (nested lists, true/false, strings, a mix, or the Python list of a small document that
    orjson parsed) goes through :func:`decode_values`, which says what is wrong with it."""
    if isinstance(data, simdjson.Array):
        kind = BUFFER_KINDS.get(datatype)
        if kind is not None:
            try:
                flat = np.frombuffer(data.as_buffer(of_type=kind), BUFFER_DTYPES[kind])
            except (TypeError, ValueError):  # not all numbers of that kind: the checked path tells which
                flat = None
            if flat is not None and flat.size == len(data):  # as_buffer flattens nested lists: flat ones only
                return decode_numbers(name, datatype, shape, flat)
        data = data.as_list()
    return decode_values(name, datatype, shape, data)


def _decode_request(request: dict[str, Any], binary: memoryview, shared_memory: SystemSharedMemory
                    ) -> tuple[dict[str, np.ndarray], list[Requested], bool]:
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ProtocolError("the request needs a non-empty 'inputs' list")
    tensors: dict[str, np.ndarray] = {}
    offset = 0
    for tensor in inputs:
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise ProtocolError("each input must be an object with a string 'name'")
        name = tensor["name"]
        if name in tensors:
            raise ProtocolError(f"input '{name}' is given twice")
        datatype, shape = tensor.get("datatype"), tensor.get("shape")
        if not isinstance(datatype, str):
            raise ProtocolError(f"input '{name}' needs a string 'datatype'")
        parameters = parameters_of(tensor, f"input '{name}'")
        size = parameters.get("binary_data_size")
        place = placement(parameters, f"input '{name}'") if parameters else None
        if ("data" in tensor) + (size is not None) + (place is not None) > 1:
            given = [what for what, there in (("'data'", "data" in tensor),
                                              ("a binary_data_size parameter", size is not None),
                                              ("a shared_memory_region parameter", place is not None)) if there]
            raise ProtocolError(f"input '{name}' has both {given[0]} and {given[1]}; send one")
        if place is not None:
            tensors[name] = shared_memory.read(name, datatype, shape, place)
        elif size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise ProtocolError(f"input '{name}': binary_data_size {size!r} does not fit the "
                                    f"{len(binary) - offset} binary bytes left in the body")
            tensors[name] = decode_raw(name, datatype, shape, binary[offset:offset + size])
            offset += size
        elif "data" in tensor:
            tensors[name] = _json_tensor(name, datatype, shape, tensor["data"])
        else:
            raise ProtocolError(f"input '{name}' has no 'data', binary_data_size or shared_memory_region parameter")
    if offset != len(binary):
        raise ProtocolError(f"the body has {len(binary) - offset} bytes after the last binary input; "
                            f"binary_data_size must account for every byte")
    parameters = parameters_of(request, "the request")
    binary_all = _flag(parameters, "binary_data_output", "the request")
    outputs = request.get("outputs") or []
    if not isinstance(outputs, list):
        raise ProtocolError("'outputs' must be a list of objects with a string 'name'")
    requested: list[Requested] = []
    for output in outputs:
        if not isinstance(output, dict) or not isinstance(output.get("name"), str):
            raise ProtocolError("each requested output must be an object with a string 'name'")
        where = f"output '{output['name']}'"
        output_parameters = parameters_of(output, where)
        classes = class_count(output_parameters.get("classification", 0), where)
        refuse_unsupported(set(output_parameters) - {"classification"}, where)
        chosen = _flag(output_parameters, "binary_data", where) if "binary_data" in output_parameters else None
        place = output_placement(output_parameters, where) if output_parameters else None
        slot = None if place is None else shared_memory.slot(output["name"], place)
        requested.append((output["name"], chosen, classes, slot))
    return tensors, requested, binary_all


def priority(request: dict[str, Any]) -> int | None:
    """The request's ``priority`` parameter (tritonclient's ``priority=``): an integer, else a clear error."""
    parameters = request.get("parameters") or {}
    value = parameters.get("priority") if isinstance(parameters, dict) else None
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ProtocolError(f"the 'priority' parameter must be an integer, got {value!r}")
    return value


def json_object(body: bytes, what: str) -> dict[str, Any]:
    """A request body that is one JSON object (``what``: the request, as its errors name it)."""
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise ProtocolError(f"{what} body is not valid JSON: {error}") from None
    if not isinstance(request, dict):
        raise ProtocolError(f"{what} must be a JSON object, got {type(request).__name__}")
    return request


def parameters_of(holder: dict[str, Any], where: str) -> dict[str, Any]:
    """A request's, input's or output's ``parameters``: a JSON object, or none; anything else is refused
    rather than ignored."""
    parameters = holder.get("parameters")
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise ProtocolError(f"{where}: 'parameters' must be a JSON object, got {type(parameters).__name__}")
    return parameters


def _flag(parameters: Any, name: str, where: str) -> bool:
    """A boolean parameter: JSON true or false only ("false" as a string is an error, not true)."""
    value = parameters.get(name, False) if isinstance(parameters, dict) else False
    if not isinstance(value, bool):
        raise ProtocolError(f"{where}: parameter '{name}' must be true or false, got {value!r}")
    return value
