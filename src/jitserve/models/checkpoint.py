"""A Hugging Face checkpoint folder read strictly: ``config.json``'s fields, each one a family reads named
when it is missing or holds what the family does not implement, and the weights checked key by key
against the shapes the config implies, before anything compiles.

Everything here raises :class:`~jitserve.errors.CheckpointError` naming the folder and the key or field,
never a bare ``KeyError`` at the first request."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ..errors import CheckpointError
from ..params import flatten, load_params, nest

DTYPES: dict[str, Any] = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
_ABSENT = object()


class Checkpoint:
    """A checkpoint folder: its ``config.json`` (fields read through :meth:`field`), and its weights."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = os.fspath(folder)
        if not os.path.isdir(self.folder):
            raise CheckpointError(f"{self.folder!r} is not a folder: from_pretrained takes a Hugging Face "
                                  f"checkpoint folder (config.json, *.safetensors, tokenizer.json)")
        config = self.json("config.json")
        if config is None:
            raise CheckpointError(f"checkpoint {self.folder!r} has no config.json")
        self.config: dict[str, Any] = config
        architectures = self.config.get("architectures")
        self.architecture = architectures[0] if isinstance(architectures, list) and architectures else None

    def json(self, name: str) -> dict[str, Any] | None:
        """The folder's JSON file ``name`` as a dict, or None where there is none."""
        path = os.path.join(self.folder, name)
        if not os.path.isfile(path):
            return None
        try:
            with open(path, encoding="utf-8") as file:
                data = json.load(file)
        except (OSError, ValueError) as error:
            raise CheckpointError(f"checkpoint {self.folder!r}: {name} is not readable JSON ({error})") from None
        if not isinstance(data, dict):
            raise CheckpointError(f"checkpoint {self.folder!r}: {name} holds {type(data).__name__}, not an object")
        return data

    def field(self, name: str, default: Any = _ABSENT, kind: type | tuple[type, ...] | None = None) -> Any:
        """``config.json``'s ``name`` (``default`` where absent or null; required without one), of ``kind``."""
        value = self.config.get(name)
        if value is None:
            if default is _ABSENT:
                raise CheckpointError(f"checkpoint {self.folder!r}: config.json has no {name!r}, which "
                                      f"{self.architecture} needs")
            return default
        if kind is None:
            return value
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise CheckpointError(f"checkpoint {self.folder!r}: config.json's {name!r} is {value!r}; expected "
                                  f"{_kind_name(kinds)}")
        return value

    def count(self, name: str, default: Any = _ABSENT) -> int:
        """A positive whole-number field."""
        value = self.field(name, default, int)
        if value < 1:
            raise CheckpointError(f"checkpoint {self.folder!r}: config.json's {name!r} is {value}; expected a "
                                  f"positive integer")
        return int(value)

    def number(self, name: str, default: Any = _ABSENT) -> float:
        return float(self.field(name, default, (int, float)))

    def choice(self, name: str, default: Any, supported: Iterable[Any]) -> Any:
        """A field whose value must be one ``supported`` (else refused, naming it)."""
        value = self.field(name, default)
        supported = list(supported)
        if value not in supported:
            raise self.unsupported(name, value, f"{self.architecture} is served with "
                                   f"{' or '.join(repr(s) for s in supported)}")
        return value

    def unsupported(self, name: str, value: Any, why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {self.folder!r}: config.json's {name!r} is {value!r}, which jitserve "
                               f"does not implement ({why})")

    def weights(self, expected: Mapping[str, tuple[int, ...]], ignored: Iterable[str] = (),
                dtype: str | None = None) -> dict[str, Any]:
        """The checkpoint's weights as a nested tree, exactly the ``expected`` names with the expected shapes
        (a missing, misshaped or unexpected key is an error naming it; names matching an ``ignored``
        pattern, such as derivable buffers, are dropped), cast to ``dtype`` where given."""
        flat = flatten(load_params(self.folder))
        skip = [re.compile(pattern) for pattern in ignored]
        flat = {name: array for name, array in flat.items() if not any(p.fullmatch(name) for p in skip)}
        for name, shape in expected.items():
            if name not in flat:
                raise CheckpointError(f"checkpoint {self.folder!r}: weight {name!r} is missing; config.json "
                                      f"implies it, shaped {shape}")
            if tuple(flat[name].shape) != tuple(shape):
                raise CheckpointError(f"checkpoint {self.folder!r}: weight {name!r} has shape "
                                      f"{tuple(flat[name].shape)}, but config.json implies {tuple(shape)}")
        unexpected = sorted(set(flat) - set(expected))
        if unexpected:
            raise CheckpointError(f"checkpoint {self.folder!r}: weight {unexpected[0]!r} (shape "
                                  f"{tuple(flat[unexpected[0]].shape)}) is unexpected: {self.architecture} as "
                                  f"configured has no such weight"
                                  + (f" ({len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
        cast = None if dtype is None else DTYPES[dtype]
        return nest({name: array if cast is None or not jnp.issubdtype(array.dtype, jnp.floating)
                     or array.dtype == cast else np.asarray(array).astype(cast) for name, array in flat.items()},
                    repr(self.folder))


def check_dtype(dtype: str | None) -> str | None:
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"dtype must be one of {', '.join(DTYPES)} or None (as the checkpoint holds), "
                              f"got {dtype!r}")
    return dtype


def _kind_name(kinds: tuple[type, ...]) -> str:
    return " or ".join({"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
                        "list": "a list", "dict": "an object"}.get(k.__name__, k.__name__) for k in kinds)
