"""Process isolation: a partition whose executables run in a worker process.

A native crash in compiled code (a segfault in a runtime, an abort in a
driver) takes down the process it happens in. With ``Serving(...,
isolation="process")`` each partition runs its batches in a child process of
its own: the partition thread sends the padded batch over a socket pair and
waits for the rows back. If the child dies, only the callers of the batch it
was running get a :class:`WorkerCrashedError` (HTTP 500, gRPC INTERNAL) and
the next batch starts a fresh child, which compiles again what its
predecessor had compiled (from the compile caches on disk where the compiler
has one); the server keeps serving.

The child is a fresh interpreter running :func:`main` (it never re-runs the
caller's main module). The serving, and its compiler when it was registered
at run time, travel with cloudpickle (as with Ray), so lambdas, closures and
compilers defined in a script work. A serving's weights do not travel with it:
each version is sent once (:meth:`ProcessExecutor.place`), kept by the worker
until the server lets go of it, and sent again only to a worker that replaced
a crashed one.
"""

from __future__ import annotations

import itertools
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle
import jax

from .. import compilers
from ..batch import Batch, RowSignature
from ..compilers import Device
from ..compilers.xla import run_cpu_computations_inline
from ..errors import WorkerCrashedError, raised_by_model
from .serving import Executor, Serving, cut_rows
from .stats import Phases


def _transportable(options: Mapping[str, Any]) -> dict[str, Any]:
    """Options that can cross a process boundary: a device becomes the name its compiler resolves it by."""
    portable = dict(options)
    device = portable.get("device")
    if isinstance(device, Device):
        portable["device"] = device.uri
    elif isinstance(device, jax.Device):
        portable["device"] = f"{device.platform}:{jax.devices(device.platform).index(device)}"
    return portable


def _signal_name(returncode: int | None) -> str:
    if returncode is None:
        return "closed its connection"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


class WorkerWeights:
    """A version of the weights that lives in the worker process, by number; when the server lets go of
    it, the worker is told to drop it with the next message."""

    __slots__ = ("version", "__weakref__")

    def __init__(self, version: int) -> None:
        self.version = version


class ProcessExecutor:
    """A partition's executor whose executables live in a child process, restarted after a crash."""

    def __init__(self, serving: Serving, options: Mapping[str, Any], on_compile: Callable[[], None],
                 label: str = "serving") -> None:
        compiler = compilers.get(serving.compiler_name)
        self._payload = cloudpickle.dumps((serving.with_params(None), _transportable(options), compiler))
        self._versions = itertools.count()
        self._live: dict[int, Any] = {}  # the weights the worker holds, by version: sent again after a crash
        self._dropped: list[int] = []  # versions let go of, to tell the worker with the next message
        self._on_compile = on_compile
        self._label = label
        self._warm: dict[tuple[int, Any, RowSignature, Any], None] = {}  # compiled in the worker, in order
        self._process: subprocess.Popen[bytes] | None = None
        self._connection: Connection | None = None
        self._lock = threading.Lock()

    def _start(self) -> Connection:
        parent, child = socket.socketpair()
        self._process = subprocess.Popen(
            [sys.executable, "-c", f"from jitserve.serving.worker import main; main({child.fileno()})"],
            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
        child.close()
        connection = Connection(parent.detach())
        try:
            connection.send(sys.path)  # where the serving's modules are found, as multiprocessing's spawn does
            connection.send_bytes(self._payload)
            status, value = connection.recv()
        except (EOFError, OSError) as error:
            raise self._crashed(0) from error
        if status == "error":
            raise value
        self._connection = connection
        for version, params in list(self._live.items()):  # what the crashed worker had been sent
            self._call(("params", version, params), 0)
        for rows, tree, row_signature, batch_key in self._warm:  # what the crashed worker had compiled
            self._call(("compile", rows, tree, row_signature, batch_key), rows)
        return connection

    def _call(self, message: tuple[Any, ...], rows: int) -> Any:
        connection = self._connection or self._start()
        try:
            connection.send(message)
            status, value = connection.recv()
        except (EOFError, OSError) as error:
            raise self._crashed(rows) from error
        if status == "error":
            raise value
        return value

    def _crashed(self, rows: int) -> WorkerCrashedError:
        process, self._process, self._connection = self._process, None, None
        code = process.wait() if process is not None else None
        doing = f"while running a batch of {rows} rows" if rows else "while starting"
        return WorkerCrashedError(
            f"the worker process of {self._label} {_signal_name(code)} {doing}; only this batch failed, "
            f"and a new worker starts for the next one")

    def compiled(self, rows: int, tree: Any, row_signature: RowSignature, batch_key: Any = None) -> None:
        with self._lock:
            if self._call(("compile", rows, tree, row_signature, batch_key), rows):
                self._on_compile()
            self._warm[(rows, tree, row_signature, batch_key)] = None

    def place(self, params: Any) -> WorkerWeights:
        """Send a version of the weights to the worker, once."""
        with self._lock:
            version = next(self._versions)
            self._live[version] = params
            self._call(("params", version, params), 0)
        weights = WorkerWeights(version)
        weakref.finalize(weights, self._forget, version)
        return weights

    def _forget(self, version: int) -> None:
        self._live.pop(version, None)
        self._dropped.append(version)

    def execute(self, batch: Batch, params: WorkerWeights | tuple[()]) -> tuple[Any, Phases]:
        """The batch run in the worker: its outputs, and the phases as :meth:`Executor.execute` times them,
        the trip to the worker and back counted in infer."""
        rows = batch.size + batch.padding
        version = params.version if isinstance(params, WorkerWeights) else None
        with self._lock:
            dropped, self._dropped = self._dropped, []
            started = time.perf_counter()
            inputs = batch.materialize()
            sent = time.perf_counter()
            try:
                compiled, outputs, output_s = self._call(("execute", rows, batch.size, batch.tree,
                                                          batch.row_signature, batch.user_key, inputs, version,
                                                          dropped), rows)
            except Exception as error:  # the model's, from the worker, or the worker's crash while running it
                raised_by_model(error)
                raise
            phases = Phases(sent - started, time.perf_counter() - sent - output_s, output_s)
            if compiled:
                self._on_compile()
                self._warm[(rows, batch.tree, batch.row_signature, batch.user_key)] = None
        return outputs, phases

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
            if self._process is not None:
                self._process.wait()
            self._process = self._connection = None


def _reply(connection: Connection, status: str, value: Any) -> None:
    try:
        connection.send((status, value))
    except (pickle.PicklingError, TypeError, AttributeError):  # an exception that does not pickle
        connection.send(("error", RuntimeError(f"{type(value).__name__}: {value}")))


def main(fd: int) -> None:
    """The worker: build the serving's executor, then answer compile and execute requests until closed."""
    run_cpu_computations_inline()  # before the serving (and the user's modules) arrive
    connection = Connection(fd)
    sys.path[:] = connection.recv()
    try:
        serving, options, compiler = pickle.loads(connection.recv_bytes())
    except Exception as error:  # noqa: BLE001 - reported to the server, which raises it to the caller
        _reply(connection, "error", RuntimeError(
            f"the worker process could not rebuild the serving ({type(error).__name__}: {error})"))
        return
    if compiler.name not in compilers.COMPILERS:  # registered at run time in the server's process
        compilers.register(compiler.name, compiler)
    _reply(connection, "ok", None)
    compiles = 0

    def count() -> None:
        nonlocal compiles
        compiles += 1

    executor = Executor(serving, options, count)
    weights: dict[int | None, Any] = {None: None}  # by version; None: a serving without weights
    while True:
        try:
            message = connection.recv()
        except EOFError:
            return
        before = compiles
        try:
            value: Any = None
            if message[0] == "params":
                weights[message[1]] = executor.place(message[2])
            elif message[0] == "compile":
                executor.compiled(*message[1:])
                value = compiles > before
            else:
                rows, keep, tree, row_signature, batch_key, inputs, version, dropped = message[1:]
                for old in dropped:
                    weights.pop(old, None)
                run = executor.compiled(rows, tree, row_signature, batch_key)
                outputs = jax.block_until_ready(run(*serving.arguments(inputs, weights[version])))
                cutting = time.perf_counter()
                cut = cut_rows(outputs, rows, keep)
                value = (compiles > before, cut, time.perf_counter() - cutting)
        except Exception as error:  # noqa: BLE001 - the caller's batch fails with it, the worker goes on
            _reply(connection, "error", error)
            continue
        _reply(connection, "ok", value)

