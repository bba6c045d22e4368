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
equal to ``eos`` (or to one of a list of them), at ``max_length``, or when
its caller stops reading. A request never waits for another to finish
(Orca's iteration-level scheduling); when no slot is busy, no step runs.
The loop queues each step before it delivers the outputs of the step before
(JetStream's pipeline), so the device does not wait for the host between
steps. With ``steps_per_launch`` above 1 (vLLM's multi-step scheduling) one
program runs that many decode steps back to back, unrolled, so the host's
work of queueing a step (on a GPU, launching it) is paid once per so many
steps; requests are then admitted and freed between launches, and outputs
reach their callers a launch at a time.

Everything compiles at warm-up, and on a GPU runs once there on idle slots
(a GPU's first run of a program loads its kernels): the prefill per (prompt
length, number of prompts) bucket, the slot update per number of prompts, and
one decode step, whose state is donated so that XLA updates it in place; the
slot update writes rows with ``dynamic_update_slice`` (a prefill padded to
more prompts repeats the first one into its own slot), which every compiler
lowers in place. The programs take the weights packed into few arrays
(:mod:`jitserve.packed`), as each array a call passes costs the host time
at every step. A generation that gives logits has two of each update and
step: one picks the most likely tokens, the other samples with each row's
options. The host picks the program, as it knows every request's options: a
``lax.cond`` on the device would be read back to the host by XLA on a GPU,
and the host would wait for each step before it could queue the next.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import copy
import logging
import os
import queue as thread_queue
import secrets
import threading
import time
from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from typing import Any, NamedTuple, Self

import jax
import jax.numpy as jnp
import numpy as np

from .. import compilers
from ..defn import defn_errors, resolve_options
from ..errors import (
    BatchError,
    OptionError,
    PromptTooLongError,
    QueueFullError,
    ServerStoppedError,
    raised_by_model,
)
from ..packed import PackedLayout
from ..params import load_params
from ..template import Template, check_params, is_template, params_template, templates_of
from .options import count_option, finite_number, optional_count, optional_seconds
from .request import END, Stream, model_code, put_all
from .server import Lifecycle
from .serving import owned_host_array

log = logging.getLogger("jitserve.generation")


def _powers_of_two_up_to(limit: int, start: int = 1) -> list[int]:
    sizes = [size for size in (1 << k for k in range(limit.bit_length() + 1)) if start <= size < limit]
    return [*sizes, limit]


def _whole(name: str, value: Any, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 0 <= value < limit:
        raise OptionError(f"{name} must be an integer in [0, {limit}), got {value!r}")
    return int(value)


class Sampling:
    """How one request of a ``logits=True`` generation picks its tokens: greedy (``temperature`` 0, the
    default), or drawn at ``temperature`` from the ``top_k`` most likely tokens (0: all of them) that make up
    ``top_p`` of the probability (HF's order: top-k, then top-p), from a generator seeded with ``seed`` (None:
    a fresh one; a seed gives the same tokens whatever else runs)."""

    __slots__ = ("temperature", "top_k", "top_p", "seed")

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> None:
        if not finite_number(temperature) or temperature < 0:
            raise OptionError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
        if not finite_number(top_p) or not 0 < top_p <= 1:
            raise OptionError(f"top_p must be a number in (0, 1], got {top_p!r}")
        self.temperature = float(temperature)
        self.top_k = _whole("top_k (0: no limit)", top_k, 2**31)
        self.top_p = float(top_p)
        self.seed = secrets.randbits(32) if seed is None else _whole("seed", seed, 2**32)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling(seed=0)


def greedy_tokens(logits: Any) -> Any:
    """The most likely token of each row of ``logits`` (rows, vocabulary)."""
    return jnp.argmax(jnp.asarray(logits, jnp.float32), axis=-1).astype(jnp.int32)


def sample_tokens(logits: Any, temperature: Any, top_k: Any, top_p: Any, seed: Any, step: Any) -> Any:
    """One token per row of ``logits`` (rows, vocabulary): the most likely where ``temperature`` is 0,
    else drawn from that row's top-k / top-p distribution at its temperature with the key
    ``fold_in(PRNGKey(seed), step)``: a row's token depends on its own row and options only."""
    logits = jnp.asarray(logits, jnp.float32)

    def draw(row: Any, temperature: Any, top_k: Any, top_p: Any, seed: Any, step: Any) -> Any:
        vocabulary = row.shape[-1]
        scaled = row / jnp.maximum(temperature, 1e-6)
        ordered = jnp.sort(scaled)[::-1]
        kept = jnp.where(top_k > 0, scaled >= ordered[jnp.clip(top_k - 1, 0, vocabulary - 1)], True)
        ordered = jnp.where(jnp.arange(vocabulary) < jnp.where(top_k > 0, top_k, vocabulary), ordered, -jnp.inf)
        reached = jnp.sum(jnp.cumsum(jax.nn.softmax(ordered)) < top_p)  # the last token still needed for top_p
        kept &= scaled >= ordered[jnp.clip(reached, 0, vocabulary - 1)]
        key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
        return jax.random.categorical(key, jnp.where(kept, scaled, -jnp.inf)).astype(jnp.int32)

    drawn = jax.vmap(draw)(logits, temperature, top_k, top_p, seed, step)
    return jnp.where(temperature > 0, drawn, greedy_tokens(logits))


class Generation:
    """A generation serving: ``prefill`` and ``decode`` (see the module), its weights (``params``: a tree of
    arrays, or a file that :func:`jitserve.load_params` reads, remembered for ``reload_params``), and its
    slots. With ``logits=True`` both return logits (a vector per sequence) instead of outputs: the server
    picks each token on the device, greedy or sampled per request (:class:`Sampling`), and gives it to the
    caller and to the next ``decode``. ``steps_per_launch``: the decode steps each launch runs (see the
    module); a request's outputs do not depend on it, only when they arrive and how many steps a slot
    idles after its request ends mid-launch. ``preprocess(prompt)``: the token ids of a prompt as callers
    send it (a tokenizer); ``postprocess(output)``: what a caller gets for each output (a token's text);
    ``detokenizer(prompt_ids)``: instead of ``postprocess``, a new incremental decoder per request, whose
    ``feed(token)`` gives the text that can go out and ``finish()`` what it still held at the end (a real
    tokenizer's text, which one token alone cannot give); such a generation answers text, and
    :func:`jitserve.generate` one string. All run in the caller."""

    def __init__(self, prefill: Callable[..., Any], decode: Callable[..., Any], *, params: Any, slots: int,
                 max_length: int, prefill_lengths: Sequence[int] | None = None, eos: Any = None,
                 compiler: str | None = None, max_queue: int | None = None, logits: bool = False,
                 steps_per_launch: int = 1, preprocess: Callable[[Any], Any] | None = None,
                 postprocess: Callable[[Any], Any] | None = None,
                 detokenizer: Callable[[np.ndarray], Any] | None = None, **compiler_options: Any) -> None:
        if not callable(prefill) or not callable(decode):
            raise OptionError("a Generation needs two functions: prefill(params, tokens, length) and "
                              "decode(params, state, last_outputs)")
        for name, hook in (("preprocess", preprocess), ("postprocess", postprocess), ("detokenizer", detokenizer)):
            if hook is not None and not callable(hook):
                raise OptionError(f"{name} must be a function or None, got {type(hook).__name__}")
        if postprocess is not None and detokenizer is not None:
            raise OptionError("give a Generation postprocess (a text per output) or detokenizer (a decoder per "
                              "request), not both")
        self.preprocess = preprocess
        self.postprocess = postprocess
        self.detokenizer = detokenizer
        self.prefill = prefill
        self.decode = decode
        self.params_source = os.fspath(params) if isinstance(params, str | os.PathLike) else None  # a reload reads it
        self.params = params if self.params_source is None else load_params(self.params_source)
        self.params_template = params_template(self.params)
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
        self.logits = bool(logits)
        self.steps_per_launch = count_option("steps_per_launch", steps_per_launch)
        self.max_queue = optional_count("max_queue", max_queue)
        chosen, self.compiler_options = resolve_options({**({"compiler": compiler} if compiler else {}),
                                                         **compiler_options})
        self.compiler_name = chosen.name

    def prompt_of(self, prompt: Any) -> Any:
        """The token ids of a caller's prompt: ``preprocess(prompt)`` where given (a tokenizer; run by the
        caller), else the prompt itself."""
        return prompt if self.preprocess is None else model_code(self.preprocess, prompt)

    def output_of(self, output: Any) -> Any:
        """What the caller gets for one output: ``postprocess(output)`` where given (the text of a token, say;
        run by the caller), else the output itself."""
        return output if self.postprocess is None else model_code(self.postprocess, output)

    @property
    def has_params(self) -> bool:
        """False only for a copy made to travel without its weights (``with_params(None)``)."""
        return self.params is not None

    def with_params(self, params: Any) -> Generation:
        """This generation with other weights of the same shapes (None: without them, to travel light)."""
        changed = copy.copy(self)
        changed.params = params
        return changed

    def fingerprint_fields(self) -> dict[str, Any]:
        """What identifies what this generation computes (see ``Serving.fingerprint_fields``): its functions,
        its checked options, and its weights' templates and file, not their values (``params``)."""
        names = ("prefill", "decode", "preprocess", "postprocess", "detokenizer", "params_source", "params_template",
                 "slots", "max_length", "prefill_lengths", "prefill_batches", "eos", "logits", "steps_per_launch",
                 "max_queue", "compiler_name", "compiler_options")
        return {name: getattr(self, name) for name in names}

    def shapes(self) -> tuple[Any, Template, Template]:
        """The templates of a prompt's state row, of what ``prefill`` gives for it (an output, or logits),
        and of one output a caller gets per step (a token id, for ``logits=True``), which ``eos`` must be
        (or a list of them)."""
        row, first = jax.eval_shape(self.prefill, *jax.tree_util.tree_map(
            lambda t: t.abstract(), (self.params_template, Template((self.prefill_lengths[0],), np.int32),
                                     Template((), np.int32)), is_leaf=is_template))
        first = templates_of(first)
        if self.logits and (len(first.shape) != 1 or first.dtype.kind != "f"):
            raise OptionError(f"a logits=True generation's prefill must return a vector of float logits per "
                              f"prompt; it returned {first}")
        output = Template((), np.int32) if self.logits else first
        if self.eos is not None:
            _stop_outputs(self.eos, output)
        return templates_of(row), first, output

    def check_request(self, name: str, prompt: Any, max_steps: int, sampling: Sampling | None) -> np.ndarray:
        """A request's prompt (see :meth:`check_prompt`) once its ``max_steps`` and ``sampling`` are checked
        for generation server ``name``."""
        count_option("max_steps", max_steps)
        if sampling is not None and not sampling.greedy and not self.logits:
            raise OptionError(f"generation server {name!r} cannot sample: its decode returns outputs, not "
                              f"logits (serve it with js.Generation(..., logits=True) to sample per request)")
        return self.check_prompt(prompt)

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

    __slots__ = ("prompt", "max_steps", "sampling", "stream", "needed", "dispatched", "produced", "ended",
                 "cancelled", "slot", "submitted", "admitted")

    def __init__(self, prompt: np.ndarray, max_steps: int, sampling: Sampling, max_length: int,
                 loop: asyncio.AbstractEventLoop | None) -> None:
        self.prompt = prompt
        self.max_steps = max_steps
        self.sampling = sampling
        self.stream = Stream(loop)
        # outputs it gets unless eos ends it first: max_steps, or as many as fit max_length (the first, always)
        self.needed = max(1, min(max_steps, max_length - prompt.size))
        self.dispatched = 0  # its outputs being computed or computed (ahead of ``produced`` by a launch at most)
        self.produced = 0  # its outputs delivered
        self.ended = False  # it got END or an error: later outputs computed for it are dropped
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
        g = generation
        # picking tokens is jitserve's code: compiled with the step, or on its own beside functions run as written
        self.greedy, self.sample = ((greedy_tokens, sample_tokens) if self.compiler.compiles
                                    else (jax.jit(greedy_tokens), jax.jit(sample_tokens)))
        # a logits generation has a program of each kind, greedy (no options, nothing sorted) and sampled; the
        # host picks one per step: a lax.cond would make the host wait for the device on a GPU (XLA reads the
        # predicate back), and the pipeline would stall
        self.kinds = (False, True) if g.logits else (False,)
        self.updates: dict[tuple[int, bool], Callable[..., Any]] = {}
        # what prefill gives per prompt: a state row, and an output or logits
        self.row_template, self.first_template, self.output_template = g.shapes()
        self.layout = PackedLayout(g.params_template)  # the programs take the weights packed
        output = self.output_template
        stacked = jax.tree_util.tree_map(lambda t: Template((g.slots, *t.shape), t.dtype), self.row_template,
                                         is_leaf=is_template)
        self.carry_template = (stacked, Template((g.slots, *output.shape), output.dtype))
        self.steps = {sampled: self._compile(self._steps, [self.layout.templates, self.carry_template,
                                                          *self._options(g.slots, sampled)], donate=(1,))
                      for sampled in self.kinds}

    @staticmethod
    def _options(rows: int, sampled: bool) -> list[Template]:
        """The templates of the sampling options of ``rows`` sequences (see :meth:`option_arrays`); none
        unless the program samples."""
        if not sampled:
            return []
        return [Template((rows,), dtype) for dtype in (np.float32, np.int32, np.float32, np.uint32, np.int32)]

    def sampled(self, requests: Sequence[GenerationRequest | None]) -> bool:
        """Whether a program that samples must pick the outputs of ``requests``: some request is not greedy."""
        return self.generation.logits and any(r is not None and r.sampling.temperature > 0 for r in requests)

    def option_arrays(self, requests: Sequence[GenerationRequest | None], sampled: bool) -> list[np.ndarray]:
        """The options the program of kind ``sampled`` takes for ``requests``: none for one that does not
        sample, else each request's temperature, top_k, top_p, seed and next step (its outputs computed so
        far), one row per request (None: an idle slot, greedy)."""
        if not sampled:
            return []
        chosen = [GREEDY if request is None else request.sampling for request in requests]
        steps = [0 if request is None else request.dispatched for request in requests]
        return [np.array([c.temperature for c in chosen], np.float32), np.array([c.top_k for c in chosen], np.int32),
                np.array([c.top_p for c in chosen], np.float32), np.array([c.seed for c in chosen], np.uint32),
                np.array(steps, np.int32)]

    def _chosen(self, outputs: Any, options: Sequence[Any]) -> Any:
        """The outputs a step gives its callers and the next step: the tokens picked from the logits
        (:func:`sample_tokens` given ``options``, else :func:`greedy_tokens`), or the outputs as they are."""
        if not self.generation.logits:
            return outputs
        return self.sample(outputs, *options) if options else self.greedy(outputs)

    def _compile(self, fn: Callable[..., Any], templates: list[Any], donate: tuple[int, ...] = ()) -> Any:
        with defn_errors():
            executable = self.compiler.compile(fn, templates, self.options, donate=donate)
        if self.compiler.compiles:
            self.on_compile()
        return executable.run

    def _steps(self, packed: Any, carry: Any, *options: Any) -> Any:
        """``steps_per_launch`` decode steps, one after the other: the next carry, and each step's outputs
        stacked (steps, slots, ...) in a buffer of their own, which the host reads while the next launch
        (given the carry, donated) runs; ``options``: the sampling options, if the program samples (the
        rows' step numbers counting on from the first step's)."""
        params = self.layout.unpack(packed)
        outputs = []
        for step in range(self.generation.steps_per_launch):
            state, last = carry
            state, logits_or_outputs = self.generation.decode(params, state, last)
            chosen = self._chosen(logits_or_outputs, [*options[:-1], options[-1] + step] if options else ())
            carry = (state, chosen)
            outputs.append(chosen)
        return carry, jnp.stack(outputs) if self.compiler.compiles else np.stack([np.asarray(o) for o in outputs])

    def prefill(self, length: int, count: int) -> Callable[..., Any]:
        key = (length, count)
        run = self.prefills.get(key)
        if run is None:
            templates = [self.layout.templates, Template((count, length), np.int32),
                         Template((count,), np.int32)]
            run = self.prefills[key] = self._compile(self._prefills, templates)
        return run

    def _prefills(self, packed: Any, tokens: Any, lengths: Any) -> Any:
        """The prefills of several prompts, stacked: by ``jax.vmap`` where the compiler traces them, else one
        by one (functions run as written on numpy, which ``jax.vmap`` cannot batch)."""
        params = self.layout.unpack(packed)
        if self.compiler.compiles:
            return jax.vmap(self.generation.prefill, in_axes=(None, 0, 0))(params, tokens, lengths)
        rows = [self.generation.prefill(params, tokens[i], lengths[i]) for i in range(len(lengths))]
        return jax.tree_util.tree_map(lambda *leaves: np.stack([np.asarray(leaf) for leaf in leaves]), *rows)

    def update(self, count: int, sampled: bool) -> Callable[..., Any]:
        """The write of ``count`` prefilled rows into their slots, picking their first outputs (sampled or
        not)."""
        run = self.updates.get((count, sampled))
        if run is None:
            def write(carry: Any, rows: Any, first: Any, slots: Any, *options: Any) -> Any:
                def put(stacked: Any, new: Any) -> Any:  # row i into slot slots[i], in place (no scatter)
                    stacked = jnp.asarray(stacked)
                    for i in range(count):
                        stacked = jax.lax.dynamic_update_index_in_dim(stacked, new[i], slots[i], axis=0)
                    return stacked

                state, last = carry
                outputs = self._chosen(first, options)
                return (jax.tree_util.tree_map(put, state, rows), put(last, outputs)), outputs

            rows = jax.tree_util.tree_map(lambda t: Template((count, *t.shape), t.dtype), self.row_template,
                                          is_leaf=is_template)
            first = Template((count, *self.first_template.shape), self.first_template.dtype)
            run = self.updates[count, sampled] = self._compile(
                write, [self.carry_template, rows, first, Template((count,), np.int32),
                        *self._options(count, sampled)], donate=(0,))
        return run

    def zeros(self) -> Any:
        return jax.tree_util.tree_map(lambda t: t.zeros(), self.carry_template, is_leaf=is_template)


class GenerationFront(Lifecycle):
    """What ``js.generate`` and the network front call: a :class:`GenerationServer` in this process, or a
    cluster's front of generation replicas (``jitserve.cluster.ray``). ``submit`` checks and queues a
    request; ``outputs`` / ``outputs_async`` give its outputs as they come (closing them cancels it)."""

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

    def stats(self) -> dict[str, Any]:
        raise NotImplementedError

    def update_params(self, params: Any) -> None:
        """Generate with new weights (see :meth:`GenerationServer.update_params`)."""
        raise OptionError(f"generation server {self.name!r} runs its steps elsewhere; update the weights where "
                          f"it runs")

    @property
    def params_source(self) -> str | None:
        return self.generation.params_source


class GenerationServer(GenerationFront):
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
        self._params = self._place(generation.params)
        self._new_params: Any = None  # weights given to update_params, live once no slot runs with the old ones
        self._update_lock = threading.Lock()
        self._carry: Any = None
        self._ready = 0.0  # when the outputs delivered last were on the host
        self._thread = threading.Thread(target=self._loop, name=f"jitserve-{name}-generation", daemon=True)
        self._on_stop: list[Callable[[Any], None]] = []
        self._listeners: list[Callable[[str, float], None]] = []
        self.output_template = self._programs.output_template
        self._eos = None if generation.eos is None else _stop_outputs(generation.eos, self.output_template)

    def add_listener(self, listener: Callable[[str, float], None]) -> None:
        """Call ``listener(kind, seconds)`` for each ``"first_output"`` (a request's time from submission to
        its first output) and each ``"step"`` (one decode step of every busy slot), on the loop thread."""
        self._listeners.append(listener)

    def _tell(self, kind: str, seconds: float) -> None:
        for listener in self._listeners:
            try:
                listener(kind, seconds)
            except Exception:
                log.exception("generation server %s: listener %r failed", self.name, listener)

    def _place(self, params: Any) -> Any:
        """``params`` packed as the programs take them, on the server's device."""
        programs = self._programs
        return programs.compiler.place(programs.layout.pack(params), programs.options)

    def update_params(self, params: Any) -> None:
        """Generate with new weights, compiling nothing: ``params`` must have the structure, shapes and
        dtypes of the generation's (else a TemplateMismatchError naming the leaf, and the old weights keep
        generating). A request's state is computed by one set of weights, so every request is generated
        entirely by the old or entirely by the new ones: prompts stay queued while the requests already in
        slots finish with the old weights, then the new ones go live and those prompts are admitted. Returns
        once they are live. Concurrent updates apply one at a time."""
        placed = self._place(check_params(params, self.generation.params_template))
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
            self._stats["compiles"] += 1

    # lifecycle -----------------------------------------------------------------------------------

    def start(self) -> Self:
        """Compile every prefill bucket, every slot update and the step, and run each once where a first run
        costs extra (a GPU); then start the loop."""
        programs, g = self._programs, self.generation
        for length in g.prefill_lengths:
            for count in g.prefill_batches:
                programs.prefill(length, count)
        for count in g.prefill_batches:
            for sampled in programs.kinds:
                programs.update(count, sampled)
        if programs.compiler.first_run_costs(programs.options):
            self._run_each_once()
        self._carry = programs.zeros()
        self._thread.start()
        return self

    def _run_each_once(self) -> None:
        """Run every compiled program once, on idle slots of a scratch carry: a GPU loads a program's
        kernels and builds its command buffers on its first run, which is then not on a request's time."""
        programs, g = self._programs, self.generation
        carry = programs.zeros()
        for count in g.prefill_batches:
            for length in g.prefill_lengths:
                rows, first = programs.prefill(length, count)(self._params, np.zeros((count, length), np.int32),
                                                              np.ones(count, np.int32))
            for sampled in programs.kinds:
                carry, _ = programs.update(count, sampled)(carry, rows, first, np.arange(count, dtype=np.int32),
                                                           *programs.option_arrays([None] * count, sampled))
        for sampled in programs.kinds:
            carry, outputs = programs.steps[sampled](self._params, carry,
                                                     *programs.option_arrays([None] * g.slots, sampled))
        owned_host_array(outputs)  # waits for the runs, which all end in it

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
        self._end([*self._waiting, *self._busy.values()],
                  ServerStoppedError(f"generation server {self.name!r} {reason}"))
        self._waiting.clear()
        self._busy.clear()

    @staticmethod
    def _end(requests: list[GenerationRequest], error: BaseException) -> None:
        """Each of ``requests`` not ended yet ends with ``error``; outputs computed for it later are dropped."""
        for request in requests:
            if not request.ended:
                request.ended = True
                request.stream.put(error)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            stats = dict(self._stats)
            stats["slots"] = self.generation.slots
            stats["slots_busy"] = len(self._busy)
            stats["queue_depth"] = len(self._waiting)
        return stats

    # callers ---------------------------------------------------------------------------------------

    def submit(self, prompt: Any, max_steps: int, loop: asyncio.AbstractEventLoop | None = None,
               sampling: Sampling | None = None) -> GenerationRequest:
        """Queue a prompt for at most ``max_steps`` outputs, its tokens picked as ``sampling`` says (a
        ``logits=True`` generation; None: greedy); its outputs arrive on the request's stream."""
        g = self.generation
        request = GenerationRequest(g.check_request(self.name, prompt, max_steps, sampling), int(max_steps),
                                    sampling or GREEDY, g.max_length, loop)
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
            if request.ended or request.cancelled:
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

    def outputs(self, request: GenerationRequest, timeout: float | None) -> Generator[Any, None, None]:
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

    async def outputs_async(self, request: GenerationRequest, timeout: float | None) -> AsyncGenerator[Any, None]:
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
        """Admit, step, deliver, in a pipeline: what an iteration computes is delivered by the next one,
        after it has queued its own work, so that the device never waits for the host (JetStream's
        design). A slot is free once its request's last step is queued; a request that ends at ``eos``
        is seen a step late, and the output computed for it meanwhile is dropped."""
        in_flight: list[_Dispatched] = []  # queued on the device, not delivered yet
        while True:
            with self._lock:
                while not (self._busy or self._waiting or in_flight or self._stopping or self._new_params is not None):
                    self._wake.wait()
                if self._stopping and not (self._busy or self._waiting or in_flight):
                    return
                self._free_cancelled()
                if self._new_params is not None and not self._busy:  # no slot runs with the old weights
                    self._params, self._new_params = self._new_params, None
                    self._wake.notify_all()
                free = [slot for slot in range(self.generation.slots) if slot not in self._busy]
                # while new weights wait, nothing is admitted: the slots run empty of the old weights' requests
                admitting = 0 if self._new_params is not None else min(len(free), len(self._waiting))
                admitted = [self._waiting.popleft() for _ in range(admitting)]
                for request, slot in zip(admitted, free):
                    request.slot = slot
                    self._busy[slot] = request
                    request.admitted.set()
                self._stats["max_slots_busy"] = max(self._stats["max_slots_busy"], len(self._busy))
            dispatched: list[_Dispatched] = []
            try:
                if admitted:
                    self._admit(admitted, dispatched)
                self._step(dispatched)
                for item in in_flight:
                    self._deliver(item)
                in_flight = dispatched
            except Exception as error:  # every running request gets it; the loop goes on
                raised_by_model(error)  # prefill or decode, or their compiled code: a 500 over the network
                log.exception("generation server %s: a step failed", self.name)
                with self._lock:
                    self._stats["errors"] += 1
                    hit = [*self._busy.values(), *(r for item in [*in_flight, *dispatched] for r in item.requests)]
                    self._end(hit, error)
                    self._busy.clear()
                    self._carry = self._programs.zeros()
                in_flight = []

    def _free_cancelled(self) -> None:
        """Under the lock: slots whose callers stopped reading are free again."""
        for slot, request in list(self._busy.items()):
            if request.ended or request.cancelled:
                del self._busy[slot]
                self._stats["cancelled"] += 1

    def _queued(self, requests: list[GenerationRequest], outputs: int) -> None:
        """Under the lock: ``outputs`` more outputs of each of ``requests`` are queued; a request whose last
        one is among them gives up its slot (its outputs are on their way)."""
        for request in requests:
            request.dispatched += outputs
            if request.dispatched >= request.needed and self._busy.get(request.slot) is request:
                del self._busy[request.slot]

    def _admit(self, requests: list[GenerationRequest], dispatched: list[_Dispatched]) -> None:
        """Queue the prefills of the admitted prompts, grouped by compiled length, and their writes into
        their slots."""
        g, programs = self.generation, self._programs
        groups: dict[int, list[GenerationRequest]] = {}
        for request in requests:
            length = g.prefill_lengths[bisect.bisect_left(g.prefill_lengths, request.prompt.size)]
            groups.setdefault(length, []).append(request)
        for length, group in groups.items():
            count = g.prefill_batches[bisect.bisect_left(g.prefill_batches, len(group))]
            # padding rows repeat the first prompt, into its slot: written twice, alike
            padded = group + [group[0]] * (count - len(group))
            tokens = np.zeros((count, length), np.int32)
            for row, request in enumerate(padded):
                tokens[row, :request.prompt.size] = request.prompt
            lengths = np.array([request.prompt.size for request in padded], np.int32)
            slots = np.array([request.slot for request in padded], np.int32)
            started = time.perf_counter()
            rows, first = programs.prefill(length, count)(self._params, tokens, lengths)
            sampled = programs.sampled(padded)
            self._carry, outputs = programs.update(count, sampled)(self._carry, rows, first, slots,
                                                                   *programs.option_arrays(padded, sampled))
            with self._lock:
                self._stats["prefills"] += 1
                self._queued(group, 1)
            dispatched.append(_Dispatched(group, list(range(len(group))), _to_host(outputs), started, False))

    def _step(self, dispatched: list[_Dispatched]) -> None:
        """Queue the next ``steps_per_launch`` decode steps of every slot, if any is busy."""
        programs = self._programs
        with self._lock:
            running = sorted(self._busy.items())
            if not running:
                return
            every = [self._busy.get(slot) for slot in range(self.generation.slots)]
            sampled = programs.sampled(every)
            options = programs.option_arrays(every, sampled)
            self._queued([request for _, request in running], self.generation.steps_per_launch)
        started = time.perf_counter()
        self._carry, outputs = programs.steps[sampled](self._params, self._carry, *options)
        dispatched.append(_Dispatched([request for _, request in running], [slot for slot, _ in running],
                                      _to_host(outputs), started, True))

    def _deliver(self, item: _Dispatched) -> None:
        """Once ``item`` is computed, each of its requests' next outputs, in step order; a request that is
        done (its outputs needed, or eos) ends and frees its slot, and what was computed for it after is
        dropped."""
        outputs = owned_host_array(item.outputs)
        if not item.step:
            outputs = outputs[None]  # prefills give one output per prompt: as one step
        steps, rows = outputs.shape[:2]
        # which outputs are an eos, at once: comparing row by row costs more than the rest of the delivery
        at_eos = None if self._eos is None else (outputs[:, :, None] == self._eos).reshape(
            steps, rows, len(self._eos), -1).all(axis=3).any(axis=2)
        now = time.perf_counter()
        finished = []
        deliveries: list[tuple[Stream, Any]] = []
        for request, row in zip(item.requests, item.rows):
            for step in range(steps):
                if request.ended or request.cancelled:
                    break
                request.produced += 1
                deliveries.append((request.stream, outputs[step, row]))
                if request.produced >= request.needed or (at_eos is not None and at_eos[step, row]):
                    deliveries.append((request.stream, END))
                    request.ended = True
                    finished.append(request)
        delivered = len(deliveries) - len(finished)
        put_all(deliveries)
        elapsed = now - max(item.started, self._ready)  # from when the device could start it
        self._ready = now
        with self._lock:
            self._stats["outputs"] += delivered
            if item.step:
                self._stats["steps"] += steps
                self._stats["step_s"] += elapsed
            else:
                self._stats["first_output_s"] += sum(now - r.submitted for r in item.requests)
            for request in finished:
                if self._busy.get(request.slot) is request:
                    del self._busy[request.slot]
        if item.step:
            for _ in range(steps):
                self._tell("step", elapsed / steps)
        else:
            for request in item.requests:
                self._tell("first_output", now - request.submitted)


class _Dispatched(NamedTuple):
    """Outputs queued on the device, for ``requests[i]`` in row ``rows[i]``: ``step``: a launch of decode
    steps, its outputs (steps, slots, ...), queued at ``started``; else the first outputs of admitted
    prompts, one row each."""

    requests: list[GenerationRequest]
    rows: list[int]
    outputs: Any
    started: float
    step: bool


class StopText:
    """A request's stop sequences (OpenAI's and vLLM's ``stop``), applied by the caller to the text pieces a
    ``postprocess`` gives: the text goes out up to the first stop sequence, which ends the request and is
    left out; text that may be the start of one is held back until it is not."""

    def __init__(self, stop: Any) -> None:
        stops = [stop] if isinstance(stop, str | bytes) else list(stop) if isinstance(stop, list | tuple) else []
        if not stops or not all(isinstance(one, str | bytes) and one for one in stops):
            raise OptionError(f"stop must be a non-empty string or a list of them, got {stop!r}")
        self.stops: list[Any] = stops
        self.held: Any = None  # text not sent yet, as it may begin a stop sequence
        self.ended = False

    def feed(self, piece: Any) -> Any:
        """The text that can go out once ``piece`` came (``ended`` once a stop sequence is reached)."""
        if not isinstance(piece, str | bytes):
            raise OptionError(f"stop needs a generation whose postprocess gives text (str or bytes); it gave "
                              f"{type(piece).__name__}")
        if self.held is None:  # the stop sequences in the type of the pieces, once
            self.stops = [one.encode() if isinstance(piece, bytes) and isinstance(one, str) else
                          one.decode() if isinstance(piece, str) and isinstance(one, bytes) else one
                          for one in self.stops]
            self.held = piece[:0]
        text = self.held + piece
        found = [at for at in (text.find(one) for one in self.stops) if at >= 0]
        if found:
            self.ended = True
            return text[:min(found)]
        keep = max((k for one in self.stops for k in range(1, len(one)) if text.endswith(one[:k])), default=0)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep]


class Delivery:
    """What one caller of a generation gets, in the caller: each output through ``postprocess``, and with
    ``stop`` (text pieces only) the text cut at the first stop sequence (:class:`StopText`)."""

    def __init__(self, generation: Generation, stop: Any = None, prompt: Any = None) -> None:
        if stop is not None and generation.postprocess is None and generation.detokenizer is None:
            raise OptionError("stop needs a generation whose postprocess gives text; this one gives its outputs "
                              "as they are")
        self.generation = generation
        self.stop = None if stop is None else StopText(stop)
        # a detokenizer's decoder for this request, which reads the prompt's token ids for context
        self.text = None if generation.detokenizer is None else generation.detokenizer(np.asarray(prompt))

    def of(self, output: Any) -> list[Any]:
        """What the caller gets for ``output``: its piece; with stop sequences, the text that can go out."""
        if self.text is None:
            return self._cut(self.generation.output_of(output))
        text = self.text.feed(output)
        return self._cut(text) if text else []

    def _cut(self, piece: Any) -> list[Any]:
        if self.stop is None:
            return [piece]
        text = self.stop.feed(piece)
        return [text] if text else []

    @property
    def done(self) -> bool:
        """A stop sequence was reached: the caller stops reading, which frees the slot at the next step."""
        return self.stop is not None and self.stop.ended

    def rest(self) -> list[Any]:
        """What was held back when the outputs ended without a stop sequence: a decoder's unfinished text,
        then text that might have begun a stop sequence."""
        tail = "" if self.text is None else self.text.finish()
        items = self._cut(tail) if tail else []
        held = None if self.stop is None or self.stop.ended else self.stop.held
        return [*items, held] if held else items

    def each(self, outputs: Generator[Any, None, None]) -> Generator[Any, None, None]:
        """What the caller gets from a request's ``outputs`` (a server's ``outputs``), one item at a time;
        closed early, or at a stop sequence, it closes them: the request is cancelled now."""
        try:
            for output in outputs:
                yield from self.of(output)
                if self.done:
                    return
            yield from self.rest()
        finally:
            outputs.close()

    async def each_async(self, outputs: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
        """:meth:`each` for a server's ``outputs_async``."""
        try:
            async for output in outputs:
                for item in self.of(output):
                    yield item
                if self.done:
                    return
            for item in self.rest():
                yield item
        finally:
            await outputs.aclose()


def stacked(outputs: Sequence[Any]) -> np.ndarray:
    """A request's outputs on a first axis: arrays stacked; text (bytes or str, from a ``postprocess``) as an
    object array, every piece as it was (a fixed-size bytes array would drop trailing zero bytes); no
    outputs (text cut at a stop sequence before any), an empty object array."""
    if not outputs or isinstance(outputs[0], bytes | str):
        array = np.empty(len(outputs), object)
        array[:] = outputs
        return array
    return np.stack(outputs)


def _stop_outputs(eos: Any, output: Template) -> np.ndarray:
    """``eos`` as the outputs that end a request, stacked (n, *output shape): one output of the shape of
    ``output``, or several (a list of token ids, as models with more than one end token have), in values
    its dtype holds; else a clear error, as an ``eos`` that no output can equal would never stop a request."""
    array = np.asarray(eos)
    if output.shape not in (array.shape, array.shape[1:]) or array.size == 0 or array.dtype.kind not in "biuf" or \
            not np.array_equal(array.astype(output.dtype), array):
        raise OptionError(f"eos must be one output of this generation, {output}, or a list of them; got "
                          f"{eos!r} ({Template(array.shape, array.dtype)})")
    return array.astype(output.dtype).reshape(-1, *output.shape)


def _to_host(outputs: Any) -> Any:
    """``outputs`` on their way to the host: a jax array's copy starts when its computation ends, without
    waiting for it here; anything else (IREE's buffers, numpy) is copied now."""
    if isinstance(outputs, jax.Array):
        outputs.copy_to_host_async()
        return outputs
    return owned_host_array(outputs)
