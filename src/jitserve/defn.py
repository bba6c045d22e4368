"""Numerical definitions: ``defn``, ``jit``, ``compile``, ``to_mlir`` and ``devices``.

A definition is ordinary ``jax.numpy`` code. ``jit`` compiles it with the
compiler named in the options on first call per input signature and caches the
executable; ``compile`` does it ahead of time for templates and checks every
call against them. Operations that need a concrete value inside a definition
raise :class:`DefnError` instead of JAX's tracer errors.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import compilers
from . import defaults as _defaults
from .compilers.base import COMMON_OPTIONS, Device, Executable
from .compilers.xla import MLIRModule as MLIRModule  # public here; the lowering lives with the xla compiler
from .compilers.xla import to_mlir as to_mlir
from .errors import TRACER_ERRORS, defn_error, defn_errors
from .template import Template


def resolve_options(explicit: Mapping[str, Any]) -> tuple[compilers.Compiler, dict[str, Any]]:
    """The compiler and its options: current defaults, then ``explicit`` on top.

    Explicit options must be known to the compiler; defaults meant for other
    compilers are left out.
    """
    merged = _defaults.current().merge(explicit)
    compiler = compilers.get(merged["compiler"])
    compiler.check_options(explicit)
    accepted = compiler.options | COMMON_OPTIONS
    return compiler, {k: v for k, v in merged.items() if k in accepted}


def _explicit(compiler: str | None, device: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    given = dict(options)
    if compiler is not None:
        given["compiler"] = compiler
    if device is not None:
        given["device"] = device
    return given


class _JitState:
    """What one jitted function keeps: a dispatcher per effective option set, and a compile count."""

    __slots__ = ("fn", "explicit", "dispatchers", "lock", "wrapper", "__weakref__")

    def __init__(self, fn: Callable[..., Any], explicit: dict[str, Any]) -> None:
        self.fn = fn
        self.explicit = explicit
        # keyed by the scoped options overlay; emptied when the process-wide defaults change
        self.dispatchers: dict[_defaults.Options, Callable[..., Any]] = {}
        self.lock = threading.Lock()
        self.wrapper: Any = None
        _defaults.register_dependent(self)

    def clear_cache(self) -> None:
        with self.lock:
            self.dispatchers.clear()

    def new_dispatcher(self) -> Callable[..., Any]:
        scope = _defaults.scoped()
        compiler, opts = resolve_options(self.explicit)
        with self.lock:
            dispatch = self.dispatchers.get(scope)
            if dispatch is None:
                dispatch = self.dispatchers[scope] = compiler.dispatcher(self.fn, opts, self.count_compile)
        return dispatch

    def count_compile(self) -> None:
        with self.lock:
            self.wrapper.compiles += 1


def jit(fn: Callable[..., Any], compiler: str | None = None, device: Any = None, **options: Any) -> Any:
    """Compile ``fn`` on first call per input signature with ``compiler`` (default from the options).

    Arguments are positional (as in ``Nx.Defn``); bind configuration with a
    closure or ``functools.partial``. The result is a plain function (the
    cheapest thing for Python to call) with a ``compiles`` attribute: how many times it was traced and compiled, one per
    new input signature and option set.
    """
    explicit = _explicit(compiler, device, options)
    if explicit:
        resolve_options(explicit)
    state = _JitState(fn, explicit)
    dispatchers = state.dispatchers
    scoped = _defaults.scoped

    def jitted(*args: Any) -> Any:
        dispatch = dispatchers.get(scoped())
        if dispatch is None:
            dispatch = state.new_dispatcher()
        try:
            return dispatch(*args)
        except TRACER_ERRORS as error:
            raise defn_error(error) from None

    functools.update_wrapper(jitted, fn)
    jitted.compiles = 0  # type: ignore[attr-defined]
    state.wrapper = jitted
    return jitted


def defn(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Decorator: ``@defn`` or ``@defn(compiler=..., ...)`` makes a numerical definition."""
    if fn is None:
        return lambda inner: jit(inner, **options)
    return jit(fn, **options)


class Compiled:
    """A definition compiled ahead of time for fixed templates; each call is checked against them."""

    __slots__ = ("executable",)

    def __init__(self, executable: Executable) -> None:
        self.executable = executable

    def __call__(self, *args: Any) -> Any:
        return self.executable.checked_call(*args)

    @property
    def input_templates(self) -> list[Template]:
        return self.executable.input_templates

    @property
    def output_container(self) -> Any:
        return self.executable.output_container


def compile(fn: Callable[..., Any], templates: Sequence[Any], compiler: str | None = None,
            device: Any = None, **options: Any) -> Compiled:
    """Compile ``fn`` now for positional arguments shaped like ``templates``."""
    chosen, opts = resolve_options(_explicit(compiler, device, options))
    with defn_errors():
        return Compiled(chosen.compile(fn, list(templates), opts))


def devices() -> list[Device]:
    """Every device of every installed compiler."""
    return [device for name in compilers.installed() for device in compilers.get(name).devices()]
