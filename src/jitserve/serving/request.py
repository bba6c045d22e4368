"""One request in flight: its handle, its stream, and what it passes through on either side of the queues.

A :class:`Request` is one caller's rows in flight; local servers, the cluster
coalescer and the network fronts all hand out and wait on this one type. Its
:class:`Stream` takes a streaming request's items as batches finish
(:func:`put_all`, one hand-over per event loop), :func:`resolve_futures` wakes
its asyncio caller. :func:`prepare` and :func:`finish` are what a request
passes through before it is queued and after its rows ran (a serving's
``preprocess`` and ``postprocess``), used by the corridor
(:mod:`jitserve.serving.corridor`) and by ``Serving.run`` alike.

This module sits below the queues, the serving and the partitions, which all
use its types; it imports none of them.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue as thread_queue
import threading
from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np

from ..batch import Batch
from ..errors import BatchError, raised_by_model


class End(NamedTuple):
    """The last item of a stream; ``reason``: why a generation's request ended (``"stop"``: an end token or a
    stop id, ``"length"``: the last output it needed), None for a serving's rows."""

    reason: str | None = None


END = End()  # a serving's stream's last item
# the caller's trace context (a network front's, when it traces): opaque here, carried from submission to the
# reports of the batches that run the request's rows (``BatchReport.traces``)
TRACE: contextvars.ContextVar[Any] = contextvars.ContextVar("jitserve_trace", default=None)
NO_INFO = object()  # what ``prepare`` gives as info when ``preprocess`` returned a bare batch
OFF_LOOP_CHARS = 2048  # a client's text from this long is tokenized (or rendered, checked) on a thread
_T = TypeVar("_T")


async def off_loop(size: int, work: Callable[[], _T], threshold: int = OFF_LOOP_CHARS,
                   one_at_a_time: asyncio.Semaphore | None = None) -> _T:
    """``work()`` (tokenizing, rendering or checking a client's text of about ``size`` characters; decoding
    or encoding a body of ``size`` bytes) here when ``size`` is under ``threshold``, else on a thread, so
    that the event loop goes on answering others meanwhile (a tokenizer's Rust code lets go of the GIL;
    Python code shares it in slices); under ``one_at_a_time`` where given, so that at most one large
    piece of work's Python objects exist at once."""
    if size < threshold:
        return work()
    if one_at_a_time is None:
        return await asyncio.to_thread(work)
    async with one_at_a_time:
        return await asyncio.to_thread(work)


def text_size(value: Any) -> int:
    """About how many characters of text ``value`` (what a caller gives a ``preprocess``) holds: a text's
    length, the sum over an array or list of texts (``OFF_LOOP_CHARS`` once it has as many items); 0 for
    anything else."""
    if isinstance(value, str | bytes):
        return len(value)
    items = value.reshape(-1) if isinstance(value, np.ndarray) and value.dtype.kind in "OSU" else \
        value if isinstance(value, list | tuple) else ()
    if len(items) >= OFF_LOOP_CHARS:
        return OFF_LOOP_CHARS
    return sum(len(item) for item in items if isinstance(item, str | bytes))


def model_code(function: Callable[..., Any], *arguments: Any) -> Any:
    """``function(*arguments)``, the user's code (a serving's function, ``preprocess``, ``postprocess``):
    what it raises is the model's own failure."""
    try:
        return function(*arguments)
    except Exception as error:
        raised_by_model(error)
        raise


def prepare(preprocess: Callable[[Any], Any] | None, value: Any) -> tuple[Batch, Any]:
    """The caller's input as ``(batch, info)``: through a serving's ``preprocess`` when given, which may
    return a Batch or ``(batch, info)`` (Nx's ``client_preprocessing``); info is ``NO_INFO`` without one."""
    prepared = value if preprocess is None else model_code(preprocess, value)
    batch, info = prepared if type(prepared) is tuple and len(prepared) == 2 else (prepared, NO_INFO)
    if not isinstance(batch, Batch):
        raise BatchError(
            f"expected a jitserve.Batch (build one with Batch.stack or Batch.concatenate), "
            f"or (batch, info) from preprocess; got {type(prepared).__name__}"
        )
    if batch.size == 0:
        raise BatchError("the batch holds no rows; send at least one")
    return batch, info


def finish(postprocess: Callable[..., Any] | None, outputs: Any, info: Any = NO_INFO,
           metadata: Sequence[Any] = ()) -> Any:
    """A serving's ``postprocess(outputs)``; when ``preprocess`` gave info, ``postprocess((outputs, metadata),
    info)`` as Nx's ``client_postprocessing`` (``metadata``: the reports of the batches that ran the rows)."""
    if postprocess is None:
        return outputs
    if info is NO_INFO:
        return model_code(postprocess, outputs)
    return model_code(postprocess, (outputs, tuple(metadata)), info)


def concatenate_outputs(parts: Sequence[Any]) -> Any:
    """Outputs of consecutive row ranges joined on axis 0 (the parts of a split request)."""
    if len(parts) == 1:
        return parts[0]
    flat = [jax.tree_util.tree_flatten(p) for p in parts]
    tree = flat[0][1]
    return jax.tree_util.tree_unflatten(tree, [np.concatenate(leaves) for leaves in zip(*(f[0] for f in flat))])


class Stream:
    """Where a streaming request's items go as batches finish: ``(row offset or step, outputs)``, an
    exception, then ``END``; a thread-safe queue for a sync caller, an asyncio one on the caller's loop."""

    __slots__ = ("loop", "items")

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.loop = loop
        self.items: Any = thread_queue.SimpleQueue() if loop is None else asyncio.Queue()

    def put(self, item: Any) -> None:
        put_all([(self, item)])


def put_all(deliveries: Sequence[tuple[Stream, Any]]) -> None:
    """Each ``(stream, item)``, in order: put on a thread's stream at once, and handed to each asyncio caller's
    event loop in one call for all of its streams (one wake-up of a network front's loop per step, not one
    per stream)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any]]] = {}
    for stream, item in deliveries:
        if stream.loop is None:
            stream.items.put(item)
        else:
            by_loop.setdefault(stream.loop, []).append((stream.items, item))
    for loop, puts in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_nowait_each, puts)
        except RuntimeError:  # the callers' loop is closed: nobody is reading any more
            pass


def _put_nowait_each(puts: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for items, item in puts:
        items.put_nowait(item)


class Reading:
    """One caller reading one request's stream, whichever engine it came from: it waits at most
    ``timeout`` while the request has not ``started`` (then ``expire()``, which raises TimeoutError if the
    request still waits), hands out what each item gives (``order``: row ranges put in order, or each item
    as it is; ``ending``: the stream's :class:`End` last, a generation's reason), and ``close()``s the
    request once the caller stops reading. :func:`read` and :func:`read_async` are its one waiting loop, for
    threads and for asyncio callers."""

    __slots__ = ("items", "timeout", "started", "expire", "close", "order", "ending", "ended")

    def __init__(self, stream: Stream, timeout: float | None, started: Callable[[], bool],
                 expire: Callable[[], None], close: Callable[[], None],
                 order: Callable[[Any], list[Any]] | None = None, ending: bool = False) -> None:
        self.items = stream.items
        self.timeout = timeout
        self.started = started
        self.expire = expire
        self.close = close
        self.order = order
        self.ending = ending
        self.ended = False

    def wait_s(self) -> float | None:
        """How long to wait for the next item: unbounded once the request started."""
        return None if self.started() else self.timeout

    def take(self, item: Any) -> list[Any] | None:
        """What to hand out after ``item``; None at the end (``ending``: the end, then None); a failure
        raises."""
        if type(item) is End:
            self.ended = True
            return [item] if self.ending else None
        if isinstance(item, BaseException):
            raise item
        return [item] if self.order is None else self.order(item)


def read(reading: Reading) -> Generator[Any, None, None]:
    """A request's outputs as they come, for a thread (see :class:`Reading`)."""
    try:
        while True:
            try:
                ready = reading.take(reading.items.get(timeout=reading.wait_s()))
            except thread_queue.Empty:
                reading.expire()
                continue
            if ready is None:
                return
            yield from ready
            if reading.ended:
                return
    finally:
        reading.close()


async def read_async(reading: Reading) -> AsyncGenerator[Any, None]:
    """:func:`read` for a request submitted with its event loop."""
    try:
        while True:
            try:
                ready = reading.take(await asyncio.wait_for(reading.items.get(), reading.wait_s()))
            except TimeoutError:
                reading.expire()
                continue
            if ready is None:
                return
            for outputs in ready:
                yield outputs
            if reading.ended:
                return
    finally:
        reading.close()


class Request:
    """One caller's rows in flight. A sync caller waits on ``done`` (a held lock released when the request
    finishes); an asyncio caller awaits ``future``, resolved on its own ``loop``; a streaming caller reads
    its ``stream``. ``parts`` collects ``(row offset, outputs)`` as batches finish (``(step, outputs)`` for
    a serving that yields steps), ``reports`` the report of each batch that ran some of its rows;
    ``error`` is set instead when the request failed. ``level`` is its priority level; ``weights`` the
    version of a serving's weights its first rows ran with, which all its rows run with (None before)."""

    __slots__ = ("rows", "rows_left", "parts", "reports", "error", "started", "done", "loop", "future", "level",
                 "stream", "weights", "trace")

    def __init__(self, rows: int, loop: asyncio.AbstractEventLoop | None, level: int = 1,
                 stream: bool = False) -> None:
        self.rows = rows
        self.rows_left = rows
        self.parts: list[tuple[int, Any]] = []
        self.reports: list[Any] = []
        self.error: BaseException | None = None
        self.started = False
        self.loop = loop
        self.level = level
        self.stream = Stream(loop) if stream else None
        self.future: asyncio.Future[None] | None = None
        self.weights: Any = None
        self.trace: Any = TRACE.get()
        if loop is None:
            self.done = threading.Lock()
            self.done.acquire()
        else:
            self.future = loop.create_future()

    def fail(self, error: BaseException) -> bool:
        """Finish the request with ``error`` unless it already failed; True if this call finished it."""
        if self.error is not None:
            return False
        self.error = error
        self.rows_left = 0
        if self.stream is not None:
            self.stream.put(error)
        return True


def resolve_futures(requests: list[Request]) -> None:
    """On an event loop: wake the asyncio callers whose requests finished (one hop per loop and batch)."""
    for request in requests:
        if request.future is not None and not request.future.done():
            request.future.set_result(None)
