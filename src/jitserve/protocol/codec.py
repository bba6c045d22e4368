"""Tensors on the wire: Open Inference Protocol datatypes, names and checks.

Numbers travel little-endian; ``BYTES`` tensors (text) travel as Triton sends
them: JSON strings, or each element as a 4-byte little-endian length and its
bytes (the binary extension's and gRPC's raw form), and reach the serving as
numpy object arrays of ``bytes``. ``BF16`` tensors are ``ml_dtypes.bfloat16`` arrays (JAX's own
bfloat16): 2 bytes per element in binary data, numbers in JSON as ``FP16`` ones are (Triton refuses both
in JSON). A leaf of the protocol package: numpy, ml_dtypes and jitserve's errors only.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import ProtocolError

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)  # numpy has no bfloat16 of its own; JAX's is this one
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8), "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64), "BF16": BFLOAT16,
}
DATATYPE_OF: dict[np.dtype, str] = {dtype: name for name, dtype in DATATYPES.items()}
_LITTLE_ENDIAN = {name: dtype.newbyteorder("<") for name, dtype in DATATYPES.items()}  # how binary data holds them
_NATIVE = {name for name, dtype in DATATYPES.items() if _LITTLE_ENDIAN[name] == dtype}  # read as they come
_WRITTEN_AS_IS = frozenset(DATATYPES[name] for name in _NATIVE)  # dtypes whose bytes are binary data as they are
BYTES = "BYTES"
_TEXT_KINDS = "OSU"  # numpy kinds that travel as BYTES: objects (bytes or str), fixed-size bytes and str
_LENGTH = np.dtype("<u4")  # the length before each element of a binary BYTES tensor


def number_kind(dtype: np.dtype) -> str:
    """A dtype's numpy kind, bfloat16 (``V`` to numpy, a type of ml_dtypes) counted a float as FP16 is."""
    return "f" if dtype == BFLOAT16 else dtype.kind


def datatype_of(dtype: Any) -> str:
    dtype = np.dtype(dtype)
    name = DATATYPE_OF.get(dtype)
    if name is None:
        if dtype.kind in _TEXT_KINDS:
            return BYTES
        raise ProtocolError(f"dtype {dtype.name} has no Open Inference Protocol datatype")
    return name


def dtype_of(tensor: str, datatype: str) -> np.dtype:
    dtype = DATATYPES.get(datatype)
    if dtype is None:
        if datatype == BYTES:
            return np.dtype(object)
        raise ProtocolError(f"input '{tensor}': unknown datatype {datatype!r}; expected one of "
                            f"{', '.join(DATATYPES)}, {BYTES}")
    return dtype


def _element_bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def raw_contents(array: np.ndarray) -> bytes:
    """A tensor's binary contents: numbers little-endian; BYTES elements each after its 4-byte length."""
    if array.dtype in _WRITTEN_AS_IS:  # tobytes is C order whatever the array's
        return array.tobytes()
    if array.dtype.kind not in _TEXT_KINDS:
        return np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes()
    parts = []
    for value in array.reshape(-1).tolist():
        data = _element_bytes(value)
        parts += [len(data).to_bytes(4, "little"), data]
    return b"".join(parts)


def _decode_bytes(tensor: str, dims: tuple[int, ...], raw: bytes | memoryview) -> np.ndarray:
    """A BYTES tensor from its binary contents (4-byte little-endian lengths, each before its element)."""
    view = memoryview(raw)
    count = math.prod(dims)
    if count * _LENGTH.itemsize > len(view):  # checked before a slot per element is allocated
        raise ProtocolError(f"input '{tensor}': shape {list(dims)} holds {count:,} BYTES elements, each at least "
                            f"a 4-byte length, but the binary data has {len(view):,} bytes")
    elements = np.empty(count, dtype=object)
    at = 0
    for index in range(count):
        if at + 4 > len(view):
            raise ProtocolError(f"input '{tensor}': binary BYTES data ends after {index} of {count} elements "
                                f"(each is a 4-byte little-endian length, then that many bytes)")
        size = int(np.frombuffer(view[at:at + 4], _LENGTH)[0])
        if at + 4 + size > len(view):
            raise ProtocolError(f"input '{tensor}': BYTES element {index} says {size} bytes, but "
                                f"{len(view) - at - 4} are left")
        elements[index] = bytes(view[at + 4:at + 4 + size])
        at += 4 + size
    if at != len(view):
        raise ProtocolError(f"input '{tensor}': {len(view) - at} bytes of binary data after the {count} BYTES "
                            f"elements of shape {list(dims)}")
    return elements.reshape(dims)


def _decode_texts(tensor: str, dims: tuple[int, ...], values: Any) -> np.ndarray:
    """A BYTES tensor from a (flat or nested) list of JSON strings (or gRPC's bytes_contents)."""
    flat: list[Any] = []
    stack = [values]
    while stack:  # depth first, in order
        value = stack.pop()
        if type(value) is list:
            stack.extend(reversed(value))
        elif isinstance(value, (str, bytes)):
            flat.append(value)
        else:
            raise ProtocolError(f"input '{tensor}': BYTES data must be strings, got {_short(value)}")
    if len(flat) != math.prod(dims):
        raise ProtocolError(f"input '{tensor}': {len(flat)} values, expected {math.prod(dims)} for shape {list(dims)}")
    elements = np.empty(len(flat), dtype=object)
    elements[:] = [_element_bytes(value) for value in flat]
    return elements.reshape(dims)


MAX_RANK = 32
_INT = {int}
MAX_DIMENSION = 2**31 - 1  # what any real tensor sent in one request stays under; [0, 2**63 - 1] is refused


def check_shape(tensor: str, shape: Any) -> tuple[int, ...]:
    if type(shape) is list and len(shape) <= MAX_RANK and (  # the common case, without a Python loop
            not shape or (set(map(type, shape)) == _INT and min(shape) >= 0 and max(shape) <= MAX_DIMENSION)):
        return tuple(shape)
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                        for d in shape):
        raise ProtocolError(f"input '{tensor}': shape must be a list of non-negative integers, got {_short(shape)}")
    if len(shape) > MAX_RANK:
        raise ProtocolError(f"input '{tensor}': shape has {len(shape)} dimensions; at most {MAX_RANK} are supported")
    if any(d > MAX_DIMENSION for d in shape):
        raise ProtocolError(f"input '{tensor}': shape {_short(shape)} has a dimension over {MAX_DIMENSION}")
    return tuple(shape)


SHOWN_CHARACTERS = 100


def shown(text: str) -> str:
    """A name a client sent, as an error message repeats it: at most ``SHOWN_CHARACTERS`` characters."""
    return text if len(text) <= SHOWN_CHARACTERS else text[:SHOWN_CHARACTERS] + "..."


def _short(value: Any, limit: int = 80) -> str:
    """A client's value as it may appear in an error message: its repr, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _holds(values: Any, kind: type) -> bool:
    """Whether a (nested) list of JSON values holds a value of ``kind`` (bool: numpy would take true/false
    as numbers; str: a non-finite float)."""
    stack = [values]
    while stack:
        value = stack.pop()
        if type(value) is list:
            stack.extend(value)
        elif type(value) is kind:
            return True
    return False


def _array(tensor: str, values: Any) -> np.ndarray:
    try:
        return np.asarray(values)
    except ValueError:
        raise ProtocolError(f"input '{tensor}': data is a ragged nested list; send a flat list") from None


def _holds_bool(values: Any, array: np.ndarray) -> bool:
    """Whether JSON true/false hide among the numbers ``array`` was read from (numpy reads them as 1 and 0):
    in a flat list only the values equal to 0 or 1 are looked at, so numeric data costs no Python loop."""
    if array.ndim != 1:
        return _holds(values, bool)
    suspects = np.flatnonzero((array == 0) | (array == 1)).tolist()
    return any(type(values[i]) is bool for i in suspects)


def decode_raw(tensor: str, datatype: str, shape: Any, raw: bytes | memoryview) -> np.ndarray:
    """A tensor from its little-endian binary contents."""
    dtype, dims = dtype_of(tensor, datatype), check_shape(tensor, shape)
    if datatype == BYTES:
        return _decode_bytes(tensor, dims, raw)
    expected = math.prod(dims) * dtype.itemsize
    if len(raw) != expected:
        raise ProtocolError(f"input '{tensor}': {len(raw)} bytes of binary data, expected {expected} "
                            f"for {datatype} {list(dims)}")
    array = np.frombuffer(raw, _LITTLE_ENDIAN[datatype])
    return (array if datatype in _NATIVE else array.astype(dtype)).reshape(dims)


_SOURCE_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}  # JSON value kinds each target kind accepts

# Non-finite floats in JSON tensors, as protobuf's JSON mapping writes them (bare NaN is not JSON).
NON_FINITE = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def _with_non_finite(tensor: str, values: Any) -> Any:
    """A nested list of JSON values with the strings "NaN", "Infinity", "-Infinity" read as floats."""
    if type(values) is list:
        return [_with_non_finite(tensor, value) for value in values]
    if type(values) is str:
        if values not in NON_FINITE:
            raise ProtocolError(f"input '{tensor}': {_short(values)} is not a number (strings allowed in float "
                                f"data: {', '.join(NON_FINITE)})")
        return NON_FINITE[values]
    return values


def json_values(array: np.ndarray) -> list[Any]:
    """A tensor's values for a JSON body: NaN and infinities as the strings above, never bare tokens; BYTES
    elements as text (UTF-8; other bytes need the binary form)."""
    flat = array.reshape(-1)
    if flat.dtype.kind in _TEXT_KINDS:
        try:
            return [value if isinstance(value, str) else bytes(value).decode() for value in flat.tolist()]
        except UnicodeDecodeError:
            raise ProtocolError("a BYTES output holds bytes that are not UTF-8 text, which JSON cannot carry; "
                                "ask for it as binary data (binary_data_output)") from None
    if number_kind(flat.dtype) != "f" or np.isfinite(flat).all():
        return flat.tolist()
    return [value if math.isfinite(value) else ("NaN" if value != value else "Infinity" if value > 0 else "-Infinity")
            for value in flat.tolist()]


def decode_values(tensor: str, datatype: str, shape: Any, values: Any) -> np.ndarray:
    """A tensor from a (flat or nested) list of JSON values."""
    dtype, dims = dtype_of(tensor, datatype), check_shape(tensor, shape)
    if datatype == BYTES:
        return _decode_texts(tensor, dims, values)
    if type(values) is list:
        exact = _plain_numbers(datatype, dtype, dims, values)
        if exact is not None:
            return exact
    array = _array(tensor, values)
    if number_kind(dtype) == "f" and array.dtype.kind in "UO":  # strings among the numbers: non-finite floats?
        values = _with_non_finite(tensor, values)
        array = _array(tensor, values)
    return _tensor(tensor, datatype, dtype, dims, array, values)


# numpy kind of a datatype -> the Python types of the JSON values that one numpy call reads into it exactly
_PLAIN_TYPES: dict[str, set[type]] = {"f": {float, int}, "i": {int}, "u": {int}, "b": {bool}}
_INT64_MAX = 2**63 - 1  # the integers the checked path reads as such (beyond, as objects, which it refuses)


def _plain_numbers(datatype: str, dtype: np.dtype, dims: tuple[int, ...], values: list[Any]) -> np.ndarray | None:
    """A flat list of JSON numbers of the datatype's kind, as many as the shape holds, read by one numpy call,
    its bounds checked on the list (a number too large for a narrow float) or by numpy (an integer out of
    range raises); None for anything else (nested lists, true/false among numbers, strings, a wrong count,
    a value out of range), which the checked path decodes or refuses with its message."""
    kinds = set(map(type, values))
    if not values or len(values) != math.prod(dims) or not kinds <= _PLAIN_TYPES[number_kind(dtype)]:
        return None
    if number_kind(dtype) == "f":  # numpy would make inf of a number too large, or read huge integers as floats
        largest = min(_LARGEST.get(dtype, math.inf), _INT64_MAX if int in kinds else math.inf)
        if not -largest <= min(values) <= max(values) <= largest:
            return None
    try:
        return np.array(values, dtype).reshape(dims)
    except OverflowError:
        return None


def decode_numbers(tensor: str, datatype: str, shape: Any, flat: np.ndarray) -> np.ndarray:
    """A tensor from the values of a flat JSON list already read as numbers (float64, int64 or uint64), where
    a JSON parser could do so: no true/false and no strings among them."""
    return _tensor(tensor, datatype, dtype_of(tensor, datatype), check_shape(tensor, shape), flat, None)


def _tensor(tensor: str, datatype: str, dtype: np.dtype, dims: tuple[int, ...], array: np.ndarray,
            values: Any) -> np.ndarray:
    """The checked tensor of shape ``dims`` from JSON ``values`` read into ``array`` (None: numbers only)."""
    if array.size != math.prod(dims):
        raise ProtocolError(f"input '{tensor}': {array.size} values, expected {math.prod(dims)} for shape {list(dims)}")
    if array.size == 0:
        return np.zeros(dims, dtype)
    if array.dtype.kind not in _SOURCE_KINDS[number_kind(dtype)] or (
            dtype.kind != "b" and values is not None and _holds_bool(values, array)):
        raise ProtocolError(f"input '{tensor}': data must be {datatype} values (true/false only for BOOL)")
    if dtype in _LARGEST:
        _refuse_overflow(tensor, datatype, dtype, array)
    converted = array.astype(dtype).reshape(dims)
    if dtype.kind in "iu" and not np.array_equal(converted.reshape(array.shape), array):
        raise ProtocolError(f"input '{tensor}': data does not fit {datatype}")
    return converted


# narrow float dtype -> its largest finite value: a larger number would become an infinity in it
_LARGEST = {dtype: float(ml_dtypes.finfo(dtype).max)
            for dtype in (np.dtype(np.float16), np.dtype(np.float32), BFLOAT16)}


def _refuse_overflow(tensor: str, datatype: str, dtype: np.dtype, array: np.ndarray) -> None:
    """A finite JSON number too large for a narrow float datatype would silently become an infinity: refuse
    it (an infinity sent as "Infinity" stays one)."""
    largest = _LARGEST[dtype]
    too_large = (array > largest) | (array < -largest)
    if too_large.any():
        too_large &= np.isfinite(array)
        if too_large.any():
            value = array.reshape(-1)[np.flatnonzero(too_large)[0]].item()
            raise ProtocolError(f"input '{tensor}': {value!r} does not fit {datatype}, whose largest finite value "
                                f"is {largest:.6g} (an infinity is sent as \"Infinity\" or \"-Infinity\")")
