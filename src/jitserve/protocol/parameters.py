"""The rules of request parameters that every door's parser shares, in a leaf module (errors and numpy
only), so that the parsers (``http_request.py``, ``grpc_request.py``) and the rooms above them
(``service.py``, ``model.py``) all read them from here: the protocol's parameters jitserve refuses by name,
and a requested output's ``classification`` count."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..errors import ProtocolError

# parameters of the protocol that jitserve does not implement: refused by name, never silently ignored
UNSUPPORTED_PARAMETERS = {
    "sequence_id": "jitserve has no sequence batching (Triton's stateful models); each request stands alone",
    "sequence_start": "jitserve has no sequence batching (Triton's stateful models); each request stands alone",
    "sequence_end": "jitserve has no sequence batching (Triton's stateful models); each request stands alone",
    "classification": "it is a parameter of a requested output (tritonclient's InferRequestedOutput(name, "
                      "class_count=k)), not of the request",
}


def refuse_unsupported(parameters: Iterable[str], where: str) -> None:
    """A ProtocolError naming the first parameter of ``parameters`` that jitserve does not implement."""
    for name in parameters:
        why = UNSUPPORTED_PARAMETERS.get(name)
        if why is not None:
            raise ProtocolError(f"{where}: the '{name}' parameter is not supported: {why}")


def class_count(value: Any, where: str) -> int:
    """A requested output's ``classification`` parameter: how many classes to return (0: the tensor)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ProtocolError(f"{where}: the 'classification' parameter must be a whole number of classes >= 0, "
                            f"got {value!r:.40}")
    return int(value)
