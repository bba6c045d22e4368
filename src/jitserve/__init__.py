"""jitserve: write a numerical function once, compile it with the compiler that
suits the machine (XLA, IREE or a numpy interpreter), and serve it."""

from .defn import Compiled, MLIRModule, compile, defn, devices, jit, to_mlir
from .errors import (
    BatchError,
    BatchSizeError,
    CompileError,
    DefnError,
    EvaluationError,
    JitserveError,
    OptionError,
    QueueFullError,
    ServerStoppedError,
    TemplateMismatchError,
    UnknownCompilerError,
    UnknownServerError,
)
from .graph import Graph, trace
from .interpreter import Interpreter, Node
from .defaults import default_options, options, set_default_options
from .template import Template, template

__version__ = "0.1.0"

__all__ = [
    "BatchError",
    "BatchSizeError",
    "CompileError",
    "Compiled",
    "DefnError",
    "EvaluationError",
    "Graph",
    "Interpreter",
    "Node",
    "JitserveError",
    "MLIRModule",
    "OptionError",
    "QueueFullError",
    "ServerStoppedError",
    "Template",
    "TemplateMismatchError",
    "UnknownCompilerError",
    "UnknownServerError",
    "compile",
    "default_options",
    "defn",
    "devices",
    "jit",
    "options",
    "set_default_options",
    "template",
    "to_mlir",
    "trace",
]
