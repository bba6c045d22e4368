"""Every exception jitserve raises on purpose.

Each class also derives from the builtin that fits it (``TypeError``,
``ValueError``, ...) so that code written against the builtin keeps working.
Messages say what was wrong and what was expected; tests check their text.
:func:`defn_errors` turns JAX's tracer errors into :class:`DefnError` with
what was attempted and what to use instead.
"""

from __future__ import annotations

import contextlib
import os
import re
import traceback
from collections.abc import Iterator

import jax


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


class PromptTooLongError(BatchError):
    """A generation prompt is longer than the longest compiled prefill length (or ``max_length``)."""


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


class ParameterError(ProtocolError):
    """One field of a network request is missing, wrong, unknown or not supported (HTTP 400): ``param`` names
    it and ``code`` says which of these it is, as OpenAI's errors do (``invalid_value``,
    ``unknown_parameter``, ``unsupported_parameter``, ``missing_parameter``...)."""

    def __init__(self, message: str, param: str | None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class BodyTooLargeError(ProtocolError):
    """A network request body is larger than the server's limit (HTTP 413)."""


class RepositoryError(JitserveError, RuntimeError):
    """A model repository cannot load, reload or unload a model: its ``model.py`` is missing, fails to run or
    defines no ``serving``, or the repository's control mode does not take the request."""


class OutputShapeError(JitserveError, ValueError):
    """A serving function returned outputs that are not batch-major (axis 0 = the batch's rows)."""


class CheckpointError(JitserveError, ValueError):
    """A weights file cannot be read: not a .safetensors or .npz file, damaged, or of a dtype numpy lacks."""


# the HTTP statuses a model may answer with on purpose, and their gRPC status names (google.rpc's mapping)
MODEL_STATUSES: dict[int, str] = {
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND", 409: "ABORTED",
    412: "FAILED_PRECONDITION", 413: "RESOURCE_EXHAUSTED", 416: "OUT_OF_RANGE", 422: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 501: "UNIMPLEMENTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
}


class ModelError(JitserveError):
    """What a model (its function, ``preprocess`` or ``postprocess``) raises to answer a network client on
    purpose: the client gets ``message`` with ``status`` (HTTP; gRPC gets the matching code), as Triton's
    ``TritonError`` or KServe's ``InferenceError``. Any other exception a model raises, whatever its class,
    is a 500 / INTERNAL whose details stay in the server log."""

    def __init__(self, message: str, status: int = 400) -> None:
        if status not in MODEL_STATUSES:
            raise OptionError(f"ModelError status must be one of {', '.join(map(str, MODEL_STATUSES))}; "
                              f"got {status!r}")
        super().__init__(message)
        self.status = status


class FrontProcessError(JitserveError, RuntimeError):
    """An HTTP front process of ``jitserve serve --http-workers N`` exited before it listened (the lines it
    logged say why)."""


class RelayedError(JitserveError):
    """The engine process's answer to a request an HTTP front process handed it (``jitserve serve
    --http-workers N``) when that request failed there: the message, HTTP status and gRPC status name the
    engine's service gave it, the model version it is counted under and its rows (for the access log)."""

    def __init__(self, message: str, status: int, grpc_status: str, version: str | None, rows: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.grpc_status = grpc_status
        self.version = version
        self.rows = rows


_RAISED_BY_MODEL = "_jitserve_raised_by_model"


def raised_by_model(error: BaseException) -> BaseException:
    """Mark ``error`` as raised by the user's model code (not by jitserve about the request): the network
    answers it by where it arose, 500 / INTERNAL, not by its class. Returns it."""
    setattr(error, _RAISED_BY_MODEL, True)
    return error


def is_raised_by_model(error: BaseException) -> bool:
    return getattr(error, _RAISED_BY_MODEL, False)


TRACER_ERRORS = (
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
    except TRACER_ERRORS as error:
        raise defn_error(error) from None
