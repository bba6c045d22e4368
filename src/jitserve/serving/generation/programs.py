"""The compiled programs of one generation server.

Everything compiles at warm-up, and runs once there on idle slots where a
first run costs extra (XLA: a GPU loads a program's kernels, the CPU compiles
them): the prefill per (prompt
length, number of prompts) bucket, the slot update per number of prompts, and
one launch of decode steps, whose state is donated so that XLA updates it in
place; the slot update writes rows with ``dynamic_update_slice`` (a prefill
padded to more prompts repeats the first one into its own slot), which every
compiler lowers in place. The programs take the weights packed into few arrays
(:mod:`jitserve.packed`), as each array a call passes costs the host time at
every step. A generation that gives logits has three of each update and step,
one per way of picking tokens (:mod:`~.picking`): the most likely, sampled
with each row's options, or sampled after each row's penalties with the rows'
log-probabilities (scored), and a program that starts the penalties' counts of
the slots it is given. The host picks the program, as it knows every request's
options: a ``lax.cond`` on the device would be read back to the host by XLA on
a GPU, and the host would wait for each step before it could queue the next;
and a kind costs only the launches that run a request of it. A generation
given a mesh (tensor parallel) runs each program over the mesh's devices, its
weights and its slots' state split as the :class:`~jitserve.mesh.MeshPlacement`
says.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ... import compilers
from ...defn import defn_errors
from ...mesh import STATE, WEIGHTS, MeshLayout
from ...packed import PackedLayout, transposed_reads
from ...template import Template, is_template
from ..serving import owned_host_array
from ..warmup import Step
from .picking import greedy_tokens, sample_tokens, score_tokens, seeded
from .spec import GREEDY, GREEDY_KIND, SAMPLED_KIND, SCORED_KIND, Generation, Sampling, stop_outputs

NOT_A_TOKEN = 2**31 - 1  # pads a row of held ids and of sequences: past any vocabulary, so never a token
KIND = ("", ", sampled", ", scored")  # how warm-up names a program that picks tokens of each kind
# per kind, the options its programs take per row: sampling's, then the penalties' (see Programs._arrays)
OPTIONS = {GREEDY_KIND: 0, SAMPLED_KIND: 10, SCORED_KIND: 13}


class Launch(NamedTuple):
    """What a program call takes, made on the host: the ``kind`` of program that picks its tokens, its
    ``arrays``, and those of the penalties' counts it starts first (``seeds``; None: none)."""

    kind: int
    arrays: list[np.ndarray]
    seeds: list[np.ndarray] | None = None


class Programs:
    """The compiled functions of one generation server: prefills per bucket, slot updates, one launch of
    decode steps; each takes the weights packed and placed (:meth:`place`) and the slots' carry (the
    decode state of every slot, its last outputs and, for a generation that gives logits, the penalties'
    counts ``seen``), and gives the next carry and the outputs (the tokens, and a scored program's
    log-probabilities and top tokens)."""

    def __init__(self, generation: Generation, options: dict[str, Any], on_compile: Callable[[], None]) -> None:
        self._common(generation, options, on_compile)
        g = generation
        assert g.prefill is not None and g.decode is not None  # a Generation without a paged cache has both
        self.user_prefill, self.user_decode = g.prefill, g.decode
        self.updates: dict[tuple[int, int], Callable[..., Any]] = {}
        # what prefill gives per prompt: a state row, and an output or logits
        self.row_template, self.first_template, self.output_template = g.shapes()
        output = self.output_template
        stacked = jax.tree_util.tree_map(lambda t: Template((g.slots, *t.shape), t.dtype), self.row_template,
                                         is_leaf=is_template)
        self.vocabulary = self.first_template.shape[-1] if g.logits else None  # the width of its logits
        self.carry_template = (stacked, Template((g.slots, *output.shape), output.dtype),
                               *(self._seen(self.vocabulary) if self.vocabulary is not None else []))
        self.sequence_width = g.prefill_lengths[-1]  # the longest sequence a slot's counts start from
        self.steps: dict[int, Callable[..., Any]] = {}
        self._take_weights(g.decode, stacked, self.carry_template[1])

    def _take_weights(self, step: Callable[..., Any], *templates: Any) -> None:
        """How the programs take the weights: packed, the matrices the decode ``step`` (given the templates of
        its other arguments) reads only transposed kept transposed (see :mod:`jitserve.packed`), and placed
        on the generation's mesh, if it has one."""
        g = self.generation
        transposed = transposed_reads(step, g.params_template, *templates) if self.compiler.compiles else ()
        self.layout = PackedLayout(g.params_template, transposed)
        self.mesh = None if g.mesh is None else MeshLayout(g.mesh, self.layout)  # None: one device

    def _common(self, generation: Generation, options: dict[str, Any], on_compile: Callable[[], None]) -> None:
        """What the programs of both engines keep: the generation, its compiler and options, how they take the
        weights, and how they pick tokens."""
        self.generation = generation
        self.compiler = compilers.get(generation.compiler_name)
        self.options = options
        self.on_compile = on_compile
        self.prefills: dict[tuple[int, int], Callable[..., Any]] = {}
        self.seeding: Callable[..., Any] | None = None
        # picking tokens is jitserve's code: compiled with the step, or on its own beside functions run as written
        self.pickers: tuple[Callable[..., Any], ...] = (greedy_tokens, sample_tokens, score_tokens) \
            if self.compiler.compiles else \
            (jax.jit(greedy_tokens), jax.jit(sample_tokens), jax.jit(score_tokens))
        # a logits generation has a program of each kind, greedy (no options, nothing sorted), sampled and
        # scored; the host picks one per step: a lax.cond would make the host wait for the device on a GPU (XLA
        # reads the predicate back), and the pipeline would stall
        self.kinds = tuple(OPTIONS) if generation.logits else (GREEDY_KIND,)
        # the ids a request's min_tokens holds back, before its own stop ids: the generation's eos
        self.eos_ids = [] if generation.eos is None or not generation.logits else \
            [int(i) for i in stop_outputs(generation.eos, Template((), np.int32)).reshape(-1)]
        # the carry's roles on a mesh: the state rows split, the last outputs and the counts replicated
        self.carry_roles = (STATE, None, None) if generation.logits else (STATE, None)

    def _seen(self, vocabulary: int) -> list[Template]:
        """The carry's penalties' counts (slots, vocabulary), which a generation that gives logits keeps (see
        :mod:`~.picking`)."""
        return [Template((self.generation.slots, vocabulary), np.int32)]

    def place(self, params: Any) -> Any:
        """``params`` packed as the programs take them, on the server's device."""
        if self.mesh is not None:
            return self.mesh.place(self.layout.pack(params))
        return self.compiler.place(self.layout.pack(params), self.options)

    def _option_templates(self, rows: int, kind: int) -> list[Template]:
        """The templates of the options a program of ``kind`` takes for ``rows`` sequences: those of
        :meth:`_arrays`' (for greedy rows), the one place that says each option's dtype."""
        return [Template(array.shape, array.dtype) for array in self._arrays([GREEDY] * rows, [0] * rows, kind)]

    def _arrays(self, samplings: Sequence[Sampling], positions: Sequence[int], kind: int) -> list[np.ndarray]:
        """The options a program of ``kind`` takes: none for a greedy one; each row's temperature, top_k, top_p,
        min_p, seed, min_tokens, the ids it holds back until then (``eos`` and its stop ids), the ids of its logit
        bias and their biases, and position (the number of its step); then, for a scored one, its repetition,
        presence and frequency penalties. A generation that gives outputs has only the greedy program: its
        requests are greedy (:meth:`~.spec.Generation.check_request`)."""
        if kind == GREEDY_KIND:
            return []
        held = np.full((len(samplings), len(self.eos_ids) + Sampling.MAX_STOP_IDS), NOT_A_TOKEN, np.int32)
        bias_ids = np.full((len(samplings), Sampling.MAX_LOGIT_BIAS), NOT_A_TOKEN, np.int32)
        biases = np.zeros((len(samplings), Sampling.MAX_LOGIT_BIAS), np.float32)
        for row, sampling in enumerate(samplings):
            if sampling.min_tokens:
                ids = [*self.eos_ids, *sampling.stop_token_ids]
                held[row, :len(ids)] = ids
            if sampling.logit_bias:
                bias_ids[row, :len(sampling.logit_bias)], biases[row, :len(sampling.logit_bias)] = \
                    zip(*sampling.logit_bias)
        arrays = [np.array([s.temperature for s in samplings], np.float32),
                  np.array([s.top_k for s in samplings], np.int32), np.array([s.top_p for s in samplings], np.float32),
                  np.array([s.min_p for s in samplings], np.float32), np.array([s.seed for s in samplings], np.uint32),
                  np.array([s.min_tokens for s in samplings], np.int32), held, bias_ids, biases,
                  np.array(positions, np.int32)]
        if kind == SCORED_KIND:
            arrays += [np.array([getattr(s, name) for s in samplings], np.float32)
                       for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")]
        return arrays

    @staticmethod
    def kind_of(samplings: Sequence[Sampling]) -> int:
        """The kind of program that picks the tokens of all of ``samplings``: the most any of them needs."""
        return max(sampling.kind for sampling in samplings)

    def _picked(self, logits: Any, seen: list[Any], slots: Any, options: Sequence[Any], kind: int
                ) -> tuple[Any, tuple[Any, ...], list[Any]]:
        """The tokens a program of ``kind`` picks from ``logits`` given ``options`` (the rows' slots:
        ``slots``, None for every slot in order), what else it gives its callers (a scored program's
        log-probabilities and top tokens), and the carry's counts (``seen``: none, or one array) after them;
        a generation that gives outputs gives them as they are."""
        if not self.generation.logits:
            return logits, (), seen
        if kind != SCORED_KIND:
            return self.pickers[kind](logits, *options), (), seen
        chosen, logprobs, tokens, counts = self.pickers[kind](logits, seen[0], slots, *options)
        return chosen, (logprobs, tokens), [counts]

    @staticmethod
    def _stepped(options: Sequence[Any], step: int) -> list[Any]:
        """``options`` for the ``step``-th step of a launch: each row's step number counts on (it follows the
        sampling options, before the penalties)."""
        if not options:
            return []
        at = OPTIONS[SAMPLED_KIND] - 1
        return [*options[:at], options[at] + step, *options[at + 1:]]

    def _stack(self, outputs: list[tuple[Any, ...]]) -> tuple[Any, ...]:
        """Each step's outputs (a tuple per step) stacked on a first axis, in buffers of their own."""
        if self.compiler.compiles:
            return tuple(jnp.stack(parts) for parts in zip(*outputs))
        return tuple(np.stack([np.asarray(part) for part in parts]) for parts in zip(*outputs))

    def _compile(self, fn: Callable[..., Any], templates: list[Any], takes: tuple[Any, ...],
                 gives: tuple[Any, ...], donate: tuple[int, ...] = ()) -> Any:
        """``fn`` compiled for ``templates``; on a mesh, its arguments and results placed as the roles
        ``takes`` and ``gives`` say (see :meth:`~jitserve.mesh.MeshLayout.shardings`)."""
        with defn_errors():
            if self.mesh is None:
                executable = self.compiler.compile(fn, templates, self.options, donate=donate)
            else:
                shardings = (self.mesh.shardings(takes, len(templates)), self.mesh.shardings(gives))
                executable = self.compiler.compile_sharded(fn, templates, self.options, shardings, donate=donate)
        if self.compiler.compiles:
            self.on_compile()
        return executable.run

    def prefill(self, length: int, count: int) -> Callable[..., Any]:
        key = (length, count)
        run = self.prefills.get(key)
        if run is None:
            templates = [self.layout.templates, Template((count, length), np.int32),
                         Template((count,), np.int32)]
            run = self.prefills[key] = self._compile(self._prefills, templates, (WEIGHTS,), (STATE, None))
        return run

    def _prefills(self, packed: Any, tokens: Any, lengths: Any) -> Any:
        """The prefills of several prompts, stacked: by ``jax.vmap`` where the compiler traces them, else one
        by one (functions run as written on numpy, which ``jax.vmap`` cannot batch)."""
        params = self.layout.unpack(packed)
        if self.compiler.compiles:
            return jax.vmap(self.user_prefill, in_axes=(None, 0, 0))(params, tokens, lengths)
        rows = [self.user_prefill(params, tokens[i], lengths[i]) for i in range(len(lengths))]
        return jax.tree_util.tree_map(lambda *leaves: np.stack([np.asarray(leaf) for leaf in leaves]), *rows)

    def update(self, count: int, kind: int) -> Callable[..., Any]:
        """The write of ``count`` prefilled rows into their slots, picking their first outputs as a program of
        ``kind`` does."""
        run = self.updates.get((count, kind))
        if run is None:
            def write(carry: Any, rows: Any, first: Any, slots: Any, *options: Any) -> Any:
                def put(stacked: Any, new: Any) -> Any:  # row i into slot slots[i], in place (no scatter)
                    stacked = jnp.asarray(stacked)
                    for i in range(count):
                        stacked = jax.lax.dynamic_update_index_in_dim(stacked, new[i], slots[i], axis=0)
                    return stacked

                state, last, *seen = carry
                outputs, scores, seen = self._picked(first, seen, slots, options, kind)
                return (jax.tree_util.tree_map(put, state, rows), put(last, outputs), *seen), (outputs, *scores)

            rows = jax.tree_util.tree_map(lambda t: Template((count, *t.shape), t.dtype), self.row_template,
                                          is_leaf=is_template)
            first = Template((count, *self.first_template.shape), self.first_template.dtype)
            run = self.updates[count, kind] = self._compile(
                write, [self.carry_template, rows, first, Template((count,), np.int32),
                        *self._option_templates(count, kind)], (self.carry_roles, STATE),
                (self.carry_roles, None), donate=(0,))
        return run

    def step_program(self, kind: int) -> Callable[..., Any]:
        """The launch of ``steps_per_launch`` decode steps of every slot, picking tokens as a program of
        ``kind`` does: the next carry, and each step's outputs stacked (steps, slots, ...) in buffers of their
        own, which the host reads while the next launch (given the carry, donated) runs."""
        run = self.steps.get(kind)
        if run is None:
            def launch(packed: Any, carry: Any, *options: Any) -> Any:
                params = self.layout.unpack(packed)
                outputs = []
                for step in range(self.generation.steps_per_launch):
                    state, last, *seen = carry
                    state, logits_or_outputs = self.user_decode(params, state, last)
                    chosen, scores, seen = self._picked(logits_or_outputs, seen, None, self._stepped(options, step),
                                                        kind)
                    carry = (state, chosen, *seen)
                    outputs.append((chosen, *scores))
                return carry, self._stack(outputs)

            run = self.steps[kind] = self._compile(
                launch, [self.layout.templates, self.carry_template,
                         *self._option_templates(self.generation.slots, kind)],
                (WEIGHTS, self.carry_roles), (self.carry_roles, None), donate=(1,))
        return run

    def seed_program(self) -> Callable[..., Any]:
        """The start of the penalties' counts of the slots of up to a prefill's most prompts, from their
        sequences (see :func:`~.picking.seeded`)."""
        if self.seeding is None:
            rows = self.generation.prefill_batches[-1]

            def seed(carry: Any, slots: Any, sequences: Any, prompt_sizes: Any) -> Any:
                *kept, seen = carry
                return (*kept, seeded(seen, slots, sequences, prompt_sizes))

            self.seeding = self._compile(seed, [self.carry_template, Template((rows,), np.int32),
                                                Template((rows, self.sequence_width), np.int32),
                                                Template((rows,), np.int32)],
                                         (self.carry_roles,), self.carry_roles, donate=(0,))
        return self.seeding

    def _seeds(self, requests: Sequence[Any]) -> list[np.ndarray] | None:
        """What :meth:`seed_program` takes to start the counts of those of ``requests`` that ask for penalties,
        from their prompts and outputs so far (a sequence prefilled again); None if none does."""
        penalized = [request for request in requests if request.sampling.penalized]
        if not penalized:
            return None
        rows = self.generation.prefill_batches[-1]
        slots = np.full(rows, self.generation.slots, np.int32)
        sequences = np.full((rows, self.sequence_width), NOT_A_TOKEN, np.int32)
        sizes = np.zeros(rows, np.int32)
        for row, request in enumerate(penalized):
            sequence = [*request.prompt.tolist(), *(request.history or ())]
            slots[row], sizes[row] = request.slot, request.prompt.size
            sequences[row, :len(sequence)] = sequence
        return [slots, sequences, sizes]

    def _seeded(self, carry: Any, launch: Launch) -> Any:
        """``carry`` with the counts ``launch`` starts, if any (queued before its program)."""
        return carry if launch.seeds is None else self.seed_program()(carry, *launch.seeds)

    def warm_up_steps(self) -> list[Step]:
        """What warm-up compiles, one program a step (:func:`~jitserve.serving.warmup.compile_each`): every
        prefill bucket, every slot update and the decode launch, of each kind, and the penalties' start."""
        g = self.generation
        launch = "a decode step" if g.steps_per_launch == 1 else f"{g.steps_per_launch} decode steps a launch"
        return [*[(f"the prefill of {count} prompt{'s' * (count > 1)} of {length} tokens",
                   functools.partial(self.prefill, length, count))
                  for length in g.prefill_lengths for count in g.prefill_batches],
                *[(f"the slot update of {count} prompt{'s' * (count > 1)}{KIND[kind]}",
                   functools.partial(self.update, count, kind))
                  for count in g.prefill_batches for kind in self.kinds],
                *[(f"{launch} of {g.slots} slots{KIND[kind]}", functools.partial(self.step_program, kind))
                  for kind in self.kinds], *self._seed_step()]

    def _seed_step(self) -> list[Step]:
        """The compile of the penalties' start, for a generation that gives logits."""
        if not self.generation.logits:
            return []
        rows = self.generation.prefill_batches[-1]
        return [(f"the penalties' counts of {rows} prompt{'s' * (rows > 1)}", self.seed_program)]

    def run_each_once(self, params: Any) -> None:
        """Run every compiled program once, on idle slots of a scratch carry: a GPU loads a program's
        kernels and builds its command buffers on its first run, and XLA's CPU runtime compiles them then,
        which is then not on a request's time."""
        g = self.generation
        carry = self._run_seed_once(self.zeros())
        for count in g.prefill_batches:
            for length in g.prefill_lengths:
                rows, first = self.prefill(length, count)(params, np.zeros((count, length), np.int32),
                                                          np.ones(count, np.int32))
            for kind in self.kinds:
                carry, _ = self.update(count, kind)(carry, rows, first, np.arange(count, dtype=np.int32),
                                                    *self._idle(count, kind))
        for kind in self.kinds:
            carry, outputs = self.step_program(kind)(params, carry, *self._idle(g.slots, kind))
        owned_host_array(outputs[0])  # waits for the runs, which all end in it

    def _run_seed_once(self, carry: Any) -> Any:
        """``carry`` after a run of the penalties' start on no slot (those past the last), where there is one."""
        if not self.generation.logits:
            return carry
        rows = self.generation.prefill_batches[-1]
        return self.seed_program()(carry, np.full(rows, self.generation.slots, np.int32),
                                   np.zeros((rows, self.sequence_width), np.int32), np.zeros(rows, np.int32))

    def _idle(self, rows: int, kind: int) -> list[np.ndarray]:
        """The options of a program of ``kind`` for ``rows`` idle rows (greedy, at their first step)."""
        return self._arrays([GREEDY] * rows, [0] * rows, kind)

    def prefill_inputs(self, prefill: Any) -> Launch:
        """What :meth:`prefill_of` takes for a plan's prefill (a :class:`~.scheduler.Prefill`), made on the
        host: its padded prompts' tokens, zeros after each up to its compiled length, their lengths, their
        slots, and their samplings' options unless all are greedy; and the penalties' counts to start."""
        padded = prefill.padded
        count = len(padded)
        tokens = np.zeros((count, prefill.length), np.int32)
        for row, request in enumerate(padded):
            tokens[row, :request.prompt.size] = request.prompt
        samplings = [request.sampling for request in padded]
        kind = self.kind_of(samplings)
        options = self._arrays(samplings, [0] * count, kind)  # a prompt's first output is its step 0
        return Launch(kind, [tokens, np.array([r.prompt.size for r in padded], np.int32),
                             np.array([r.slot for r in padded], np.int32), *options], self._seeds(prefill.requests))

    def prefill_of(self, params: Any, carry: Any, inputs: Launch) -> tuple[Any, Any]:
        """Queue the prefill :meth:`prefill_inputs` made and the write of its rows into their slots, their
        first outputs picked as its kind does: the next carry, and its outputs (a tuple: the tokens, then a
        scored program's log-probabilities and top tokens)."""
        tokens, lengths, slots, *options = inputs.arrays
        count, length = tokens.shape
        rows, first = self.prefill(length, count)(params, tokens, lengths)
        return self.update(count, inputs.kind)(self._seeded(carry, inputs), rows, first, slots, *options)

    def step_inputs(self, step: Any) -> Launch:
        """What :meth:`step_of` takes for a plan's decode launch (a :class:`~.scheduler.Step`): nothing for a
        greedy launch, else each slot's options from its samplings and positions."""
        if step.samplings is None or step.positions is None:
            return Launch(GREEDY_KIND, [])
        kind = self.kind_of(step.samplings)
        return Launch(kind, self._arrays(step.samplings, step.positions, kind))

    def step_of(self, params: Any, carry: Any, inputs: Launch) -> tuple[Any, Any]:
        """Queue a launch of decode steps of every slot, picking as ``inputs`` (:meth:`step_inputs`) say: the
        next carry, and the outputs (a tuple: the tokens (steps, slots, ...), then a scored program's
        log-probabilities and top tokens)."""
        return self.step_program(inputs.kind)(params, carry, *inputs.arrays)

    def zeros(self) -> Any:
        return jax.tree_util.tree_map(lambda t: t.zeros(), self.carry_template, is_leaf=is_template)


def to_host(outputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """A program's ``outputs`` (a tuple of arrays) on their way to the host: a jax array's copy starts when
    its computation ends, without waiting for it here; anything else (IREE's buffers, numpy) is copied now."""
    return tuple(_to_host(output) for output in outputs)


def _to_host(output: Any) -> Any:
    if isinstance(output, jax.Array):
        output.copy_to_host_async()
        return output
    return owned_host_array(output)
