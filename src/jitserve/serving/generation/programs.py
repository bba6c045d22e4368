"""The compiled programs of one generation server, and how they pick tokens.

Everything compiles at warm-up, and on a GPU runs once there on idle slots
(a GPU's first run of a program loads its kernels): the prefill per (prompt
length, number of prompts) bucket, the slot update per number of prompts, and
one launch of decode steps, whose state is donated so that XLA updates it in
place; the slot update writes rows with ``dynamic_update_slice`` (a prefill
padded to more prompts repeats the first one into its own slot), which every
compiler lowers in place. The programs take the weights packed into few arrays
(:mod:`jitserve.packed`), as each array a call passes costs the host time at
every step. A generation that gives logits has two of each update and step:
one picks the most likely tokens (:func:`greedy_tokens`), the other samples
with each row's options (:func:`sample_tokens`). The host picks the program,
as it knows every request's options: a ``lax.cond`` on the device would be read
back to the host by XLA on a GPU, and the host would wait for each step before
it could queue the next. A generation given a mesh (tensor parallel) runs each
program over the mesh's devices, its weights and its slots' state split as the
:class:`~jitserve.mesh.MeshPlacement` says.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ... import compilers
from ...defn import defn_errors
from ...mesh import STATE, WEIGHTS, MeshLayout
from ...packed import PackedLayout
from ...template import Template, is_template
from ..serving import owned_host_array
from ..warmup import Step
from .spec import GREEDY, Generation, Sampling, stop_outputs


def greedy_tokens(logits: Any) -> Any:
    """The most likely token of each row of ``logits`` (rows, vocabulary)."""
    return jnp.argmax(jnp.asarray(logits, jnp.float32), axis=-1).astype(jnp.int32)


def sample_tokens(logits: Any, temperature: Any, top_k: Any, top_p: Any, seed: Any, min_tokens: Any, held: Any,
                  step: Any) -> Any:
    """One token per row of ``logits`` (rows, vocabulary): the most likely where ``temperature`` is 0,
    else drawn from that row's top-k / top-p distribution at its temperature with the key
    ``fold_in(PRNGKey(seed), step)``: a row's token depends on its own row and options only. While a row's
    ``step`` is below its ``min_tokens``, the ids of its row of ``held`` (padded with ids past the
    vocabulary) are never picked."""
    logits = jnp.asarray(logits, jnp.float32)
    rows, vocabulary = logits.shape
    banned = jnp.zeros((rows, vocabulary), bool).at[jnp.arange(rows)[:, None], held].set(True, mode="drop")
    logits = jnp.where(banned & (step < min_tokens)[:, None], -jnp.inf, logits)

    def draw(row: Any, temperature: Any, top_k: Any, top_p: Any, seed: Any, step: Any) -> Any:
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


NOT_A_TOKEN = 2**31 - 1  # pads a row of held ids: past any vocabulary, so never a token
KIND = {False: "", True: ", sampled"}  # how warm-up names a program that picks tokens greedily or samples them
CARRY = (STATE, None)  # the slots' carry: their state rows, and their last outputs (replicated on a mesh)


class Programs:
    """The compiled functions of one generation server: prefills per bucket, slot updates, one launch of
    decode steps; each takes the weights packed and placed (:meth:`place`) and the slots' carry (the
    decode state of every slot and its last outputs), and gives the next carry and the outputs."""

    def __init__(self, generation: Generation, options: dict[str, Any], on_compile: Callable[[], None]) -> None:
        self._common(generation, options, on_compile)
        g = generation
        assert g.prefill is not None and g.decode is not None  # a Generation without a paged cache has both
        self.user_prefill, self.user_decode = g.prefill, g.decode
        self.updates: dict[tuple[int, bool], Callable[..., Any]] = {}
        # what prefill gives per prompt: a state row, and an output or logits
        self.row_template, self.first_template, self.output_template = g.shapes()
        output = self.output_template
        stacked = jax.tree_util.tree_map(lambda t: Template((g.slots, *t.shape), t.dtype), self.row_template,
                                         is_leaf=is_template)
        self.carry_template = (stacked, Template((g.slots, *output.shape), output.dtype))
        self.steps: dict[bool, Callable[..., Any]] = {}

    def _common(self, generation: Generation, options: dict[str, Any], on_compile: Callable[[], None]) -> None:
        """What the programs of both engines keep: the generation, its compiler and options, how they take the
        weights, and how they pick tokens."""
        self.generation = generation
        self.compiler = compilers.get(generation.compiler_name)
        self.options = options
        self.on_compile = on_compile
        self.prefills: dict[tuple[int, int], Callable[..., Any]] = {}
        # picking tokens is jitserve's code: compiled with the step, or on its own beside functions run as written
        self.greedy, self.sample = ((greedy_tokens, sample_tokens) if self.compiler.compiles
                                    else (jax.jit(greedy_tokens), jax.jit(sample_tokens)))
        # a logits generation has a program of each kind, greedy (no options, nothing sorted) and sampled; the
        # host picks one per step: a lax.cond would make the host wait for the device on a GPU (XLA reads the
        # predicate back), and the pipeline would stall
        self.kinds = (False, True) if generation.logits else (False,)
        self.layout = PackedLayout(generation.params_template)  # the programs take the weights packed
        # the ids a request's min_tokens holds back, before its own stop ids: the generation's eos
        self.eos_ids = [] if generation.eos is None or not generation.logits else \
            [int(i) for i in stop_outputs(generation.eos, Template((), np.int32)).reshape(-1)]
        self.mesh = None if generation.mesh is None else MeshLayout(generation.mesh, self.layout)  # None: one device

    def place(self, params: Any) -> Any:
        """``params`` packed as the programs take them, on the server's device."""
        if self.mesh is not None:
            return self.mesh.place(self.layout.pack(params))
        return self.compiler.place(self.layout.pack(params), self.options)

    def _option_templates(self, rows: int, sampled: bool) -> list[Template]:
        """The templates of the sampling options of ``rows`` sequences (see :meth:`_arrays`); none unless
        the program samples."""
        if not sampled:
            return []
        return [*(Template((rows,), dtype) for dtype in (np.float32, np.int32, np.float32, np.uint32, np.int32)),
                Template((rows, len(self.eos_ids) + Sampling.MAX_STOP_IDS), np.int32), Template((rows,), np.int32)]

    def _arrays(self, samplings: Sequence[Sampling], positions: Sequence[int]) -> list[np.ndarray]:
        """The options a sampling program takes: each row's temperature, top_k, top_p, seed, min_tokens, the
        ids it holds back until then (``eos`` and its stop ids), and position (the number of its step). A
        generation that gives outputs has no such program: its requests are greedy
        (:meth:`~.spec.Generation.check_request`)."""
        held = np.full((len(samplings), len(self.eos_ids) + Sampling.MAX_STOP_IDS), NOT_A_TOKEN, np.int32)
        for row, sampling in enumerate(samplings):
            if sampling.min_tokens:
                ids = [*self.eos_ids, *sampling.stop_token_ids]
                held[row, :len(ids)] = ids
        return [np.array([s.temperature for s in samplings], np.float32),
                np.array([s.top_k for s in samplings], np.int32), np.array([s.top_p for s in samplings], np.float32),
                np.array([s.seed for s in samplings], np.uint32), np.array([s.min_tokens for s in samplings], np.int32),
                held, np.array(positions, np.int32)]

    def _chosen(self, outputs: Any, options: Sequence[Any]) -> Any:
        """The outputs a step gives its callers and the next step: the tokens picked from the logits
        (:func:`sample_tokens` given ``options``, else :func:`greedy_tokens`), or the outputs as they are."""
        if not self.generation.logits:
            return outputs
        return self.sample(outputs, *options) if options else self.greedy(outputs)

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

    def _steps(self, packed: Any, carry: Any, *options: Any) -> Any:
        """``steps_per_launch`` decode steps, one after the other: the next carry, and each step's outputs
        stacked (steps, slots, ...) in a buffer of their own, which the host reads while the next launch
        (given the carry, donated) runs; ``options``: the sampling options, if the program samples (the
        rows' step numbers counting on from the first step's)."""
        params = self.layout.unpack(packed)
        outputs = []
        for step in range(self.generation.steps_per_launch):
            state, last = carry
            state, logits_or_outputs = self.user_decode(params, state, last)
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
                        *self._option_templates(count, sampled)], (CARRY, STATE), (CARRY, None), donate=(0,))
        return run

    def step_program(self, sampled: bool) -> Callable[..., Any]:
        """The launch of ``steps_per_launch`` decode steps of every slot, picking tokens sampled or not."""
        run = self.steps.get(sampled)
        if run is None:
            run = self.steps[sampled] = self._compile(
                self._steps, [self.layout.templates, self.carry_template,
                              *self._option_templates(self.generation.slots, sampled)],
                (WEIGHTS, CARRY), (CARRY, None), donate=(1,))
        return run

    def warm_up_steps(self) -> list[Step]:
        """What warm-up compiles, one program a step (:func:`~jitserve.serving.warmup.compile_each`): every
        prefill bucket, every slot update and the decode launch, greedy and sampled."""
        g = self.generation
        launch = "a decode step" if g.steps_per_launch == 1 else f"{g.steps_per_launch} decode steps a launch"
        return [*[(f"the prefill of {count} prompt{'s' * (count > 1)} of {length} tokens",
                   functools.partial(self.prefill, length, count))
                  for length in g.prefill_lengths for count in g.prefill_batches],
                *[(f"the slot update of {count} prompt{'s' * (count > 1)}{KIND[sampled]}",
                   functools.partial(self.update, count, sampled))
                  for count in g.prefill_batches for sampled in self.kinds],
                *[(f"{launch} of {g.slots} slots{KIND[sampled]}", functools.partial(self.step_program, sampled))
                  for sampled in self.kinds]]

    def run_each_once(self, params: Any) -> None:
        """Run every compiled program once, on idle slots of a scratch carry: a GPU loads a program's
        kernels and builds its command buffers on its first run, which is then not on a request's time."""
        g = self.generation
        carry = self.zeros()
        for count in g.prefill_batches:
            for length in g.prefill_lengths:
                rows, first = self.prefill(length, count)(params, np.zeros((count, length), np.int32),
                                                          np.ones(count, np.int32))
            for sampled in self.kinds:
                carry, _ = self.update(count, sampled)(carry, rows, first, np.arange(count, dtype=np.int32),
                                                       *self._idle(count, sampled))
        for sampled in self.kinds:
            carry, outputs = self.step_program(sampled)(params, carry, *self._idle(g.slots, sampled))
        owned_host_array(outputs)  # waits for the runs, which all end in it

    def _idle(self, rows: int, sampled: bool) -> list[np.ndarray]:
        """The options of a program of kind ``sampled`` for ``rows`` idle rows (greedy, at their first step)."""
        return self._arrays([GREEDY] * rows, [0] * rows) if sampled else []

    def prefill_inputs(self, prefill: Any) -> list[np.ndarray]:
        """What :meth:`prefill_of` takes for a plan's prefill (a :class:`~.scheduler.Prefill`), made on the
        host: its padded prompts' tokens, zeros after each up to its compiled length, their lengths, their
        slots, and their samplings' options unless all are greedy."""
        padded = prefill.padded
        count = len(padded)
        tokens = np.zeros((count, prefill.length), np.int32)
        for row, request in enumerate(padded):
            tokens[row, :request.prompt.size] = request.prompt
        samplings = [request.sampling for request in padded]
        sampled = any(not sampling.plain for sampling in samplings)
        options = self._arrays(samplings, [0] * count) if sampled else []  # a prompt's first output is its step 0
        return [tokens, np.array([r.prompt.size for r in padded], np.int32), np.array([r.slot for r in padded],
                                                                                       np.int32), *options]

    def prefill_of(self, params: Any, carry: Any, inputs: list[np.ndarray]) -> tuple[Any, Any]:
        """Queue the prefill :meth:`prefill_inputs` made and the write of its rows into their slots, their
        first outputs picked greedily or as its options say: the next carry, and those outputs."""
        tokens, lengths, slots, *options = inputs
        count, length = tokens.shape
        rows, first = self.prefill(length, count)(params, tokens, lengths)
        return self.update(count, bool(options))(carry, rows, first, slots, *options)

    def step_inputs(self, step: Any) -> list[np.ndarray]:
        """What :meth:`step_of` takes for a plan's decode launch (a :class:`~.scheduler.Step`): nothing for a
        greedy launch, else each slot's options from its samplings and positions."""
        if step.samplings is None or step.positions is None:
            return []
        return self._arrays(step.samplings, step.positions)

    def step_of(self, params: Any, carry: Any, inputs: list[np.ndarray]) -> tuple[Any, Any]:
        """Queue a launch of decode steps of every slot, greedy or picking as ``inputs``
        (:meth:`step_inputs`) say: the next carry, and the outputs (steps, slots, ...)."""
        return self.step_program(bool(inputs))(params, carry, *inputs)

    def zeros(self) -> Any:
        return jax.tree_util.tree_map(lambda t: t.zeros(), self.carry_template, is_leaf=is_template)


def to_host(outputs: Any) -> Any:
    """``outputs`` on their way to the host: a jax array's copy starts when its computation ends, without
    waiting for it here; anything else (IREE's buffers, numpy) is copied now."""
    if isinstance(outputs, jax.Array):
        outputs.copy_to_host_async()
        return outputs
    return owned_host_array(outputs)
