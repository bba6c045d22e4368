"""A Hugging Face checkpoint folder read strictly: ``config.json``'s fields, each one a family reads named
when it is missing or holds what the family does not implement, and the weights checked key by key
against the shapes the config implies, before anything compiles. A count that sizes an array is checked
before it sizes anything: below 2**31 (the int32 the device indexes with), a width no larger than the
weights' largest dimension, a number of blocks no larger than the number of weights, so that a hostile
``config.json`` cannot make jitserve allocate what its weights do not hold.

Everything here raises :class:`~jitserve.errors.CheckpointError` naming the folder and the key or field,
never a bare ``KeyError`` at the first request."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ..errors import CheckpointError
from ..params import flatten, load_params, nest

DTYPES: dict[str, Any] = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
Fused = Mapping[str, Sequence[tuple[str, int]]]  # a stored weight -> its parts, (name, rows) on its first axis
MAX_COUNT = 2**31 - 1  # the largest count a config.json may give: ids and positions are int32 on the device
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
        self._stored: dict[str, np.ndarray] | None = None

    @property
    def stored(self) -> dict[str, np.ndarray]:
        """Every weight of the folder by dotted name, memory-mapped (nothing read), loaded on first use."""
        if self._stored is None:
            self._stored = flatten(load_params(self.folder))
        return self._stored

    def json(self, name: str, kind: type = dict) -> Any:
        """The folder's JSON file ``name``, an object (or a ``kind``: ``list``), or None where there is none."""
        path = os.path.join(self.folder, name)
        if not os.path.isfile(path):
            return None
        try:
            with open(path, encoding="utf-8") as file:
                data = json.load(file)
        except (OSError, ValueError) as error:
            raise CheckpointError(f"checkpoint {self.folder!r}: {name} is not readable JSON ({error})") from None
        if not isinstance(data, kind):
            raise CheckpointError(f"checkpoint {self.folder!r}: {name} holds {type(data).__name__}, not "
                                  f"{_kind_name((kind,))}")
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
        """A positive whole-number field, below 2**31."""
        value = self.field(name, default, int)
        if not 1 <= value <= MAX_COUNT:
            raise CheckpointError(f"checkpoint {self.folder!r}: config.json's {name!r} is {value}; expected a "
                                  f"positive integer below 2**31")
        return int(value)

    def dimension(self, name: str, default: Any = _ABSENT) -> int:
        """A count that is (or divides) a dimension of some weight: no larger than the largest one stored."""
        value = self.count(name, default)
        largest = max((max(array.shape, default=1) for array in self.stored.values()), default=0)
        if value > largest:
            raise CheckpointError(f"checkpoint {self.folder!r}: config.json's {name!r} is {value}, larger than "
                                  f"any dimension of its weights (the largest is {largest})")
        return value

    def blocks(self, name: str) -> int:
        """A count of blocks (layers), each of at least one weight: no more than the weights stored."""
        value = self.count(name)
        if value > len(self.stored):
            raise CheckpointError(f"checkpoint {self.folder!r}: config.json's {name!r} is {value}, more blocks "
                                  f"than its {len(self.stored)} weights make")
        return value

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
                dtype: str | None = None, tied: tuple[str, str] | None = None,
                fused: Fused | None = None) -> dict[str, Any]:
        """The checkpoint's weights as a nested tree, exactly the ``expected`` names with the expected shapes
        (a missing, misshaped or unexpected key is an error naming it; names matching an ``ignored``
        pattern, such as derivable buffers, are dropped), cast to ``dtype`` where given. ``tied``: the
        names of a head tied to an embedding (``tie_word_embeddings``), whose saved copy is dropped where it
        equals the embedding and refused where it differs (see :meth:`_tied_copy`). ``fused``: a stored
        weight (checked as stored) -> the weights it is split into on its first axis, each ``(name, rows)``
        in order, as the family computes with them (views of the stored rows: nothing is copied)."""
        skip = [re.compile(pattern) for pattern in ignored]
        flat = {name: array for name, array in self.stored.items() if not any(p.fullmatch(name) for p in skip)}
        if tied is not None and tied[0] in flat:
            self._tied_copy(flat, *tied)
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
        for name, parts in (fused or {}).items():
            stored, start = flat.pop(name), 0
            for part, rows in parts:
                flat[part], start = stored[start:start + rows], start + rows
        cast = None if dtype is None else DTYPES[dtype]
        return nest({name: array if cast is None or not jnp.issubdtype(array.dtype, jnp.floating)
                     or array.dtype == cast else np.asarray(array).astype(cast) for name, array in flat.items()},
                    repr(self.folder))


    def _tied_copy(self, flat: dict[str, np.ndarray], head: str, embedding: str) -> None:
        """A saved head beside ``tie_word_embeddings: true``: dropped where it is the embedding's copy; where
        it differs, refused. ``transformers`` 5 keeps a saved head whatever the flag says, earlier releases
        tied it to the embedding: which one the checkpoint's author ran is not knowable, so neither is
        guessed."""
        saved, table = flat.pop(head), flat.get(embedding)
        if table is None or saved.shape != table.shape or not np.array_equal(saved, table):
            raise CheckpointError(f"checkpoint {self.folder!r}: config.json's 'tie_word_embeddings' is true, but "
                                  f"weight {head!r} is saved and differs from {embedding!r}; transformers 5 "
                                  f"keeps the saved head, earlier releases tie it to the embedding. Set "
                                  f"tie_word_embeddings to false to serve the saved head, or remove {head!r} "
                                  f"to tie it")


def check_dtype(dtype: str | None) -> str | None:
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"dtype must be one of {', '.join(DTYPES)} or None (as the checkpoint holds), "
                              f"got {dtype!r}")
    return dtype


def _kind_name(kinds: tuple[type, ...]) -> str:
    return " or ".join({"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
                        "list": "a list", "dict": "an object"}.get(k.__name__, k.__name__) for k in kinds)
