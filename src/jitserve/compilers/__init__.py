"""The table of compilers by name, imported on first use.

Adding a compiler is one entry: its name and where its class lives, or, from
outside jitserve, :func:`register` (``jitserve.register_compiler``) with an
instance.
"""

from __future__ import annotations

import importlib
import threading

from ..errors import OptionError, UnknownCompilerError
from .base import Compiler, Device, Executable

COMPILERS: dict[str, str] = {
    "xla": "jitserve.compilers.xla:XlaCompiler",
    "evaluator": "jitserve.compilers.evaluator:EvaluatorCompiler",
    "iree": "jitserve.compilers.iree:IreeCompiler",
    "eager": "jitserve.compilers.eager:EagerCompiler",
}

_instances: dict[str, Compiler] = {}
_lock = threading.Lock()


def get(name: str) -> Compiler:
    """The compiler registered as ``name``; an unknown or uninstalled one is a clear error."""
    found = _instances.get(name)
    if found is not None:
        return found
    if name not in COMPILERS:
        raise UnknownCompilerError(
            f"unknown compiler {name!r}; expected one of: {', '.join(COMPILERS)}"
        )
    module_name, _, class_name = COMPILERS[name].partition(":")
    with _lock:
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise UnknownCompilerError(
                f"compiler {name!r} is not installed here ({error}); "
                f"install it with: pip install 'jitserve[{name}]'"
            ) from error
        return _instances.setdefault(name, getattr(module, class_name)())


def register(name: str, compiler: Compiler, *, replace: bool = False) -> None:
    """Make ``compiler`` (an instance of a :class:`Compiler` subclass whose ``name`` is ``name``) the entry
    ``name`` of the table; an existing entry is replaced only with ``replace=True``."""
    if not isinstance(compiler, Compiler):
        raise OptionError(f"register_compiler needs an instance of a jitserve.Compiler subclass, got {compiler!r}")
    if getattr(compiler, "name", None) != name:
        raise OptionError(f"the compiler's name is {getattr(compiler, 'name', None)!r}, but it is registered as "
                          f"{name!r}; set name = {name!r} on its class")
    with _lock:
        if name in COMPILERS and not replace:
            raise OptionError(f"a compiler named {name!r} is registered already; pass replace=True to replace it")
        COMPILERS[name] = f"{type(compiler).__module__}:{type(compiler).__qualname__}"
        _instances[name] = compiler


def installed() -> list[str]:
    """The names of the compilers that import on this machine."""
    names = []
    for name in COMPILERS:
        try:
            get(name)
        except UnknownCompilerError:
            continue
        names.append(name)
    return names


__all__ = ["COMPILERS", "Compiler", "Device", "Executable", "get", "installed", "register"]
