"""jitserve: write a numerical function once, compile it with the compiler that
suits the machine (XLA, IREE or a numpy interpreter), and serve it."""

from typing import Any

from . import cluster  # noqa: F401 - plugs the cluster back ends (Ray) into the serving registry
from .batch import Batch
from .compilers import Compiler, Device, Executable
from .compilers import register as register_compiler
from .compilers.evaluator.interpreter import Interpreter, Node
from .defaults import default_options, options, set_default_options
from .defn import Compiled, MLIRModule, compile, defn, devices, jit, to_mlir
from .errors import (
    BatchError,
    BatchSizeError,
    CheckpointError,
    CompileError,
    DefnError,
    EvaluationError,
    JitserveError,
    ModelError,
    OptionError,
    OutputShapeError,
    PromptTooLongError,
    QueueFullError,
    RepositoryError,
    RequestTooLargeError,
    ServerExistsError,
    ServerStoppedError,
    TemplateMismatchError,
    UnknownCompilerError,
    UnknownServerError,
    WorkerCrashedError,
)
from .graph import Graph, trace
from .models import from_pretrained
from .params import load_params
from .serving import (
    BatchReport,
    Generation,
    PagedCache,
    Sampling,
    Server,
    Serving,
    TokenLogprobs,
    batched_run,
    batched_run_async,
    batched_stream,
    batched_stream_async,
    generate,
    generate_async,
    generate_stream,
    generate_stream_async,
    serve,
)
from .template import Template, template
from .version import __version__ as __version__

__all__ = [
    "Batch",
    "BatchError",
    "BatchReport",
    "BatchSizeError",
    "CheckpointError",
    "CompileError",
    "Compiled",
    "Compiler",
    "DefnError",
    "Device",
    "EvaluationError",
    "Executable",
    "Generation",
    "Graph",
    "Interpreter",
    "JitserveError",
    "MLIRModule",
    "ModelError",
    "Node",
    "OptionError",
    "OutputShapeError",
    "PagedCache",
    "PromptTooLongError",
    "QueueFullError",
    "RepositoryError",
    "RequestTooLargeError",
    "Sampling",
    "Server",
    "ServerExistsError",
    "ServerStoppedError",
    "Serving",
    "Template",
    "TemplateMismatchError",
    "TokenLogprobs",
    "UnknownCompilerError",
    "UnknownServerError",
    "WorkerCrashedError",
    "batched_run",
    "batched_run_async",
    "batched_stream",
    "batched_stream_async",
    "compile",
    "default_options",
    "defn",
    "devices",
    "from_pretrained",
    "generate",
    "generate_async",
    "generate_stream",
    "generate_stream_async",
    "jit",
    "load_params",
    "options",
    "register_compiler",
    "serve",
    "set_default_options",
    "template",
    "to_mlir",
    "trace",
]


def __getattr__(name: str) -> Any:
    """``from jitserve import iree``: IREE from Python (``jitserve.compilers.iree.runtime``), imported on first
    use, since it needs the ``iree`` extra."""
    if name == "iree":
        from .compilers.iree import runtime

        return runtime
    raise AttributeError(f"module 'jitserve' has no attribute {name!r}")
