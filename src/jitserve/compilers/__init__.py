"""The table of compilers by name, imported on first use.

Adding a compiler is one entry: its name and where its class lives.
"""

from __future__ import annotations

import importlib
import threading

from ..errors import UnknownCompilerError
from .base import Compiler, Device, Executable

COMPILERS: dict[str, str] = {
    "xla": "jitserve.compilers.xla:XlaCompiler",
    "evaluator": "jitserve.compilers.evaluator:EvaluatorCompiler",
    "iree": "jitserve.compilers.iree:IreeCompiler",
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


__all__ = ["COMPILERS", "Compiler", "Device", "Executable", "get", "installed"]
