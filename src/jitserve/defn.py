"""Numerical definitions: ``defn``, ``jit``, ``compile``, ``to_mlir`` and ``devices``.

A definition is ordinary ``jax.numpy`` code. ``jit`` compiles it with the
compiler named in the options on first call per input signature and caches the
executable; ``compile`` does it ahead of time for templates and checks every
call against them. Operations that need a concrete value inside a definition
raise :class:`DefnError` instead of JAX's tracer errors.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from . import compilers
from . import defaults as _defaults
from .compilers.base import COMMON_OPTIONS, Device, Executable
from .compilers.xla import MLIRModule as MLIRModule  # public here; the lowering lives with the xla compiler
from .compilers.xla import to_mlir as to_mlir
from .errors import TRACER_ERRORS, defn_error, defn_errors
from .template import Template, abstract_tree

log = logging.getLogger("jitserve.defn")

LARGE_CONSTANTS_BYTES = 16 * 2**20  # captured arrays above this are worth a warning: see warn_large_constants
# id(owner) -> what gives that owner back (a weak reference where it takes one), so that an object that gets
# the id of a dead owner is not taken for it
_warned: dict[int, Callable[[], Any]] = {}


def captured_constant_bytes(fn: Callable[..., Any], args: Sequence[Any]) -> int:
    """How many bytes of arrays ``fn`` captures as constants (closed over, not passed) when traced for
    arguments shaped like ``args``: what XLA and IREE would compile into every executable."""
    closed = jax.make_jaxpr(fn)(*abstract_tree(tuple(args)))
    return sum(getattr(c, "nbytes", 0) for c in closed.consts)


def warn_large_constants(fn: Callable[..., Any], args: Sequence[Any], what: str, owner: Any = None) -> None:
    """Log one warning per ``owner`` (default ``fn``) when ``fn`` captures more than
    ``LARGE_CONSTANTS_BYTES`` of arrays as constants: each executable would embed its own copy (compile
    time and memory grow with them, once per batch size); weights belong in ``params``."""
    owner = fn if owner is None else owner
    seen = _warned.get(id(owner))
    if seen is not None and seen() is owner:
        return
    try:
        _warned[id(owner)] = weakref.ref(owner)
    except TypeError:  # not weakly referenceable (a builtin): kept alive, so that its id stays its own
        _warned[id(owner)] = functools.partial(lambda kept: kept, owner)
    size = captured_constant_bytes(fn, args)
    if size > LARGE_CONSTANTS_BYTES:
        log.warning("%s captures %.1f MB of arrays as constants, which every compiled executable embeds "
                    "(the limit for this warning is %d MB): pass them as params instead "
                    "(js.Serving(fn, params=tree) calls fn(params, batch); a definition takes them as an argument)",
                    what, size / 2**20, LARGE_CONSTANTS_BYTES // 2**20)


def _checking_constants(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, which on its first trace checks what it captures (:func:`warn_large_constants`)."""
    def traced(*args: Any) -> Any:
        warn_large_constants(fn, args, f"definition {getattr(fn, '__name__', fn)!r}")
        return fn(*args)

    return functools.update_wrapper(traced, fn)


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
                fn = _checking_constants(self.fn) if compiler.compiles else self.fn
                dispatch = self.dispatchers[scope] = compiler.dispatcher(fn, opts, self.count_compile)
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
        if chosen.compiles:
            warn_large_constants(fn, list(templates), f"definition {getattr(fn, '__name__', fn)!r}")
        return Compiled(chosen.compile(fn, list(templates), opts))


def devices() -> list[Device]:
    """Every device of every installed compiler."""
    return [device for name in compilers.installed() for device in compilers.get(name).devices()]
