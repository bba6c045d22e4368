"""Every exception jitserve raises on purpose.

Each class also derives from the builtin that fits it (``TypeError``,
``ValueError``, ...) so that code written against the builtin keeps working.
Messages say what was wrong and what was expected; tests check their text.
"""

from __future__ import annotations


class JitserveError(Exception):
    """Base class of every jitserve error."""


class DefnError(JitserveError, TypeError):
    """An operation that needs a concrete value was used inside a numerical definition."""


class TemplateMismatchError(JitserveError, TypeError):
    """An argument does not match the template a function was compiled for."""


class UnknownCompilerError(JitserveError, ValueError):
    """No compiler is registered under the requested name."""


class OptionError(JitserveError, ValueError):
    """An option is unknown to the chosen compiler or has a bad value."""


class CompileError(JitserveError, RuntimeError):
    """A compiler rejected a module; the message carries its diagnostics."""


class BatchError(JitserveError, ValueError):
    """Entries cannot form a batch (empty, or incompatible shapes, dtypes or structure)."""


class BatchSizeError(JitserveError, ValueError):
    """A request is larger than the server batch size and the serving does not split."""


class RequestTooLargeError(BatchSizeError):
    """A request has more rows than a server's queue can ever hold (``max_queue``): not retryable."""


class QueueFullError(JitserveError, RuntimeError):
    """A server's queue holds ``max_queue`` rows already; the request was not queued."""


class ServerStoppedError(JitserveError, RuntimeError):
    """The server was stopped and takes no new requests."""


class UnknownServerError(JitserveError, LookupError):
    """No server is registered under the requested name."""


class EvaluationError(JitserveError, RuntimeError):
    """A compiled function failed while running: the evaluator names the node, IREE the function."""


class WorkerCrashedError(EvaluationError):
    """The worker process running a batch died (a native crash); only that batch failed."""


class ServerExistsError(JitserveError, ValueError):
    """A server is already registered under the requested name."""


class ProtocolError(JitserveError, ValueError):
    """A network request does not follow the Open Inference Protocol or does not fit the model."""


class BodyTooLargeError(ProtocolError):
    """A network request body is larger than the server's limit (HTTP 413)."""


class OutputShapeError(JitserveError, ValueError):
    """A serving function returned outputs that are not batch-major (axis 0 = the batch's rows)."""
