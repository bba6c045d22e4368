"""What a generation reads from the wire: one table, :data:`FIELDS`, of the request fields a generation takes
besides its prompt, where each may come from, and reading a request's tensors and parameters into their
values (:func:`read_fields`).

A text generation speaks Triton's LLM convention, as Triton's TensorRT-LLM and vLLM models take it and
genai-perf's ``tensorrtllm`` and ``vllm`` back ends send it: the prompt is the input ``text_input``, and each
field may come as an input tensor of one element (``max_tokens`` as genai-perf's ``tensorrtllm`` sends it,
``stream``, ``exclude_input_in_output``), as a request parameter (tritonclient's ``parameters=``, the
generate extension's JSON), or as a key of vLLM's ``sampling_parameters`` input, a JSON object in a BYTES
tensor (where numbers may be strings, as vLLM reads them). A field given in two places must give the same
value (a client may say it twice for portability); two different values are refused, naming both places.
A token generation (no detokenizer) takes its fields as parameters only. Anything else is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from ..errors import ProtocolError
from .codec import shown

PROMPT_CHARS_PER_TOKEN = 32  # a prompt's text longer than this per token of the context is refused untokenized


def prompt_chars(max_length: int) -> int:
    """The longest text (characters) a prompt for a generation of ``max_length`` tokens may be, on every door:
    a longer one could not fit the context whatever the tokenizer (a token is rarely longer than
    ``PROMPT_CHARS_PER_TOKEN``), and is refused before it is tokenized."""
    return max_length * PROMPT_CHARS_PER_TOKEN


def _whole(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ProtocolError(f"{where} must be a whole number, got {_value(value)}")
    return int(value)


def _positive(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ProtocolError(f"{where} must be a positive integer, got {_value(value)}")
    return int(value)


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ProtocolError(f"{where} must be a number, got {_value(value)}")
    return value if isinstance(value, int | float) else float(value)


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise ProtocolError(f"{where} must be true or false, got {_value(value)}")
    return bool(value)


def _ids(value: Any, where: str) -> list[int]:
    """Token ids (checked further by the generation's ``Sampling``)."""
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ProtocolError(f"{where} must be a list of token ids (integers), got {_value(value)}")
    return value


ID_DIGITS = len(str(2**31 - 1))  # a token id is an int32 (the generation's Sampling checks its range)


def logit_bias(value: Any, where: str) -> dict[int, Any]:
    """Token ids -> biases: a JSON object, or its text (a gRPC parameter is a string), the ids as JSON writes an
    object's keys (``"50256"``; the biases checked further by the generation's ``Sampling``)."""
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            pass  # refused below, as it came
    if not isinstance(value, dict) or not all(isinstance(key, str) and key.isascii() and key.isdigit()
                                              for key in value):
        raise ProtocolError(f"{where} must map token ids (integers, as JSON writes them: \"50256\") to biases, got "
                            f"{_value(value)}")
    longest = max(value, key=len, default="")
    if len(longest) > ID_DIGITS:  # read no further: int() refuses past 4,300 digits, and its time grows with them
        raise ProtocolError(f"{where} names a token id of {len(longest)} digits; a token id has at most {ID_DIGITS}")
    biases = {int(key): bias for key, bias in value.items()}
    if len(biases) < len(value):
        raise ProtocolError(f"{where} names a token id twice (written two ways, as \"5\" and \"05\")")
    return biases


def _stops(value: Any, where: str) -> str | list[str]:
    """One stop sequence or a list of them (checked further by the generation's ``StopText``)."""
    texts = value if isinstance(value, list) else [value]
    if not texts or not all(isinstance(text, str) for text in texts):
        raise ProtocolError(f"{where} must be a string or a list of strings, got {_value(value)}")
    return value


@dataclass(frozen=True)
class Field:
    """A request field of a generation: how its value is checked, its datatype as an optional input tensor
    of a text generation (None: a parameter only; dims ``[-1]``: a list), whether ``sampling_parameters`` may
    hold it, whether a text or a token generation takes it, and the field it gives under another name
    (``alias``: TensorRT-LLM's name of a field vLLM names otherwise)."""

    read: Callable[[Any, str], Any]
    datatype: str | None = None
    dims: tuple[int, ...] = (1,)
    sampled: bool = False
    text: bool = True
    tokens: bool = False
    alias: str | None = None


# the fields that make a request's Sampling
SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed", "min_tokens", "stop_token_ids", "repetition_penalty",
            "presence_penalty", "frequency_penalty", "ignore_eos", "logit_bias")
# field -> how a generation reads it; the order is the order of a text generation's optional inputs
FIELDS: dict[str, Field] = {
    "max_tokens": Field(_positive, "INT32", sampled=True),  # a text generation's most tokens
    "max_steps": Field(_positive, text=False, tokens=True),  # a token generation's most outputs
    "temperature": Field(_number, "FP32", sampled=True, tokens=True),
    "top_p": Field(_number, "FP32", sampled=True, tokens=True),
    "top_k": Field(_whole, "INT32", sampled=True, tokens=True),
    "min_p": Field(_number, sampled=True, tokens=True),  # vLLM's (a parameter only, as ignore_eos)
    "seed": Field(_whole, "UINT64", sampled=True, tokens=True),
    "stop": Field(_stops, "BYTES", (-1,), sampled=True, tokens=True),  # a stop sequence, or several
    "stop_token_ids": Field(_ids, "INT32", (-1,), sampled=True, tokens=True),  # ids that end it as eos does
    "min_tokens": Field(_whole, "INT32", sampled=True, tokens=True),  # outputs before eos may end it
    "min_length": Field(_whole, "INT32", alias="min_tokens"),  # TensorRT-LLM's (genai-perf's deterministic)
    "ignore_eos": Field(_flag, sampled=True, tokens=True),  # vLLM's: eos does not end it (a parameter only)
    "logit_bias": Field(logit_bias, sampled=True, tokens=True),  # OpenAI's and vLLM's (a JSON object)
    # vLLM's sampling parameters and TensorRT-LLM's inputs alike (HF's rule; OpenAI's over the outputs)
    "repetition_penalty": Field(_number, "FP32", sampled=True, tokens=True),
    "presence_penalty": Field(_number, "FP32", sampled=True, tokens=True),
    "frequency_penalty": Field(_number, "FP32", sampled=True, tokens=True),
    "stream": Field(_flag, "BOOL"),  # false: the whole text in one response, even to a stream
    "exclude_input_in_output": Field(_flag, "BOOL"),  # false: the text starts with the prompt
}
PROMPT = "text_input"
SAMPLING_PARAMETERS = "sampling_parameters"  # vLLM's: a JSON object of the fields FIELDS marks sampled
# a text generation's optional inputs -> their datatype and dims
OPTIONAL_INPUTS: dict[str, tuple[str, tuple[int, ...]]] = {
    **{name: (field.datatype, field.dims) for name, field in FIELDS.items() if field.datatype is not None},
    SAMPLING_PARAMETERS: ("BYTES", (1,))}
TEXT_PARAMETERS = tuple(name for name, field in FIELDS.items() if field.text)
TOKEN_PARAMETERS = tuple(name for name, field in FIELDS.items() if field.tokens)
SAMPLED = tuple(name for name, field in FIELDS.items() if field.sampled)
# parameters of the protocol itself, which the front reads and a generation lets pass
PROTOCOL_PARAMETERS = ("binary_data_output", "priority", "timeout", "triton_enable_empty_final_response")


def _value(value: Any) -> str:
    return shown(repr(value))


def _tensor_value(name: str, array: np.ndarray) -> Any:
    """An optional input's value: its one element as a Python value (text for BYTES); a list of them for a
    list's tensor (dims ``[-1]``)."""
    where = f"the '{name}' input"
    values = [value.decode(errors="replace") if isinstance(value, bytes) else value
              for value in array.reshape(-1).tolist()]
    if name in FIELDS and FIELDS[name].dims == (-1,):
        return values
    if len(values) != 1:
        raise ProtocolError(f"{where} must hold one value, got shape {list(array.shape)}")
    return values[0]


def _from_json(value: Any, field: Field) -> Any:
    """A number in ``sampling_parameters`` may be a string, as vLLM's model reads it (genai-perf sends
    ``{"max_tokens": "8"}``)."""
    if isinstance(value, str) and field.read in (_positive, _whole, _number):
        try:
            return float(value) if field.read is _number else int(value)
        except ValueError:
            return value
    return value


def _sampling_parameters(array: np.ndarray, model: str) -> dict[str, Any]:
    where = f"the '{SAMPLING_PARAMETERS}' input"
    text = _tensor_value(SAMPLING_PARAMETERS, array)
    try:
        found = orjson.loads(text)
    except (orjson.JSONDecodeError, TypeError):
        found = None
    if not isinstance(found, dict):
        raise ProtocolError(f"{where} must be a JSON object (vLLM's sampling parameters), got {_value(text)}")
    unknown = sorted(set(found) - set(SAMPLED))
    if unknown:
        raise ProtocolError(f"{where}: model '{model}' does not take '{shown(unknown[0])}'; its sampling "
                            f"parameters are {', '.join(SAMPLED)}")
    return {name: _from_json(value, FIELDS[name]) for name, value in found.items()}


def read_fields(model: str, text: bool, tensors: Mapping[str, np.ndarray], parameters: Mapping[str, Any]
                ) -> dict[str, Any]:
    """The fields a request gives, each checked by :data:`FIELDS`, from ``tensors`` (the request's inputs
    but its prompt; a text generation's only) and ``parameters``."""
    kind, takes = ("a text generation", TEXT_PARAMETERS) if text else ("a token generation", TOKEN_PARAMETERS)
    unknown = sorted(set(parameters) - {*takes, *PROTOCOL_PARAMETERS})
    if unknown:
        raise ProtocolError(f"model '{model}' does not take the parameter '{shown(unknown[0])}'; {kind} takes "
                            f"{', '.join(takes)}")
    given: dict[str, tuple[Any, str]] = {}  # field -> (its value, where it came from)

    def give(name: str, value: Any, where: str) -> None:
        value = FIELDS[name].read(value, where)
        name = FIELDS[name].alias or name
        if name in given and given[name][0] != value:
            first, place = given[name]
            raise ProtocolError(f"'{name}' is given twice with different values: {_value(first)} ({place}) and "
                                f"{_value(value)} ({where}); give it once")
        given.setdefault(name, (value, where))

    for name, array in tensors.items():
        if name == SAMPLING_PARAMETERS:
            for key, value in _sampling_parameters(array, model).items():
                give(key, value, f"'{key}' in {SAMPLING_PARAMETERS}")
        elif name in FIELDS and FIELDS[name].datatype is not None:
            give(name, _tensor_value(name, array), f"the '{name}' input")
        else:
            raise ProtocolError(f"model '{model}' does not take the input '{shown(name)}'; it takes "
                                f"{PROMPT} and, optionally, {', '.join(OPTIONAL_INPUTS)}")
    for name, value in parameters.items():
        if name in FIELDS:
            give(name, value, f"the '{name}' parameter")
    return {name: value for name, (value, _) in given.items()}
