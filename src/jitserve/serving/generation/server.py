"""A running generation server: one loop thread that plans, launches and delivers, and its lifecycle.

Each turn, the loop asks its :class:`~.scheduler.Scheduler` for a plan (under
the server's lock), queues the plan's prefills and decode launch on its
:class:`~.programs.Programs`, then delivers what the turn before queued: the
device does not wait for the host between steps (JetStream's pipeline). A
request never waits for another to finish (Orca's iteration-level scheduling);
when no slot is busy, no step runs. With ``steps_per_launch`` above 1 (vLLM's
multi-step scheduling) one program runs that many decode steps back to back,
unrolled, so the host's work of queueing a step (on a GPU, launching it) is
paid once per so many steps; requests are then admitted and freed between
launches, and outputs reach their callers a launch at a time. Around the loop:
warm-up (``start``), ``stop``, weights swapped between requests
(``update_params``), statistics and listeners. What callers see of a
generation server, here or on a cluster, is :class:`GenerationFront`: what
they ask is a :class:`Prompt`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, NamedTuple, Self

import jax

from ... import compilers
from ...errors import OptionError, QueueFullError, ServerStoppedError, raised_by_model
from ...template import Template, check_params
from ..front import Front, Listener, wrong_request
from ..options import optional_seconds
from ..request import OFF_LOOP_CHARS, Reading, off_loop, read, read_async
from ..serving import owned_host_array
from ..stats import GenerationStats, Phases
from ..warmup import compile_each
from .delivery import Choices, Delivery, GenerationRequest, Piece, hand_over, stacked
from .paged_programs import PagedPrograms
from .paged_scheduler import PagedScheduler
from .programs import Programs, to_host
from .scheduler import Plan, Scheduler
from .spec import GREEDY, Generation, Sampling, stop_outputs

log = logging.getLogger("jitserve.generation")

# Generation.engine -> its programs and its scheduler
ENGINES: dict[str, tuple[type[Programs], type[Scheduler[Any]]]] = {"slots": (Programs, Scheduler),
                                                                    "paged": (PagedPrograms, PagedScheduler)}


@dataclass(frozen=True, slots=True)
class Prompt:
    """What a caller asks a generation's server: outputs for ``prompt`` (1-D integer token ids, or what the
    generation's ``preprocess`` takes), at most ``max_steps`` of them, their tokens picked as ``sampling``
    says (a ``logits=True`` generation's), a text generation's text cut at ``stop`` (a string or a list of
    them, see :class:`~.delivery.StopText`); ``timeout``: give up if no slot frees within that many
    seconds."""

    servable: ClassVar[str] = "js.Generation"  # what serves it, and the function that asks it, in errors
    entry: ClassVar[str] = "js.generate"
    prompt: Any
    max_steps: int
    sampling: Sampling = GREEDY
    stop: Any = None
    timeout: float | None = None


class GenerationFront(Front[Prompt]):
    """What ``js.generate`` and the network front call: a :class:`GenerationServer` in this process, or a
    cluster's front of generation replicas (``jitserve.cluster.ray``). The entry points of a
    :class:`Prompt` (``call``, ``stream`` and their asyncio forms) run the generation's ``preprocess`` and
    what each output gives the caller (a :class:`~.delivery.Delivery`) in the caller, around the engine's
    own: ``submit`` checks and queues a request's token ids; ``outputs`` / ``outputs_async`` give its outputs
    as they come, then its :class:`~..request.End` with its reason (closing them cancels it), as a cluster
    replica, which runs neither, calls them."""

    asks = Prompt
    generation: Generation
    name: str
    output_template: Template  # what each step gives one request

    def submit(self, prompt: Any, max_steps: int, loop: asyncio.AbstractEventLoop | None = None,
               sampling: Sampling | None = None) -> Any:
        raise NotImplementedError

    def outputs(self, request: Any, timeout: float | None) -> Generator[Any, None, None]:
        raise NotImplementedError

    def outputs_async(self, request: Any, timeout: float | None) -> AsyncGenerator[Any, None]:
        raise NotImplementedError

    def stats(self) -> GenerationStats:
        raise NotImplementedError

    @property
    def servable(self) -> Generation:
        return self.generation

    def call(self, ask: Prompt) -> Any:
        """Every output, stacked on a first axis; a generation with a ``detokenizer`` answers one string. A
        request that asked for ``logprobs``: ``(answer, [TokenLogprobs, ...])``, one per output."""
        return self._answer(list(self.stream(ask)), ask.sampling.logprobs is not None)

    async def call_async(self, ask: Prompt) -> Any:
        items = await self.open_stream(ask)
        try:
            return self._answer([item async for item in items], ask.sampling.logprobs is not None)
        finally:
            await items.aclose()  # a caller cancelled meanwhile frees the slot now, not when this is collected

    def stream(self, ask: Prompt) -> Generator[Any, None, None]:
        """Each output as its step finishes, as the caller gets it (``postprocess``, stop text); closing the
        iterator cancels the request and frees its slot at the next step. With ``logprobs``, each item comes
        paired with the :class:`~.delivery.TokenLogprobs` of the outputs that gave it: ``(item, [...])`` (a
        piece of text may come of several outputs, or of none)."""
        delivery, request = self._enter(ask, None)
        return delivery.each(self.outputs(request, ask.timeout))

    def stream_async(self, ask: Prompt) -> AsyncGenerator[Any, None]:
        delivery, request = self._enter(ask, asyncio.get_running_loop())
        return delivery.each_async(self.outputs_async(request, ask.timeout))

    async def open_stream(self, ask: Prompt) -> AsyncGenerator[Any, None]:
        """:meth:`stream_async` whose ``preprocess`` (a tokenizer) runs on a thread unless the prompt is a
        short text, so that the event loop goes on answering others meanwhile (the network fronts' entry)."""
        self._check(ask)
        prompt = ask.prompt
        size = len(prompt) if isinstance(prompt, str | bytes) else OFF_LOOP_CHARS
        tokens = prompt if self.generation.preprocess is None else \
            await off_loop(size, lambda: self.generation.prompt_of(prompt))
        delivery, request = self._queued(ask, tokens, asyncio.get_running_loop())
        return delivery.each_async(self.outputs_async(request, ask.timeout))

    def pieces_async(self, ask: Prompt, tokens: Any) -> AsyncGenerator[Piece, None]:
        """The typed entry of a door that made the prompt's token ids itself (``tokens``; ``ask.prompt`` is
        what it read): each :class:`~.delivery.Piece` as it comes, the last with why the request ended;
        closing them cancels it."""
        self._check(ask)
        delivery, request = self._queued(ask, tokens, asyncio.get_running_loop())
        return delivery.pieces_async(self.outputs_async(request, ask.timeout))

    async def choices_async(self, asks: Sequence[tuple[Prompt, Any]], n: int = 1) -> Choices:
        """``n`` choices of each of ``asks`` (a :class:`Prompt` and the token ids its door made), submitted
        now, choice ``i`` of an ask sampling with its seed plus ``i`` (:meth:`~.spec.Sampling.choice`): an
        error raises here, and the choices submitted before it end. Choice ``i`` of ask ``k`` is index
        ``k * n + i`` of their merged pieces (:meth:`~.delivery.Choices.each`)."""
        choices = Choices()
        try:
            for ask, tokens in asks:
                for index in range(n):
                    choices.add(self.pieces_async(replace(ask, sampling=ask.sampling.choice(index)), tokens))
        except BaseException:
            await choices.close()
            raise
        return choices

    def _enter(self, ask: Prompt, loop: asyncio.AbstractEventLoop | None) -> tuple[Delivery, Any]:
        """The caller's side of a request (its token ids, what it makes of the outputs) and the request, queued."""
        self._check(ask)
        return self._queued(ask, self.generation.prompt_of(ask.prompt), loop)

    def _check(self, ask: Prompt) -> None:
        if type(ask) is not Prompt:
            raise wrong_request(self.name, Prompt, ask)
        optional_seconds("timeout", ask.timeout)

    def _queued(self, ask: Prompt, tokens: Any, loop: asyncio.AbstractEventLoop | None) -> tuple[Delivery, Any]:
        delivery = Delivery(self.generation, ask.stop, tokens, ask.sampling.logprobs is not None)
        return delivery, self.submit(tokens, ask.max_steps, loop, ask.sampling)

    def _answer(self, items: list[Any], scored: bool) -> Any:
        """A whole request's answer: one string for a detokenizing generation, else its outputs stacked; for a
        request that asked for log-probabilities, with them: ``(answer, [TokenLogprobs, ...])``."""
        if scored:
            return self._answer([item for item, _ in items], False), [one for _, some in items for one in some]
        return "".join(items) if self.generation.detokenizer is not None else stacked(items)

    def update_params(self, params: Any) -> None:
        """Generate with new weights (see :meth:`GenerationServer.update_params`)."""
        raise OptionError(f"generation server {self.name!r} runs its steps elsewhere; update the weights where "
                          f"it runs")

    @property
    def params_source(self) -> str | None:
        return self.generation.params_source


class _Dispatched(NamedTuple):
    """Outputs queued on the device, for ``requests[i]`` in row ``rows[i]``: ``step``: a launch of decode
    steps, its outputs (a tuple: the tokens (steps, slots, ...), then a scored program's log-probabilities
    and top tokens), queued at ``started``; else the first outputs of admitted prompts, one row each.
    ``queued``: the phases of its launch so far (its inputs made, the programs queued, the copy of its
    outputs to the host started), which its delivery completes."""

    requests: list[GenerationRequest]
    rows: list[int]
    outputs: Any
    started: float
    step: bool
    queued: Phases


class GenerationServer(GenerationFront):
    """A named, running generation server: one loop thread that admits, prefills and steps its slots."""

    def __init__(self, generation: Generation, name: str) -> None:
        self.generation = generation
        self.name = name
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        g = generation
        programs, scheduler = ENGINES[g.engine]
        self._scheduler: Scheduler[GenerationRequest] = scheduler.of(g)
        self._stopping = False
        self._stats = GenerationStats(slots=g.slots)
        options = compilers.get(generation.compiler_name).partitions(generation.compiler_options)[0]
        self._programs = programs(generation, options, self._count_compile)
        self._params = self._programs.place(generation.params)
        self._new_params: Any = None  # weights given to update_params, live once no slot runs with the old ones
        self._update_lock = threading.Lock()
        self._carry: Any = None
        self._ready = 0.0  # when the outputs delivered last were on the host
        self._thread = threading.Thread(target=self._loop, name=f"jitserve-{name}-generation", daemon=True)
        self._on_stop: list[Callable[[Any], None]] = []
        self._listeners: list[Callable[[str, float], None]] = []
        self.output_template = self._programs.output_template
        self._eos = None if generation.eos is None else stop_outputs(generation.eos, self.output_template)

    def add_listener(self, listener: Callable[[str, float], None]) -> None:
        """Call ``listener(kind, seconds)`` for each ``"first_output"`` (a request's time from submission to
        its first output) and each ``"step"`` (one decode step of every busy slot), on the loop thread."""
        self._listeners.append(listener)

    def listen(self, listener: Listener) -> None:
        self.add_listener(listener.step)

    def takes_weights_of(self, servable: Any) -> bool:
        return type(servable) is type(self.generation) and servable.params_template == self.generation.params_template

    def _tell(self, kind: str, seconds: float) -> None:
        for listener in self._listeners:
            try:
                listener(kind, seconds)
            except Exception:
                log.exception("generation server %s: listener %r failed", self.name, listener)

    def update_params(self, params: Any) -> None:
        """Generate with new weights, compiling nothing: ``params`` must have the structure, shapes and
        dtypes of the generation's (else a TemplateMismatchError naming the leaf, and the old weights keep
        generating). A request's state is computed by one set of weights, so every request is generated
        entirely by the old or entirely by the new ones: prompts stay queued while the requests already in
        slots finish with the old weights (a preempted one resumes under them), then the new ones go live,
        the prefix cache is emptied of the old ones' keys and values, and those prompts are admitted. Returns
        once they are live. Concurrent updates apply one at a time."""
        placed = self._programs.place(check_params(params, self.generation.params_template))
        with self._update_lock, self._lock:
            if self._stopping:
                raise ServerStoppedError(f"generation server {self.name!r} is stopped; its weights stay as they were")
            self._new_params = placed
            self._wake.notify_all()
            while self._new_params is placed:
                self._wake.wait()
            if self._params is not placed:
                raise ServerStoppedError(f"generation server {self.name!r} stopped before its new weights went live")

    def _count_compile(self) -> None:
        with self._lock:
            self._stats.compiles += 1

    # lifecycle -----------------------------------------------------------------------------------

    def start(self) -> Self:
        """Compile every prefill bucket, every slot update and the step (a log line each, and a progress bar
        on a terminal, as a Serving's warm-up shows), and run each once where a first run costs extra (XLA,
        on a GPU or the CPU); then start the loop."""
        programs = self._programs
        steps = programs.warm_up_steps()
        if programs.compiler.compiles:
            compile_each(log, f"generation server {self.name}", steps)
        else:  # functions run as written: nothing compiles, nothing to show
            for _, step in steps:
                step()
        if programs.compiler.first_run_costs(programs.options):
            programs.run_each_once(self._params)
        self._carry = programs.zeros()
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
        with self._lock:
            self._new_params = None  # an update still waiting never goes live
            self._wake.notify_all()
        if first:
            for callback in self._on_stop:
                callback(self)

    def _end_all(self, reason: str) -> None:
        """Under the lock: every waiting and running request ends with ServerStoppedError."""
        self._end([*self._scheduler.take_waiting(), *self._scheduler.take_running()],
                  ServerStoppedError(f"generation server {self.name!r} {reason}"))

    @staticmethod
    def _end(requests: list[GenerationRequest], error: BaseException) -> None:
        """Each of ``requests`` not ended yet ends with ``error``; outputs computed for it later are dropped."""
        for request in requests:
            if not request.ended:
                request.ended = True
                request.stream.put(error)

    def stats(self) -> GenerationStats:
        with self._lock:
            return self._stats.snapshot(**self._scheduler.counters(), slots_busy=len(self._scheduler.running),
                                        queue_depth=len(self._scheduler.waiting))

    # callers ---------------------------------------------------------------------------------------

    def submit(self, prompt: Any, max_steps: int, loop: asyncio.AbstractEventLoop | None = None,
               sampling: Sampling | None = None) -> GenerationRequest:
        """Queue a prompt for at most ``max_steps`` outputs, its tokens picked as ``sampling`` says (a
        ``logits=True`` generation; None: greedy); its outputs arrive on the request's stream."""
        g = self.generation
        checked = g.check_request(self.name, prompt, max_steps, sampling, self._programs.vocabulary)
        request = GenerationRequest(checked, int(max_steps), sampling or GREEDY, g.max_length, loop)
        with self._lock:
            if self._stopping:
                raise ServerStoppedError(f"generation server {self.name!r} is stopped and takes no new requests")
            if self._scheduler.full:
                self._stats.rejected += 1
                raise QueueFullError(f"generation server {self.name!r} queue is full: "
                                     f"{len(self._scheduler.waiting)} prompts wait for a slot, max_queue is "
                                     f"{g.max_queue}")
            self._stats.requests += 1
            self._scheduler.submit(request)
            self._wake.notify()
        return request

    def cancel(self, request: GenerationRequest) -> None:
        """The caller stopped reading: a waiting request leaves the queue, a running one frees its slot
        before the next step."""
        with self._lock:
            if self._scheduler.cancel(request):
                self._stats.cancelled += 1

    def _expire(self, request: GenerationRequest, timeout: float | None) -> None:
        """A request not admitted within ``timeout``: taken off the queue with TimeoutError."""
        with self._lock:
            if not self._scheduler.expire(request):
                return
            self._stats.timeouts += 1
        raise TimeoutError(f"request to generation server {self.name!r} timed out after {timeout}s waiting "
                           f"for a free slot")

    def outputs(self, request: GenerationRequest, timeout: float | None) -> Generator[Any, None, None]:
        """The request's outputs as they come, then its :class:`~..request.End` with why it ended; closing
        the iterator cancels the request."""
        return read(self._reading(request, timeout))

    def outputs_async(self, request: GenerationRequest, timeout: float | None) -> AsyncGenerator[Any, None]:
        """:meth:`outputs` for a request submitted with its event loop."""
        return read_async(self._reading(request, timeout))

    def _reading(self, request: GenerationRequest, timeout: float | None) -> Reading:
        return Reading(request.stream, timeout, request.admitted.is_set, lambda: self._expire(request, timeout),
                       lambda: self.cancel(request), ending=True)

    # the loop --------------------------------------------------------------------------------------

    def _loop(self) -> None:
        """Plan, launch, deliver, in a pipeline: what a turn launches is delivered by the next one, after it
        has launched its own work, so that the device never waits for the host (JetStream's design). A
        request that ends at ``eos`` is seen a launch late, and what was computed for it meanwhile is
        dropped."""
        scheduler = self._scheduler
        in_flight: list[_Dispatched] = []  # queued on the device, not delivered yet
        while True:
            with self._lock:
                while not (scheduler.running or scheduler.waiting or in_flight or self._stopping
                           or self._new_params is not None):
                    self._wake.wait()
                if self._stopping and not (scheduler.running or scheduler.waiting or in_flight):
                    return
                self._stats.cancelled += scheduler.release_cancelled()
                if self._new_params is not None and scheduler.between_weights:  # none runs with the old weights
                    self._params, self._new_params = self._new_params, None
                    scheduler.weights_changed()
                    self._wake.notify_all()
                # while new weights wait, nothing new is admitted (a preempted request resumes): the old ones end
                plan = scheduler.plan(admit=self._new_params is None)
                planned = time.perf_counter()
                for request in plan.admitted:
                    if not request.admitted.is_set():  # its wait for a slot (not again once preempted)
                        request.waited_s = planned - request.submitted
                    request.admitted.set()
                self._stats.prefills += len(plan.prefills)
                self._stats.max_slots_busy = max(self._stats.max_slots_busy, plan.busy)
            dispatched: list[_Dispatched] = []
            try:
                self._launch(plan, dispatched)
                for item in in_flight:
                    self._deliver(item)
                in_flight = dispatched
            except Exception as error:  # every running request gets it; the loop goes on
                raised_by_model(error)  # prefill or decode, or their compiled code: a 500 over the network
                log.exception("generation server %s: a step failed", self.name)
                with self._lock:
                    self._stats.errors += 1
                    self._end([*scheduler.take_running(), *plan.requests,
                               *(r for item in [*in_flight, *dispatched] for r in item.requests)], error)
                    self._carry = self._programs.zeros()
                in_flight = []

    def _launch(self, plan: Plan[GenerationRequest], dispatched: list[_Dispatched]) -> None:
        """Queue the plan on the device: each prefill and the write of its rows into their slots, then the
        decode launch; each adds its outputs, on their way to the host, to ``dispatched``."""
        programs = self._programs
        for prefill in plan.prefills:
            started = time.perf_counter()
            inputs = programs.prefill_inputs(prefill)
            calling = time.perf_counter()
            self._carry, first = programs.prefill_of(self._params, self._carry, inputs)
            if prefill.requests:  # else a chunk of prompts whose prefill goes on
                dispatched.append(self._dispatched(prefill.requests, prefill.rows, first, started, calling, False))
        step = plan.step
        if step is not None:
            started = time.perf_counter()
            inputs = programs.step_inputs(step)
            calling = time.perf_counter()
            self._carry, outputs = programs.step_of(self._params, self._carry, inputs)
            dispatched.append(self._dispatched(step.requests, step.output_rows, outputs, started, calling, True))

    @staticmethod
    def _dispatched(requests: list[GenerationRequest], rows: list[int], outputs: Any, started: float,
                    calling: float, step: bool) -> _Dispatched:
        """A launch queued (its inputs made from ``started``, its programs called at ``calling``), its
        outputs on their way to the host."""
        copying = time.perf_counter()
        outputs = to_host(outputs)
        queued = Phases(calling - started, copying - calling, time.perf_counter() - copying)
        return _Dispatched(requests, rows, outputs, started, step, queued)

    def _deliver(self, item: _Dispatched) -> None:
        """Once ``item`` is computed, its outputs to their requests as the scheduler's update decides (it
        frees the slots of those that end; :func:`~.delivery.hand_over` hands them over) and the statistics,
        under the lock; then the listeners."""
        waiting = time.perf_counter()
        jax.block_until_ready(item.outputs)
        computed = time.perf_counter()
        outputs, *scores = [owned_host_array(output) for output in item.outputs]
        if not item.step:  # prefills give one output per prompt: as one step
            outputs, scores = outputs[None], [score[None] for score in scores]
        now = time.perf_counter()
        elapsed = now - max(item.started, self._ready)  # from when the device could start it
        self._ready = now
        steps = outputs.shape[0]
        queued = item.queued
        # the hand-over is not in it (nor is a serving's delivery): each request's phases end before it hears
        phases = Phases(queued.input_s, queued.infer_s + computed - waiting, queued.output_s + now - computed)
        for request in item.requests:  # floats, not a Phases each: this runs for every slot at every launch
            request.input_s += phases.input_s
            request.infer_s += phases.infer_s
            request.output_s += phases.output_s
        with self._lock:  # so that a caller handed its last output finds itself counted
            taken, finished = self._scheduler.update(item.requests, item.rows, outputs, self._eos)
            delivered = hand_over(item.requests, item.rows, outputs, taken, scores)
            stats = self._stats
            stats.outputs += delivered
            if item.step:
                stats.steps += steps
                stats.step_s += elapsed
                stats.launches += 1
                stats.launch_phases += phases
            else:
                stats.first_output_s += sum(now - r.submitted for r in item.requests)
            for request in finished:
                stats.completed += 1
                stats.completed_queue_s += request.waited_s
                stats.completed_phases += Phases(request.input_s, request.infer_s, request.output_s)
        if item.step:
            for _ in range(steps):
                self._tell("step", elapsed / steps)
        else:
            for request in item.requests:
                self._tell("first_output", now - request.submitted)
