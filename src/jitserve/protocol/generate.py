"""Triton's generate extension (``/v2/models/{m}/generate`` and ``/generate_stream``): a flat JSON request,
the model's inputs and its parameters side by side, as tensors and parameters for ``InferenceService``; and
the answer as a flat JSON object, a text output as its string (what genai-perf and curl users read)."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from ..errors import ProtocolError
from .codec import decode_values, json_values, shown
from .http_request import json_object, parameters_of


def generate_request(body: bytes, spec: Any, stream: bool) -> tuple[Any, dict[str, np.ndarray], dict[str, Any]]:
    """A generate request's id, tensors and parameters: the generation's inputs by name, optional ones
    included (a string is a BYTES tensor of one element, a list a tensor of the input's datatype), every
    other field, and those under ``parameters``, a parameter. ``stream``, where sent, is a parameter that
    must match the endpoint (true or false)."""
    inputs = {tensor.name: tensor.datatype for tensor in getattr(spec, "inputs", ())}
    if not spec.server.servable.generates:
        raise ProtocolError(f"model '{spec.name}' is not a generation: the generate endpoints serve generations; "
                            f"call /v2/models/{spec.name}/infer")
    request = json_object(body, "the generate request")
    request_id = request.pop("id", None)
    parameters = parameters_of(request, "the generate request")
    request.pop("parameters", None)
    tensors: dict[str, np.ndarray] = {}
    for name, value in request.items():
        if name not in inputs or name == "stream":  # the endpoint says whether to stream: checked below
            if name in parameters:
                raise ProtocolError(f"the generate request gives '{name}' twice: top-level and in 'parameters'")
            parameters = {**parameters, name: value}
            continue
        values = [value] if isinstance(value, str | int | float) else value
        shape = [len(values)] if isinstance(values, list) else [1]
        tensors[name] = decode_values(name, inputs[name], shape, values)
    if "stream" in parameters:
        asked = parameters["stream"]
        if not isinstance(asked, bool):
            raise ProtocolError(f"'stream' must be true or false, got {shown(orjson.dumps(asked).decode())}")
        if asked is not stream:
            raise ProtocolError(f"'stream': {orjson.dumps(asked).decode()} does not match the endpoint; POST to "
                                f"generate{'' if asked is False else '_stream'} instead")
        parameters = {k: v for k, v in parameters.items() if k != "stream"}
    return request_id, tensors, parameters


def generated(model: str, version: str, request_id: Any, outputs: list[tuple[str, np.ndarray]]) -> bytes:
    """A generate answer: each output by name, a BYTES output of one element as its text."""
    payload: dict[str, Any] = {"model_name": model, "model_version": version}
    if request_id is not None:
        payload["id"] = request_id
    for name, array in outputs:
        if array.dtype.kind == "O" and array.size == 1:
            value = array.reshape(-1)[0]
            payload[name] = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
        else:
            payload[name] = json_values(np.ascontiguousarray(array.reshape(-1)))
    return orjson.dumps(payload)
