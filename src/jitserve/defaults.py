"""Default compiler options, process-wide and scoped (``Nx.Defn.default_options``).

``set_default_options`` replaces the process-wide defaults; ``options(...)`` lays
options over them for the current thread or asyncio task only. The effective
options are interned :class:`Options` objects, so the per-call lookup on the
hot path is a context-variable read and a dictionary hit.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

DEFAULT_COMPILER = "xla"
CACHE_DIR_ENV = "JITSERVE_CACHE_DIR"
CHECKS_ENV = "JITSERVE_CHECKS"  # "1": the evaluator checks every result against JAX's shapes and dtypes


def _freeze(value: Any) -> Any:
    """A hashable stand-in for an option value (lists and dicts become tuples)."""
    if isinstance(value, Mapping):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


class Options(Mapping[str, Any]):
    """An immutable set of options. Build them with :func:`intern`; equal sets are one object."""

    __slots__ = ("_items",)

    def __init__(self, items: dict[str, Any]) -> None:
        self._items = items

    def __getitem__(self, name: str) -> Any:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Options({self._items!r})"

    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other

    def merge(self, overlay: Mapping[str, Any]) -> Options:
        return intern({**self._items, **overlay}) if overlay else self


_interned: dict[tuple[Any, ...], Options] = {}
_intern_lock = threading.Lock()


def intern(items: Mapping[str, Any]) -> Options:
    """The one :class:`Options` object holding exactly these items."""
    key = tuple(sorted((k, _freeze(v)) for k, v in items.items()))
    found = _interned.get(key)
    if found is None:
        with _intern_lock:
            found = _interned.setdefault(key, Options(dict(items)))
    return found


def _base_defaults() -> dict[str, Any]:
    """What every default option set starts from: the xla compiler, and the environment's cache directory."""
    items: dict[str, Any] = {"compiler": DEFAULT_COMPILER}
    if os.environ.get(CACHE_DIR_ENV):
        items["cache_dir"] = os.environ[CACHE_DIR_ENV]
    return items


EMPTY = intern({})
_defaults = intern(_base_defaults())
_scoped: contextvars.ContextVar[Options] = contextvars.ContextVar("jitserve_options", default=EMPTY)
_effective: dict[Options, Options] = {}  # scoped overlay -> defaults with it laid over
_dependents: weakref.WeakSet[Any] = weakref.WeakSet()  # caches keyed by scoped overlays
scoped = _scoped.get  # the scoped overlay here: a cache key that is one C call to read


def set_default_options(**options: Any) -> dict[str, Any]:
    """Replace the process-wide default options; returns the previous ones.

    ``compiler`` falls back to ``"xla"`` when not given. ``cache_dir`` turns on
    the persistent compile cache (also set by the ``JITSERVE_CACHE_DIR``
    environment variable, which stays the default when not given).
    """
    global _defaults
    previous = dict(_defaults)
    _defaults = intern({**_base_defaults(), **options})
    _effective.clear()
    for dependent in list(_dependents):
        dependent.clear_cache()
    return previous


def register_dependent(dependent: Any) -> None:
    """Call ``dependent.clear_cache()`` whenever :func:`set_default_options` changes the defaults.

    Held weakly. Caches keyed by :func:`scoped` overlays rely on this.
    """
    _dependents.add(dependent)


def default_options() -> dict[str, Any]:
    """The options in effect here: the defaults with any ``options(...)`` scopes laid over."""
    return dict(current())


@contextlib.contextmanager
def options(**overlay: Any) -> Iterator[dict[str, Any]]:
    """Lay options over the defaults for the current thread or task, for the ``with`` block."""
    token = _scoped.set(_scoped.get().merge(overlay))
    try:
        yield default_options()
    finally:
        _scoped.reset(token)


def current() -> Options:
    """The interned effective options (hot path: one context read, one dictionary hit)."""
    scoped = _scoped.get()
    found = _effective.get(scoped)
    if found is None:
        found = _effective[scoped] = _defaults.merge(scoped)
    return found


def keep_compiled(on: bool) -> None:
    """What ``jitserve serve`` does at start: keep its compiled programs (JAX's persistent cache, IREE's
    modules) across restarts, in ``$JITSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/jitserve`` or
    ``~/.cache/jitserve``; not ``on`` (``--no-compile-cache``): nowhere, that variable ignored too. Set in
    the environment as well, for the processes it starts (workers, fronts)."""
    if not on:
        os.environ.pop(CACHE_DIR_ENV, None)
    elif not os.environ.get(CACHE_DIR_ENV):
        os.environ[CACHE_DIR_ENV] = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jitserve")
    set_default_options()  # the defaults read the variable
