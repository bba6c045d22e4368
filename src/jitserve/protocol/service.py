"""What the HTTP and gRPC fronts share: the models, inference, and errors as statuses.

Every network request is what its model's spec (``protocol/model.py``) makes
of it, the engine's typed request, given to the model's front's entry points
(``call_async``, ``stream_async``: a serving's ``preprocess`` and
``postprocess`` run as for an in-process caller), so HTTP and gRPC callers
share batches with each other and with in-process callers.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import (
    MODEL_STATUSES,
    BatchError,
    BatchSizeError,
    BodyTooLargeError,
    CheckpointError,
    ModelError,
    OptionError,
    ProtocolError,
    QueueFullError,
    RepositoryError,
    ServerStoppedError,
    TemplateMismatchError,
    UnknownServerError,
    is_raised_by_model,
)
from ..serving.front import Front
from ..serving.stats import Phases
from ..version import __version__
from .access import REQUEST_ID, REQUEST_ROWS, log_access, request_id
from .codec import shown
from .logs import ClientMistakes
from .metrics import Metrics
from .model import SPECS, Spec, select_outputs
from .parameters import refuse_unsupported
from .shared_memory import SystemSharedMemory

if TYPE_CHECKING:  # OpenTelemetry is imported only where tracing is configured
    from .tracing import RequestSpan, Tracing

log = logging.getLogger("jitserve.serve")

EXTENSIONS = ["binary_tensor_data", "classification", "model_repository", "statistics"]

# exception class -> (HTTP status, gRPC status name); the first match in order wins
STATUSES: tuple[tuple[type[BaseException], int, str], ...] = (
    (UnknownServerError, 404, "NOT_FOUND"),
    (BodyTooLargeError, 413, "RESOURCE_EXHAUSTED"),
    (ProtocolError, 400, "INVALID_ARGUMENT"),
    (BatchError, 400, "INVALID_ARGUMENT"),
    (BatchSizeError, 400, "INVALID_ARGUMENT"),
    (TemplateMismatchError, 400, "INVALID_ARGUMENT"),
    (CheckpointError, 400, "INVALID_ARGUMENT"),
    (RepositoryError, 400, "INVALID_ARGUMENT"),
    (OptionError, 400, "INVALID_ARGUMENT"),  # a request's option (a generation's logit_bias past its vocabulary)
    (QueueFullError, 503, "UNAVAILABLE"),
    (ServerStoppedError, 503, "UNAVAILABLE"),
    (TimeoutError, 504, "DEADLINE_EXCEEDED"),
)


MAX_CONTROLS = 16  # loads and unloads running at once; one more is 503 (a thread each: bounded)
OFF_LOOP_CLASSES = 10_000  # class results formatted off the event loop from this many (each a Python string)

def status_of(error: BaseException) -> tuple[int, str]:
    """The HTTP and gRPC status for an error, by where it arose: a model's :class:`ModelError` carries its
    own; anything else a model raised, and anything unexpected, is 500 / INTERNAL; jitserve's own errors
    about the request go by class."""
    if isinstance(error, ModelError):
        return error.status, MODEL_STATUSES[error.status]
    if is_raised_by_model(error):
        return 500, "INTERNAL"
    for kind, http, grpc in STATUSES:
        if isinstance(error, kind):
            return http, grpc
    return 500, "INTERNAL"


def split_version(key: str) -> tuple[str, str]:
    """A served key's model name and version: ``"name/2"`` is version 2 of ``name``; a bare name is version 1."""
    name, _, version = key.partition("/")
    return name, version or "1"


@dataclass
class Tally:
    """One model version's request outcomes, as Triton's statistics report them, and the histogram of their
    durations in ``/metrics``."""

    duration: Any  # jitserve_request_seconds for this model version
    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    fail_ns: int = 0
    last_inference_ms: int = 0

    def add(self, started_ns: int, ok: bool) -> None:
        elapsed = time.perf_counter_ns() - started_ns
        self.duration.observe(elapsed / 1e9)
        if ok:
            self.success_count += 1
            self.success_ns += elapsed
        else:
            self.fail_count += 1
            self.fail_ns += elapsed
        self.last_inference_ms = int(time.time() * 1000)


class ModelControl(Protocol):
    """What loads and unloads models by name (Triton's repository extension): a model repository
    (``protocol/repository.py``), or :class:`FixedModels` when the models are fixed at start. Its methods
    block; the fronts call them on a thread."""

    def index(self, ready_only: bool) -> list[dict[str, str]]:
        """Every model it knows, each version with its ``state`` and the ``reason`` for it."""

    def load(self, name: str, parameters: Mapping[str, Any] | None) -> None:
        """Load ``name``, or reload it when it is loaded; returns once it answers."""

    def unload(self, name: str, parameters: Mapping[str, Any] | None) -> None:
        """Stop serving ``name``: new requests are refused, those it holds finish, then it is freed."""


class NoSpan:
    """The span of a request that is not traced: every mark is nothing, so that a door marks a request's
    phases the same whether tracing is on or not (:class:`~.tracing.RequestSpan` is the traced one)."""

    __slots__ = ()

    def output(self) -> None:
        pass

    def phase(self, name: str | None) -> None:
        pass

    def end(self, error: BaseException | None = None, status: int | str | None = None) -> None:
        pass


NO_SPAN = NoSpan()


class InferenceService:
    """The served models by name and version, and inference on them.

    ``servers`` is keyed by model name, or ``name/version`` for a model served in several versions; a
    request that names no version gets the highest one (Triton's default version policy). A model
    repository changes the models while they serve (:meth:`put`, :meth:`remove`); ``control`` is what
    loads and unloads them. ``shared_memory`` holds the system shared memory regions clients register
    (protocol/shared_memory.py: off unless ``allow_client_shm``)."""

    def __init__(self, servers: Mapping[str, Front], request_timeout: float | None = None,
                 access_log: bool = False, tracing: Tracing | None = None, allow_client_shm: bool = False) -> None:
        self.versions: dict[str, dict[str, Spec]] = {}
        self.access_log = access_log  # one line per inference request (protocol/access.py)
        self.tracing = tracing  # OpenTelemetry spans of requests and batches (protocol/tracing.py), if configured
        self.models: dict[str, Spec] = {}
        self.request_timeout = request_timeout
        self.shared_memory = SystemSharedMemory(allow_client_shm)
        self.metrics = Metrics()
        self.tallies: dict[tuple[str, str], Tally] = {}
        self.draining = False  # set on SIGTERM: not ready, while what was accepted finishes
        self.opening = False  # set while HTTP front processes start: not ready until every one listens
        self.mistakes = ClientMistakes(log)  # clients' mistakes, logged without flooding the log
        self._counters: dict[tuple[str, str, str, str], Any] = {}  # requests_total children by labels
        for key, server in servers.items():
            self.put(key, server)
        self.control: ModelControl = FixedModels(self)
        self.controls_in_flight = 0  # loads and unloads running (load_or_unload), at most MAX_CONTROLS

    def span(self, protocol: str, model: str, carrier: Callable[[], Iterable[tuple[Any, Any]]],
             call: str = "infer") -> RequestSpan | NoSpan:
        """A request's span (``carrier()``: its headers or metadata, read only when tracing): the tracer's,
        else :data:`NO_SPAN`."""
        return NO_SPAN if self.tracing is None else self.tracing.request(protocol, model, carrier(), call)

    def put(self, key: str, server: Front) -> Front | None:
        """Serve ``server`` as ``key`` (``name`` or ``name/version``) from now on; returns the server it
        replaces, if any, which the caller stops (drained: what it holds finishes there). Requests that
        took the old one but had not queued yet are sent to the new one (see :meth:`_current`)."""
        name, version = split_version(key)
        spec = SPECS[server.asks](name, server, version)
        old = self.versions.get(name, {}).get(version)
        self.metrics.add(name, version, server)
        if self.tracing is not None:
            server.listen(self.tracing)
        self.tallies.setdefault((name, version), Tally(self.metrics.request_seconds.labels(name, version)))
        specs = dict(sorted({**self.versions.get(name, {}), version: spec}.items(),
                            key=lambda item: _version_order(item[0])))
        self.versions[name] = specs  # each a single assignment: readers on other threads see old or new
        self.models[name] = list(specs.values())[-1]
        return None if old is None else old.server

    def remove(self, name: str) -> list[Front]:
        """Stop sending requests to every version of ``name``; returns their servers, for the caller to stop."""
        specs = self.versions.pop(name, {})
        self.models.pop(name, None)
        for version in specs:
            self.metrics.remove(name, version)
        return [spec.server for spec in specs.values()]

    def servers(self) -> dict[str, Front]:
        """The servers serving now, by the keys they would be given with: ``name/version``, or ``name`` alone
        for a model served only as version 1."""
        return {name if list(specs) == ["1"] else f"{name}/{version}": spec.server
                for name, specs in self.versions.items() for version, spec in specs.items()}

    def model(self, name: str, version: str | None = None) -> Spec:
        """The model ``name`` at ``version`` (None or empty: the highest); unknown ones are 404 / NOT_FOUND
        (the name cut to ``SHOWN_CHARACTERS``: a client's 20 KB name must not outgrow a gRPC status)."""
        specs = self.versions.get(name)
        if specs is None:
            raise UnknownServerError(f"unknown model '{shown(name)}'; this server has: "
                                     f"{', '.join(self.models) or 'none'}")
        if not version:
            return self.models[name]
        spec = specs.get(version)
        if spec is None:
            raise UnknownServerError(f"model '{name}' has no version '{shown(version)}'; it has: {', '.join(specs)}")
        return spec

    def model_metadata(self, name: str, version: str | None = None) -> dict[str, Any]:
        return {**self.model(name, version).metadata(), "versions": list(self.versions[name])}

    async def load_or_unload(self, action: str, name: str, parameters: Mapping[str, Any] | None) -> None:
        """``control.load`` or ``control.unload`` of ``name``, awaited, on a daemon thread of its own: a load
        runs a model's code for as long as it takes, so loads never hold the event loop's shared thread pool
        (request bodies are decoded there) and a slow one never keeps the process from exiting. At most
        ``MAX_CONTROLS`` run at once: one more is refused (503), as a thread each is what they cost."""
        if self.controls_in_flight >= MAX_CONTROLS:
            raise QueueFullError(f"{MAX_CONTROLS} model loads and unloads are running; try '{name}' again once "
                                 f"one ends")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        act = self.control.load if action == "load" else self.control.unload

        def settle(error: BaseException | None) -> None:
            self.controls_in_flight -= 1
            if done.done():
                return
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

        def run() -> None:
            try:
                act(name, parameters)
            except Exception as error:  # noqa: BLE001 - handed to the awaiting front, which answers with it
                outcome: BaseException | None = error
            else:
                outcome = None
            try:
                loop.call_soon_threadsafe(settle, outcome)
            except RuntimeError:  # the loop closed meanwhile: the server is gone, nobody awaits it
                pass

        self.controls_in_flight += 1  # on the event loop, as settle's decrement: no lock needed
        threading.Thread(target=run, name=f"jitserve-{action}", daemon=True).start()
        await done

    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """Every model version and its state (Triton's repository index); with ``ready_only``, the ready
        ones only."""
        return [entry for entry in self.control.index(ready_only) if not ready_only or entry["state"] == "READY"]

    def served_index(self) -> list[dict[str, str]]:
        """The models serving now, READY, or UNAVAILABLE while the server starts its fronts or drains."""
        state = "READY" if self.ready() else "UNAVAILABLE"
        reason = "" if state == "READY" else self.unready_reason
        return [{"name": name, "version": version, "state": state, "reason": reason}
                for name, specs in self.versions.items() for version in specs]

    def statistics(self, name: str | None = None, version: str | None = None) -> dict[str, Any]:
        """Triton's model statistics for one model (every version unless one is named) or for all models."""
        if name:
            self.model(name, version)
        chosen = [spec for model, specs in self.versions.items() if not name or model == name
                  for spec in specs.values() if not version or spec.version == version]
        return {"model_stats": [self._statistics(spec) for spec in chosen]}

    def _statistics(self, spec: Spec) -> dict[str, Any]:
        """One model version's statistics, counted as Triton counts them: ``success`` and ``fail`` per
        request over the network, from its arrival to its answer; ``queue`` and the three compute phases per
        request that completed in the engine (its wait for its first batch or prefill, and its share of the
        executions that ran it, see :class:`~jitserve.serving.stats.FrontStats`), ``inference_count`` its
        rows (a prompt is one); per execution (a batch, or a generation's launch of decode steps) by the
        batch size it ran at, ``execution_count`` their number. No response cache: no cache hit or miss."""
        tally = self.tallies[(spec.name, spec.version)]
        stats = spec.server.stats()
        completed, phases = stats.completed, stats.completed_phases
        executions = stats.executions()
        return {
            "name": spec.name, "version": spec.version, "last_inference": tally.last_inference_ms,
            "inference_count": stats.inferences, "execution_count": sum(count for count, _ in executions.values()),
            "inference_stats": {
                "success": _duration(tally.success_count, tally.success_ns),
                "fail": _duration(tally.fail_count, tally.fail_ns),
                "queue": _duration(completed, stats.completed_queue_s * 1e9),
                **_phases(completed, phases),
                "cache_hit": _duration(0, 0), "cache_miss": _duration(0, 0),
            },
            "batch_stats": [{"batch_size": size, **_phases(count, size_phases)}
                            for size, (count, size_phases) in sorted(executions.items())],
        }

    def server_metadata(self) -> dict[str, Any]:
        shared_memory = ["system_shared_memory"] if self.shared_memory.allowed else []
        return {"name": "jitserve", "version": __version__, "extensions": sorted(EXTENSIONS + shared_memory)}

    @property
    def unready_reason(self) -> str:
        """Why the server says it is not ready: it is starting its fronts, or it drains."""
        return "starting" if self.opening else "draining"

    def ready(self) -> bool:
        return not self.draining and not self.opening and all(not spec.server.stopping for spec in self.models.values())

    async def infer(self, model: str, tensors: Mapping[str, np.ndarray], requested: Mapping[str, int] | None,
                    priority: int | None = None, version: str | None = None,
                    parameters: Mapping[str, Any] | None = None) -> tuple[str, list[tuple[str, np.ndarray]]]:
        """Run one request's tensors on ``model`` (at ``version``) at ``priority`` (the request's ``priority``
        parameter, as tritonclient sends it); the version that ran it and the named outputs it asked for.
        A generation answers with all its outputs at once, stacked (``parameters``: see
        :class:`GenerationSpec`)."""
        spec = self.model(model, version)
        refuse_unsupported(parameters or (), "the request")
        if self.access_log:
            REQUEST_ROWS.set(spec.rows(tensors))
        parameters = parameters or {}
        ask: Any = spec.ask(tensors, parameters, priority, self.request_timeout, False)  # what its spec reads
        with self.tallied(spec):
            try:
                named = await spec.call(ask)
            except ServerStoppedError:
                spec = self._current(spec)  # reloaded or unloaded meanwhile
                ask = spec.ask(tensors, parameters, priority, self.request_timeout, False)
                named = await spec.call(ask)
        classes = sum(requested.values()) if requested else 0
        if classes and classes * spec.rows(tensors) > OFF_LOOP_CLASSES:  # classes of many rows
            return spec.version, await asyncio.to_thread(select_outputs, named, requested, model, spec.labels)
        return spec.version, select_outputs(named, requested, model, spec.labels)

    async def infer_stream(self, model: str, tensors: Mapping[str, np.ndarray], requested: Mapping[str, int] | None,
                     priority: int | None = None, version: str | None = None,
                     parameters: Mapping[str, Any] | None = None
                     ) -> tuple[str, AsyncIterator[list[tuple[str, np.ndarray]]]]:
        """``infer`` whose outputs come as they are ready: one item per batch that ran some of the rows (in
        row order), per step of a streaming serving, or per output of a generation. The request is checked
        and queued once awaited (its errors raise here, before anything is sent); a consumer that stops early frees
        its queued rows (a generation's slot). Returns the version that runs
        it with the outputs to come."""
        spec = self.model(model, version)
        refuse_unsupported(parameters or (), "the request")
        if self.access_log:
            REQUEST_ROWS.set(spec.rows(tensors))
        parameters = parameters or {}
        ask: Any = spec.ask(tensors, parameters, priority, self.request_timeout, True)  # what its spec reads
        try:
            items = await spec.stream(ask)
        except ServerStoppedError:
            spec = self._current(spec)  # reloaded or unloaded meanwhile
            ask = spec.ask(tensors, parameters, priority, self.request_timeout, True)
            items = await spec.stream(ask)
        return spec.version, self._stream(spec, items, requested)

    async def _stream(self, spec: Spec, items: AsyncIterator[list[tuple[str, np.ndarray]]],
                      requested: Mapping[str, int] | None) -> AsyncIterator[list[tuple[str, np.ndarray]]]:
        """The stream's outputs; tallied in the statistics once it ends or fails (not when the client leaves)."""
        with self.tallied(spec):
            async for outputs in items:
                yield select_outputs(outputs, requested, spec.name, spec.labels)

    def _current(self, spec: Spec) -> Spec:
        """After ``spec``'s server refused a request as stopped: the model that replaced it (a reload), else
        the error again (the server is shutting down, or the model was unloaded: unknown now)."""
        current = self.versions.get(spec.name, {}).get(spec.version)
        if current is spec or self.draining:
            raise ServerStoppedError(f"server {spec.name!r} is stopped and takes no new requests")
        return self.model(spec.name, spec.version)

    def tallied(self, spec: Spec) -> _Tallied:
        """Count what a ``with`` block runs in the model's statistics (see :class:`_Tallied`)."""
        return _Tallied(self.tallies[(spec.name, spec.version)])

    def count(self, model: str, protocol: str, status: int | str, version: str | None = None) -> None:
        """Count one answered request in ``jitserve_requests_total`` and the access log."""
        counted = self.counted(model, protocol, status, version)
        if self.access_log:
            log_access(loggable(model), counted, protocol, status)

    def counted(self, model: str, protocol: str, status: int | str, version: str | None = None,
                times: int = 1) -> str:
        """Count one answered request (or ``times`` alike) in ``jitserve_requests_total``; returns the version
        it is counted under (a model this server does not have is counted as model "" and version "", so that
        clients cannot grow the label set)."""
        spec = self.models.get(model)
        if spec is None:
            model = version = ""
        elif not version:
            version = spec.version  # a request that named no version went to this one
        elif version not in self.versions[model]:
            version = ""  # nor versions a client makes up
        key = (model, version, protocol, str(status))
        counter = self._counters.get(key)
        if counter is None:  # labels() builds a key and looks it up: once per key
            counter = self._counters[key] = self.metrics.requests.labels(*key)
        counter.inc(times)
        return version

    def failed(self, protocol: str, model: str, error: BaseException,
               version: str | None = None) -> tuple[int, str, str]:
        """Count and log a failed request (see :meth:`refusal`); returns its HTTP status, gRPC status name and
        the message for the client."""
        http_status, grpc_status, message = self.refusal(protocol, model, error)
        self.count(model, protocol, http_status if protocol == "http" else grpc_status, version)
        return http_status, grpc_status, message

    def refusal(self, protocol: str, model: str, error: BaseException) -> tuple[int, str, str]:
        """A failed request's HTTP status, gRPC status name and message for the client, logged but not
        counted. A model's own failure (500 / INTERNAL) is logged with its traceback under a request id and
        the client gets only that id; a client's mistake, or a model's :class:`ModelError` (whose message is
        meant for the client), is a line told to :attr:`mistakes` (a warning while that kind of mistake is
        new, else a debug line). What the client sent is escaped and cut before it reaches the log."""
        http_status, grpc_status = status_of(error)
        status: int | str = http_status if protocol == "http" else grpc_status
        if http_status == 500 and not isinstance(error, ModelError):
            tag = REQUEST_ID.get() or request_id(None)
            log.error("%s: model '%s' failed (request id %s)", protocol, loggable(model), tag, exc_info=error)
            message = f"internal error in model '{model}'; the server log has the details under request id {tag}"
        else:
            self.mistakes.tell(f"{protocol}: model '{loggable(model)}': {status}: {loggable(str(error))}")
            message = str(error)
        return http_status, grpc_status, message


class FixedModels:
    """The model control of a server whose models are fixed at start (no model repository): the index
    lists them; ``load`` of a served model reloads its weights from the file they came from
    (``Serving(params=PATH)``, ``Generation(params=PATH)``), in every version, compiling nothing
    (``reload_params``), the old weights serving until the new ones are live; ``unload`` is refused."""

    def __init__(self, service: InferenceService) -> None:
        self.service = service

    def index(self, ready_only: bool) -> list[dict[str, str]]:
        return self.service.served_index()

    def load(self, name: str, parameters: Mapping[str, Any] | None) -> None:
        if parameters:
            raise ProtocolError(f"model '{name}': jitserve reloads a model's weights from their file; load "
                                f"parameters ({', '.join(sorted(map(str, parameters)))}) are not supported")
        specs = self.service.versions.get(name)
        if specs is None:
            self.service.model(name)  # the unknown-model error
            return
        servers = [spec.server for spec in specs.values()]
        if any(server.params_source is None for server in servers):
            raise ProtocolError(f"model '{name}' was given its weights as arrays, not as a file "
                                f"(params=PATH): there is nothing to reload")
        for server in servers:
            try:
                server.reload_params()
            except CheckpointError as error:  # the client sees the file's name, the log its path
                log.error("model '%s': its weights did not reload: %s", name, error)
                raise CheckpointError(hide_paths(str(error))) from None

    def unload(self, name: str, parameters: Mapping[str, Any] | None) -> None:
        self.service.model(name)  # the unknown-model error first
        raise ProtocolError(f"model '{name}' cannot be unloaded: this server's models are fixed at start; serve "
                            f"a model repository (jitserve serve --model-repository DIR --model-control-mode "
                            f"explicit) to load and unload models")


class _Tallied:
    """A ``with`` block counted in a model's tally: a success, or a failure when it raises an exception; a
    caller that is cancelled or stops reading is not counted. (A class rather than a generator-based
    context manager: it is entered once per request.)"""

    __slots__ = ("tally", "started")

    def __init__(self, tally: Tally) -> None:
        self.tally = tally
        self.started = time.perf_counter_ns()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: Any) -> None:
        if kind is None or issubclass(kind, Exception):
            self.tally.add(self.started, ok=kind is None)


def _duration(count: int, ns: float) -> dict[str, int]:
    return {"count": int(count), "ns": int(ns)}


def _phases(count: int, phases: Phases) -> dict[str, dict[str, int]]:
    """Triton's three compute durations: ``count`` times, in ``phases``."""
    return {"compute_input": _duration(count, phases.input_s * 1e9),
            "compute_infer": _duration(count, phases.infer_s * 1e9),
            "compute_output": _duration(count, phases.output_s * 1e9)}


def _version_order(version: str) -> tuple[int, int | str]:
    """Numeric versions in number order, after any others in text order."""
    return (1, int(version)) if version.isdigit() else (0, version)


LOGGED_CHARACTERS = 300


def loggable(text: str) -> str:
    """Client-controlled text as it may enter a log line: control characters escaped (no forged lines),
    at most ``LOGGED_CHARACTERS`` characters."""
    escaped = text.encode("unicode_escape", "backslashreplace").decode("ascii")
    return escaped if len(escaped) <= LOGGED_CHARACTERS else escaped[:LOGGED_CHARACTERS] + "..."


ABSOLUTE_PATH = re.compile(r"(?<![\w.~/:-])(?:/[^\s'\"/]+){2,}")  # /a/b and deeper, not in a URL or a ratio


def hide_paths(text: str, places: Mapping[str, str] | None = None) -> str:
    """An error as a client may see it, without the server's filesystem paths (the server's log keeps
    them): each of ``places`` shown as its value (a model repository's directory as nothing, so that a
    model's folder reads as its name), any other absolute path as its last part (a file's name)."""
    for path in sorted(places or {}, key=len, reverse=True):
        text = text.replace(path, (places or {})[path])
    return ABSOLUTE_PATH.sub(lambda found: found.group(0).rsplit("/", 1)[1], text)
