"""The compiled programs of a generation with a paged KV cache.

The carry on the device is the pool of every layer's keys and values (``{"k":
..., "v": ...}``, each (layers, blocks x block size, kv heads, head dim)),
each slot's last output and the penalties' counts (see :mod:`~.picking`).
The user's (or a checkpoint family's) one function

    forward(params, cache, tokens, positions, tables, last) -> (cache, logits)

runs rows of tokens (rows, n) at their ``positions`` (rows, n): it writes each
token's keys and values at its position through its row's block table
(``tables``, (rows, blocks): position p lives in block ``tables[row, p //
block_size]`` at ``p % block_size``; a position past the table's width goes to
the reserved block 0), attends over the positions up to its own, and gives the
logits of each row's token ``last[row]``. One function serves both kinds of
program, each compiled ahead for every size it runs at:

- a prefill: a compiled number of prompts' chunks of a compiled length, the
  table as wide as ``max_length``; a chunk that ends its prompt picks the
  request's first output into its slot, scored (sampled or greedy per row,
  after its penalties, with its log-probabilities): a chunk's pick costs
  little beside its forward;
- a decode launch: the last output of each sequence that decodes, one
  position each, for ``steps_per_launch`` steps, in a compiled number of rows
  (the fewest that hold them: one sequence alone runs one row, not one per
  slot), each row gathering its slot's last output and giving its slot the
  next, the table as wide as ``max_length``: attention reads only the blocks
  the sequences hold (the families' ``paged_attend``), so no program is
  compiled per table width.

The pool is donated to each program, so XLA writes it in place. A paged
generation runs on one device (its programs name no mesh roles).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...template import Template, is_template
from ..serving import owned_host_array
from ..warmup import Step
from .paged_scheduler import Chunk, PagedStep
from .picking import score_tokens
from .programs import KIND, Launch, Programs
from .spec import SCORED_KIND, Generation


class PagedPrograms(Programs):
    """The prefills per (rows, chunk length) and the decode launches per number of rows of a paged generation
    (see the module); the same entry points as the slot engine's :class:`~.programs.Programs`."""

    def __init__(self, generation: Generation, options: dict[str, Any], on_compile: Callable[[], None]) -> None:
        cache = generation.cache
        assert cache is not None and generation.forward is not None
        self._common(generation, options, on_compile)
        self.forward = generation.forward
        self.max_blocks = cache.table_blocks(generation.max_length)
        self.decode_rows = cache.decode_rows(generation.slots)
        pool = Template((cache.layers, cache.blocks(generation.max_length) * cache.block_size, cache.kv_heads,
                         cache.head_dim), cache.dtype)
        self.output_template = Template((), np.int32)
        one = Template((1, 1), np.int32)
        one_token = ({"k": pool, "v": pool}, one, one, one, Template((1,), np.int32))  # forward's other arguments
        self.vocabulary: int | None = self._vocabulary(one_token)
        self.carry_template = ({"k": pool, "v": pool}, Template((generation.slots,), np.int32),
                               *self._seen(self.vocabulary))
        self.sequence_width = generation.max_length  # a preempted sequence starts its counts from its outputs too
        self.decodes: dict[tuple[int, int], Callable[..., Any]] = {}
        self._take_weights(self.forward, *one_token)

    def _vocabulary(self, one_token: tuple[Any, ...]) -> int:
        """The width of the logits ``forward`` gives (traced for one token, not run)."""
        shapes = jax.eval_shape(self.forward, *jax.tree_util.tree_map(
            lambda t: t.abstract(), (self.generation.params_template, *one_token), is_leaf=is_template))
        return int(shapes[1].shape[-1])

    def _chunk_program(self, rows: int, length: int) -> Callable[..., Any]:
        key = (rows, length)
        run = self.prefills.get(key)
        if run is None:
            def chunk(packed: Any, carry: Any, tokens: Any, starts: Any, counts: Any, tables: Any, slots: Any,
                      *options: Any) -> Any:
                cache, last, seen = carry
                positions = starts[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]
                cache, logits = self.forward(self.layout.unpack(packed), cache, tokens, positions, tables, counts - 1)
                chosen, logprobs, top, seen = score_tokens(logits, seen, slots, *options)
                return (cache, last.at[slots].set(chosen, mode="drop"), seen), (chosen, logprobs, top)

            run = self.prefills[key] = self._compile(chunk, [
                self.layout.templates, self.carry_template, Template((rows, length), np.int32),
                *[Template((rows,), np.int32)] * 2, Template((rows, self.max_blocks), np.int32),
                Template((rows,), np.int32), *self._option_templates(rows, SCORED_KIND)], (), (), donate=(1,))
        return run

    def _decode_program(self, kind: int, rows: int) -> Callable[..., Any]:
        key = (kind, rows)
        run = self.decodes.get(key)
        if run is None:
            def decode(packed: Any, carry: Any, slots: Any, positions: Any, tables: Any, *options: Any) -> Any:
                params = self.layout.unpack(packed)
                cache, last, *seen = carry
                chosen = last[slots]  # a padding row's slot is past the last: it reads one, and writes none
                outputs = []
                for step in range(self.generation.steps_per_launch):
                    cache, logits = self.forward(params, cache, chosen[:, None], (positions + step)[:, None], tables,
                                                 jnp.zeros(rows, jnp.int32))
                    chosen, scores, seen = self._picked(logits, seen, slots, self._stepped(options, step), kind)
                    outputs.append((chosen, *scores))
                return (cache, last.at[slots].set(chosen, mode="drop"), *seen), self._stack(outputs)

            run = self.decodes[key] = self._compile(decode, [
                self.layout.templates, self.carry_template, *[Template((rows,), np.int32)] * 2,
                Template((rows, self.max_blocks), np.int32), *self._option_templates(rows, kind)], (), (),
                donate=(1,))
        return run

    def warm_up_steps(self) -> list[Step]:
        g = self.generation
        return [*[(f"the prefill of {rows} chunk{'s' * (rows > 1)} of {length} tokens",
                   functools.partial(self._chunk_program, rows, length))
                  for rows in g.prefill_batches for length in g.prefill_lengths],
                *[(f"the decode launch of {rows} sequence{'s' * (rows > 1)}{KIND[kind]}",
                   functools.partial(self._decode_program, kind, rows))
                  for rows in self.decode_rows for kind in self.kinds],
                *self._seed_step()]

    def run_each_once(self, params: Any) -> None:
        g = self.generation
        carry = self._run_seed_once(self.zeros())
        for rows in g.prefill_batches:
            for length in g.prefill_lengths:
                idle = np.zeros(rows, np.int32)
                carry, _ = self._chunk_program(rows, length)(
                    params, carry, np.zeros((rows, length), np.int32), idle, idle + 1,
                    np.zeros((rows, self.max_blocks), np.int32), idle + g.slots, *self._idle(rows, SCORED_KIND))
        for rows in self.decode_rows:
            for kind in self.kinds:
                idle = np.zeros(rows, np.int32)
                carry, outputs = self._decode_program(kind, rows)(
                    params, carry, idle + g.slots, idle, np.zeros((rows, self.max_blocks), np.int32),
                    *self._idle(rows, kind))
        owned_host_array(outputs[0])

    def prefill_inputs(self, prefill: Chunk[Any]) -> Launch:
        """The chunk's arrays (the scheduler made them), its rows' options (a chunk's program is scored), and
        the penalties' counts to start for the requests whose prompts it ends."""
        return Launch(SCORED_KIND, [prefill.tokens, prefill.starts, prefill.counts, prefill.tables, prefill.slots,
                                    *self._arrays(prefill.samplings, prefill.steps, SCORED_KIND)],
                      self._seeds(prefill.requests))

    def prefill_of(self, params: Any, carry: Any, inputs: Launch) -> tuple[Any, Any]:
        rows, length = inputs.arrays[0].shape
        return self._chunk_program(rows, length)(params, self._seeded(carry, inputs), *inputs.arrays)

    def step_inputs(self, step: PagedStep[Any]) -> Launch:
        """Per row its slot, cache position and block table, and its options if any row samples or scores."""
        launch = super().step_inputs(step)
        return Launch(launch.kind, [step.rows, step.cache_positions, step.tables, *launch.arrays])

    def step_of(self, params: Any, carry: Any, inputs: Launch) -> tuple[Any, Any]:
        slots, positions, tables, *options = inputs.arrays
        return self._decode_program(inputs.kind, slots.size)(params, carry, slots, positions, tables, *options)
