"""Generation: continuous batching of decode loops, the decode state of every slot resident on the device.

The user writes two functions in ``jax.numpy`` (JetStream's engine contract,
made small): ``prefill(params, tokens, length) -> (state_row, first_output)``
for one prompt padded with zeros to a compiled length, and ``decode(params,
state, last_outputs) -> (state, outputs)`` for one step of every slot at once
(the state rows stacked on a first slot axis). A :class:`GenerationServer`
owns ``slots`` rows of that state on its device. Between two decode steps it
admits waiting requests into free slots (their prompts prefilled together,
padded to the same compiled length, and written into their slots by a
compiled update that leaves the other rows in place), and it frees a slot the
moment its request ends: after ``max_steps`` outputs, right after an output
equal to ``eos``, at ``max_length``, or when its caller stops reading. A
request never waits for another to finish (Orca's iteration-level
scheduling); when no slot is busy, no step runs.

Everything compiles at warm-up: the prefill per (prompt length, number of
prompts) bucket, the slot update per number of prompts, and one decode step,
whose state is donated so that XLA updates it in place; the slot update writes
rows with ``dynamic_update_slice`` (a prefill padded to more prompts repeats
the first one into its own slot), which every compiler lowers in place.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import logging
import queue as thread_queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np

from .. import compilers
from ..defn import defn_errors, resolve_options
from ..errors import BatchError, OptionError, PromptTooLongError, QueueFullError, ServerStoppedError
from ..template import Template, is_template, params_template, templates_of
from .request import END, Stream
from .server import Lifecycle
from .serving import count_option, optional_count, optional_seconds, owned_host_array

log = logging.getLogger("jitserve.generation")


def _powers_of_two_up_to(limit: int, start: int = 1) -> list[int]:
    sizes = [size for size in (1 << k for k in range(limit.bit_length() + 1)) if start <= size < limit]
    return [*sizes, limit]


class Generation:
    """A generation serving: ``prefill`` and ``decode`` (see the module), its weights, and its slots."""

    def __init__(self, prefill: Callable[..., Any], decode: Callable[..., Any], *, params: Any, slots: int,
                 max_length: int, prefill_lengths: Sequence[int] | None = None, eos: Any = None,
                 compiler: str | None = None, max_queue: int | None = None, **compiler_options: Any) -> None:
        if not callable(prefill) or not callable(decode):
            raise OptionError("a Generation needs two functions: prefill(params, tokens, length) and "
                              "decode(params, state, last_outputs)")
        self.prefill = prefill
        self.decode = decode
        self.params = params
        self.params_template = params_template(params)
        self.slots = count_option("slots", slots)
        self.max_length = count_option("max_length", max_length)
        lengths = _powers_of_two_up_to(self.max_length, 16) if prefill_lengths is None else \
            sorted({count_option(f"each of prefill_lengths {list(prefill_lengths)}", n) for n in prefill_lengths})
        if not lengths or lengths[-1] > self.max_length:
            raise OptionError(f"prefill_lengths must be positive and at most max_length ({self.max_length}), "
                              f"got {list(prefill_lengths or [])}")
        self.prefill_lengths = lengths
        self.prefill_batches = _powers_of_two_up_to(self.slots)  # prompts prefilled together, padded to these
        self.eos = eos
        self.max_queue = optional_count("max_queue", max_queue)
        chosen, self.compiler_options = resolve_options({**({"compiler": compiler} if compiler else {}),
                                                         **compiler_options})
        self.compiler_name = chosen.name

    def check_prompt(self, prompt: Any) -> np.ndarray:
        """The prompt as a 1-D int32 array of token ids, else a clear error naming what is wrong."""
        array = np.asarray(prompt)
        if array.size == 0:
            raise BatchError("the prompt is empty; send at least one token")
        if array.dtype.kind not in "iu" or array.ndim != 1:
            got = f"; got {Template(array.shape, array.dtype)}" if array.dtype.kind in "biufc" else ""
            raise BatchError(f"a prompt must be a 1-D array of integer token ids{got}")
        longest = self.prefill_lengths[-1]
        if array.size > longest:
            raise PromptTooLongError(f"the prompt has {array.size} tokens, more than the longest prefill length "
                                     f"({longest}; max_length is {self.max_length})")
        if array.dtype != np.int32:
            if array.min() < np.iinfo(np.int32).min or array.max() > np.iinfo(np.int32).max:
                raise BatchError("the prompt's token ids do not fit int32")
            array = array.astype(np.int32)
        return array

    def __repr__(self) -> str:
        return (f"Generation({getattr(self.prefill, '__name__', self.prefill)!r}, "
                f"{getattr(self.decode, '__name__', self.decode)!r}, slots={self.slots}, "
                f"max_length={self.max_length}, compiler={self.compiler_name!r})")


class GenerationRequest:
    """One prompt in flight: its outputs go to ``stream`` as they come, then END (or an exception)."""

    __slots__ = ("prompt", "max_steps", "stream", "produced", "cancelled", "slot", "submitted", "admitted")

    def __init__(self, prompt: np.ndarray, max_steps: int, loop: asyncio.AbstractEventLoop | None) -> None:
        self.prompt = prompt
        self.max_steps = max_steps
        self.stream = Stream(loop)
        self.produced = 0
        self.cancelled = False
        self.admitted = threading.Event()
        self.slot = -1  # its slot once admitted
        self.submitted = time.perf_counter()


class _Programs:
    """The compiled functions of one generation server: prefills per bucket, slot updates, one step."""

    def __init__(self, generation: Generation, options: dict[str, Any], on_compile: Callable[[], None]) -> None:
        self.generation = generation
        self.compiler = compilers.get(generation.compiler_name)
        self.options = options
        self.on_compile = on_compile
        self.prefills: dict[tuple[int, int], Callable[..., Any]] = {}
        self.updates: dict[int, Callable[..., Any]] = {}
        g = generation
        row, first = jax.eval_shape(g.prefill, *jax.tree_util.tree_map(
            lambda t: t.abstract(), (g.params_template, Template((g.prefill_lengths[0],), np.int32),
                                     Template((), np.int32)), is_leaf=is_template))
        self.row_template = templates_of(row)
        self.output_template = templates_of(first)
        stacked = jax.tree_util.tree_map(lambda t: Template((g.slots, *t.shape), t.dtype), self.row_template,
                                         is_leaf=is_template)
        outputs = Template((g.slots, *self.output_template.shape), self.output_template.dtype)
        self.carry_template = (stacked, outputs)
        self.step = self._compile(self._step, [g.params_template, self.carry_template], donate=(1,))

    def _compile(self, fn: Callable[..., Any], templates: list[Any], donate: tuple[int, ...] = ()) -> Any:
        with defn_errors():
            executable = self.compiler.compile(fn, templates, self.options, donate=donate)
        if self.compiler.compiles:
            self.on_compile()
        return executable.run

    def _step(self, params: Any, carry: Any) -> Any:
        state, last = carry
        state, outputs = self.generation.decode(params, state, last)
        return state, outputs

    def prefill(self, length: int, count: int) -> Callable[..., Any]:
        key = (length, count)
        run = self.prefills.get(key)
        if run is None:
            many = jax.vmap(self.generation.prefill, in_axes=(None, 0, 0)) if self.compiler.compiles \
                else self._one_by_one
            templates = [self.generation.params_template, Template((count, length), np.int32),
                         Template((count,), np.int32)]
            run = self.prefills[key] = self._compile(many, templates)
        return run

    def _one_by_one(self, params: Any, tokens: Any, lengths: Any) -> Any:
        """The prefills of several prompts, stacked: for functions run as written (numpy), which
        ``jax.vmap`` cannot batch."""
        rows = [self.generation.prefill(params, tokens[i], lengths[i]) for i in range(len(lengths))]
        return jax.tree_util.tree_map(lambda *leaves: np.stack([np.asarray(leaf) for leaf in leaves]), *rows)

    def update(self, count: int) -> Callable[..., Any]:
        run = self.updates.get(count)
        if run is None:
            def write(carry: Any, rows: Any, first: Any, slots: Any) -> Any:
                def put(stacked: Any, new: Any) -> Any:  # row i into slot slots[i], in place (no scatter)
                    stacked = jnp.asarray(stacked)
                    for i in range(count):
                        stacked = jax.lax.dynamic_update_index_in_dim(stacked, new[i], slots[i], axis=0)
                    return stacked

                state, last = carry
                return jax.tree_util.tree_map(put, state, rows), put(last, first)

            rows = jax.tree_util.tree_map(lambda t: Template((count, *t.shape), t.dtype), self.row_template,
                                          is_leaf=is_template)
            first = Template((count, *self.output_template.shape), self.output_template.dtype)
            run = self.updates[count] = self._compile(write, [self.carry_template, rows, first,
                                                              Template((count,), np.int32)], donate=(0,))
        return run

    def zeros(self) -> Any:
        return jax.tree_util.tree_map(lambda t: t.zeros(), self.carry_template, is_leaf=is_template)


class GenerationServer(Lifecycle):
    """A named, running generation server: one loop thread that admits, prefills and steps its slots."""

    def __init__(self, generation: Generation, name: str) -> None:
        self.generation = generation
        self.name = name
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: collections.deque[GenerationRequest] = collections.deque()
        self._busy: dict[int, GenerationRequest] = {}
        self._stopping = False
        self._stats: dict[str, Any] = {"requests": 0, "outputs": 0, "steps": 0, "prefills": 0, "compiles": 0,
                                       "errors": 0, "cancelled": 0, "timeouts": 0, "rejected": 0,
                                       "first_output_s": 0.0, "step_s": 0.0, "max_slots_busy": 0}
        options = compilers.get(generation.compiler_name).partitions(generation.compiler_options)[0]
        self._programs = _Programs(generation, options, self._count_compile)
        self._params = self._programs.compiler.place(generation.params, options)
        self._carry: Any = None
        self._thread = threading.Thread(target=self._loop, name=f"jitserve-{name}-generation", daemon=True)
        self._on_stop: list[Callable[[Any], None]] = []

    def _count_compile(self) -> None:
        with self._lock:
            self._stats["compiles"] += 1

    # lifecycle -----------------------------------------------------------------------------------

    def start(self) -> Self:
        """Compile every prefill bucket, every slot update and the step, then start the loop."""
        programs, g = self._programs, self.generation
        self._carry = programs.zeros()
        for length in g.prefill_lengths:
            for count in g.prefill_batches:
                programs.prefill(length, count)
        for count in g.prefill_batches:
            programs.update(count)
        self._thread.start()
        return self

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; ``drain``: finish what runs and what waits (for at most ``timeout`` s),
        else end them now with ServerStoppedError."""
        optional_seconds("timeout", timeout)
        with self._lock:
            first = not self._stopping
            self._stopping = True
            if not drain:
                self._end_all("stopped before this request finished")
            self._wake.notify_all()
        self._thread.join(timeout)
        with self._lock:
            self._end_all(f"stopped (its drain timeout of {timeout}s ran out) before this request finished")
            self._wake.notify_all()
        self._thread.join()
        if first:
            for callback in self._on_stop:
                callback(self)

    def _end_all(self, reason: str) -> None:
        """Under the lock: every waiting and running request ends with ServerStoppedError."""
        for request in [*self._waiting, *self._busy.values()]:
            request.stream.put(ServerStoppedError(f"generation server {self.name!r} {reason}"))
        self._waiting.clear()
        self._busy.clear()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            stats = dict(self._stats)
            stats["slots"] = self.generation.slots
            stats["slots_busy"] = len(self._busy)
            stats["queue_depth"] = len(self._waiting)
        return stats

    # callers ---------------------------------------------------------------------------------------

    def submit(self, prompt: Any, max_steps: int, loop: asyncio.AbstractEventLoop | None = None) -> GenerationRequest:
        """Queue a prompt for at most ``max_steps`` outputs; its outputs arrive on the request's stream."""
        g = self.generation
        count_option("max_steps", max_steps)
        request = GenerationRequest(g.check_prompt(prompt), int(max_steps), loop)
        with self._lock:
            if self._stopping:
                raise ServerStoppedError(f"generation server {self.name!r} is stopped and takes no new requests")
            if g.max_queue is not None and len(self._waiting) >= g.max_queue:
                self._stats["rejected"] += 1
                raise QueueFullError(f"generation server {self.name!r} queue is full: {len(self._waiting)} "
                                     f"prompts wait for a slot, max_queue is {g.max_queue}")
            self._stats["requests"] += 1
            self._waiting.append(request)
            self._wake.notify()
        return request

    def cancel(self, request: GenerationRequest) -> None:
        """The caller stopped reading: a waiting request leaves the queue, a running one frees its slot
        before the next step."""
        with self._lock:
            if request.cancelled:
                return
            request.cancelled = True
            if request in self._waiting:
                self._waiting.remove(request)
                self._stats["cancelled"] += 1

    def _expire(self, request: GenerationRequest, timeout: float | None) -> None:
        """A request not admitted within ``timeout``: taken off the queue with TimeoutError."""
        with self._lock:
            if request.slot >= 0 or request.cancelled or request not in self._waiting:
                return
            self._waiting.remove(request)
            request.cancelled = True
            self._stats["timeouts"] += 1
        raise TimeoutError(f"request to generation server {self.name!r} timed out after {timeout}s waiting "
                           f"for a free slot")

    def outputs(self, request: GenerationRequest, timeout: float | None) -> Iterator[Any]:
        """The request's outputs as they come; closing the iterator cancels the request."""
        items = request.stream.items
        try:
            while True:
                try:
                    item = items.get(timeout=None if request.admitted.is_set() else timeout)
                except thread_queue.Empty:
                    self._expire(request, timeout)
                    continue
                if item is END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancel(request)

    async def outputs_async(self, request: GenerationRequest, timeout: float | None) -> AsyncIterator[Any]:
        """:meth:`outputs` for a request submitted with its event loop."""
        items = request.stream.items
        try:
            while True:
                try:
                    item = await asyncio.wait_for(items.get(), None if request.admitted.is_set() else timeout)
                except TimeoutError:
                    self._expire(request, timeout)
                    continue
                if item is END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancel(request)

    # the loop --------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._busy and not self._waiting and not self._stopping:
                    self._wake.wait()
                if self._stopping and not self._busy and not self._waiting:
                    return
                self._free_cancelled()
                free = [slot for slot in range(self.generation.slots) if slot not in self._busy]
                admitted = [self._waiting.popleft() for _ in range(min(len(free), len(self._waiting)))]
                for request, slot in zip(admitted, free):
                    request.slot = slot
                    self._busy[slot] = request
                    request.admitted.set()
                self._stats["max_slots_busy"] = max(self._stats["max_slots_busy"], len(self._busy))
            try:
                if admitted:
                    self._admit(admitted)
                if self._busy:
                    self._step()
            except Exception as error:  # every running request gets it; the loop goes on
                log.exception("generation server %s: a step failed", self.name)
                with self._lock:
                    self._stats["errors"] += 1
                    for request in self._busy.values():
                        request.stream.put(error)
                    self._busy.clear()
                    self._carry = self._programs.zeros()

    def _free_cancelled(self) -> None:
        """Under the lock: slots whose callers stopped reading are free again."""
        for slot, request in list(self._busy.items()):
            if request.cancelled:
                del self._busy[slot]
                self._stats["cancelled"] += 1

    def _admit(self, requests: list[GenerationRequest]) -> None:
        """Prefill the admitted prompts, grouped by compiled length, and write them into their slots."""
        g, programs = self.generation, self._programs
        groups: dict[int, list[GenerationRequest]] = {}
        for request in requests:
            length = g.prefill_lengths[bisect.bisect_left(g.prefill_lengths, request.prompt.size)]
            groups.setdefault(length, []).append(request)
        for length, group in groups.items():
            count = g.prefill_batches[bisect.bisect_left(g.prefill_batches, len(group))]
            tokens = np.zeros((count, length), np.int32)
            lengths = np.zeros(count, np.int32)
            slots = np.zeros(count, np.int32)
            for row in range(count):  # padding rows repeat the first prompt, into its slot: written twice, alike
                request = group[row] if row < len(group) else group[0]
                tokens[row, :request.prompt.size] = request.prompt
                lengths[row] = request.prompt.size
                slots[row] = request.slot
            rows, first = programs.prefill(length, count)(self._params, tokens, lengths)
            self._carry = programs.update(count)(self._carry, rows, first, slots)
            self._stats["prefills"] += 1
            self._deliver(group, owned_host_array(first)[:len(group)], prompt_positions=True)

    def _step(self) -> None:
        started = time.perf_counter()
        self._carry = self._programs.step(self._params, self._carry)
        outputs = owned_host_array(self._carry[1])  # a copy: the next step reuses the buffer
        with self._lock:
            self._stats["steps"] += 1
            self._stats["step_s"] += time.perf_counter() - started
            running = sorted(self._busy.items())
        self._deliver([request for _, request in running], outputs[[slot for slot, _ in running]])

    def _deliver(self, requests: list[GenerationRequest], outputs: np.ndarray, prompt_positions: bool = False) -> None:
        """Each request's next output; a request that is done (max_steps, eos, max_length) ends and frees
        its slot."""
        g = self.generation
        now = time.perf_counter()
        finished = []
        delivered = 0
        for request, output in zip(requests, outputs):
            if request.cancelled:
                continue
            request.produced += 1
            delivered += 1
            request.stream.put(output)
            done = (request.produced >= request.max_steps
                    or request.prompt.size + request.produced >= g.max_length
                    or (g.eos is not None and np.array_equal(output, g.eos)))
            if done:
                request.stream.put(END)
                finished.append(request)
        with self._lock:
            self._stats["outputs"] += delivered
            if prompt_positions:
                self._stats["first_output_s"] += sum(now - r.submitted for r in requests)
            for request in finished:
                if self._busy.get(request.slot) is request:
                    del self._busy[request.slot]
