"""jitserve: write a numerical function once, compile it with the compiler that
suits the machine (XLA, IREE or a numpy interpreter), and serve it."""

from .compilers import Compiler, Device, Executable
from .compilers import register as register_compiler
from .defn import Compiled, MLIRModule, compile, defn, devices, jit, to_mlir
from .errors import (
    BatchError,
    BatchSizeError,
    CompileError,
    DefnError,
    EvaluationError,
    JitserveError,
    OptionError,
    OutputShapeError,
    QueueFullError,
    RequestTooLargeError,
    ServerExistsError,
    ServerStoppedError,
    TemplateMismatchError,
    UnknownCompilerError,
    UnknownServerError,
    WorkerCrashedError,
)
from .batch import Batch
from .graph import Graph, trace
from .interpreter import Interpreter, Node
from .defaults import default_options, options, set_default_options
from .serving import (BatchReport, Server, Serving, batched_run, batched_run_async, batched_stream,
                      batched_stream_async, serve)
from .template import Template, template
from . import cluster  # noqa: F401,E402 - plugs the cluster back ends (Ray) into the serving registry

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "BatchReport",
    "Server",
    "Serving",
    "batched_run",
    "batched_run_async",
    "batched_stream",
    "batched_stream_async",
    "serve",
    "BatchError",
    "BatchSizeError",
    "CompileError",
    "Compiled",
    "Compiler",
    "Device",
    "Executable",
    "DefnError",
    "EvaluationError",
    "Graph",
    "Interpreter",
    "Node",
    "JitserveError",
    "MLIRModule",
    "OptionError",
    "OutputShapeError",
    "QueueFullError",
    "RequestTooLargeError",
    "ServerExistsError",
    "ServerStoppedError",
    "Template",
    "TemplateMismatchError",
    "UnknownCompilerError",
    "UnknownServerError",
    "WorkerCrashedError",
    "compile",
    "default_options",
    "defn",
    "devices",
    "jit",
    "options",
    "register_compiler",
    "set_default_options",
    "template",
    "to_mlir",
    "trace",
]
