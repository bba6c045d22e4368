"""Numerical definitions: ``defn``, ``jit``, ``compile``, ``to_mlir`` and ``devices``.

A definition is ordinary ``jax.numpy`` code. ``jit`` compiles it with the
compiler named in the options on first call per input signature and caches the
executable; ``compile`` does it ahead of time for templates and checks every
call against them. Operations that need a concrete value inside a definition
raise :class:`DefnError` instead of JAX's tracer errors.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from . import compilers
from . import defaults as _defaults
from .compilers.base import COMMON_OPTIONS, Device, Executable
from .errors import CompileError, DefnError
from .template import Template, templates_of

_TRACER_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)

_CONTROL_FLOW = "jnp.where or jax.lax.cond (jax.lax.while_loop for loops)"
_INSPECT = "jax.debug.print to look at a value while it runs"

# (pattern in JAX's message, what was attempted, what to use instead); first match wins.
_ATTEMPTS: tuple[tuple[str, str, str], ...] = (
    (r"`float` function", "float() on a traced value", f"x.astype(jnp.float32), or {_INSPECT}"),
    (r"`int` function", "int() on a traced value", f"x.astype(jnp.int32), or {_INSPECT}"),
    (r"`complex` function", "complex() on a traced value", f"x.astype(jnp.complex64), or {_INSPECT}"),
    (r"item\(\) method", ".item() on a traced value", f"keep the value as an array, or {_INSPECT}"),
    (r"tolist\(\) method", ".tolist() on a traced value", f"keep the value as an array, or {_INSPECT}"),
    (r"boolean conversion", "bool() or a Python if/while/and/or on a traced value", _CONTROL_FLOW),
    (r"__array__\(\)", "np.asarray()/np.array() on a traced value", f"jax.numpy functions, or {_INSPECT}"),
    (r"__index__|integer conversion", "using a traced value as a Python index or int",
     "jax.lax.dynamic_slice or jnp.take"),
    (r"", "using a traced value where a concrete Python value is needed",
     f"{_CONTROL_FLOW}, or {_INSPECT}"),
)

_INTERNAL_PATHS = (os.path.dirname(jax.__file__), os.path.dirname(__file__))


def _user_location(error: BaseException) -> str:
    """``file:line`` of the innermost frame of user code in the traceback, or ''."""
    location = ""
    for frame, line in traceback.walk_tb(error.__traceback__):
        filename = frame.f_code.co_filename
        if not filename.startswith(_INTERNAL_PATHS):
            location = f" (at {filename}:{line})"
    return location


def defn_error(error: BaseException) -> DefnError:
    """The :class:`DefnError` that explains one of JAX's tracer errors."""
    message = str(error)
    for pattern, attempted, instead in _ATTEMPTS:
        if re.search(pattern, message):
            return DefnError(
                f"{attempted} is not allowed inside a numerical definition: the value is only known "
                f"when the compiled function runs{_user_location(error)}. Use {instead} instead."
            )
    raise AssertionError("the last pattern matches every message")


@contextlib.contextmanager
def defn_errors() -> Iterator[None]:
    """Turn JAX's tracer errors raised in the block into :class:`DefnError`."""
    try:
        yield
    except _TRACER_ERRORS as error:
        raise defn_error(error) from None


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
        except _TRACER_ERRORS as error:
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


@dataclass(frozen=True)
class MLIRModule:
    """``fn`` lowered to StableHLO (``EXLA.to_mlir_module``).

    ``used_inputs`` are the indices, over the flattened inputs, of those that
    the module's ``@main`` takes: unused inputs are dropped from its signature.
    """

    mlir_module: str
    output_container: Any
    used_inputs: tuple[int, ...]
    input_templates: tuple[Template, ...]


def _kept_inputs(lowered: Any) -> tuple[int, ...]:
    """The flat inputs ``@main`` keeps after JAX drops unused ones.

    JAX has no public API for this: ``Lowered.args_info`` and ``in_avals`` list every input, and
    ``jit(keep_unused=True)`` would keep them all (IREE would then be sent unused inputs on every call).
    So this reads the lowering's compile arguments; ``tests/test_defn.py`` checks the result against the
    signature of ``@main`` in the module text, and fails loudly if JAX moves or changes them.
    """
    try:
        return tuple(sorted(lowered._lowering.compile_args["kept_var_idx"]))
    except (AttributeError, KeyError, TypeError) as error:
        raise CompileError(f"this JAX ({jax.__version__}) no longer says which inputs a lowered module keeps "
                           f"(Lowered._lowering.compile_args['kept_var_idx']); jitserve.to_mlir needs updating "
                           f"for it") from error


def to_mlir(fn: Callable[..., Any], args: Sequence[Any]) -> MLIRModule:
    """Lower ``fn`` for these arguments or templates to a StableHLO module with ``@main``."""
    from .compilers.xla import lower

    templates = templates_of(tuple(args))
    with defn_errors():
        lowered = lower(fn, templates)
    return MLIRModule(
        mlir_module=lowered.as_text(),
        output_container=templates_of(lowered.out_info),
        used_inputs=_kept_inputs(lowered),
        input_templates=tuple(jax.tree_util.tree_leaves(templates)),
    )


def devices() -> list[Device]:
    """Every device of every installed compiler."""
    return [device for name in compilers.installed() for device in compilers.get(name).devices()]
