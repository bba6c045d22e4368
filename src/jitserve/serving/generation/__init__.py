"""Generation: continuous batching of decode loops, the decode state of every slot resident on the device.

The user writes two functions in ``jax.numpy`` (JetStream's engine contract,
made small): ``prefill(params, tokens, length) -> (state_row, first_output)``
for one prompt padded with zeros to a compiled length, and ``decode(params,
state, last_outputs) -> (state, outputs)`` for one step of every slot at once
(the state rows stacked on a first slot axis). A :class:`GenerationServer`
owns ``slots`` rows of that state on its device. Between two decode launches
it admits waiting requests into free slots (their prompts prefilled together,
padded to the same compiled length, and written into their slots by a
compiled update that leaves the other rows in place), and it frees a slot the
moment its request ends: after ``max_steps`` outputs, right after an output
equal to ``eos`` (or to one of a list of them), at ``max_length``, or when
its caller stops reading.

The package is in rooms, each importing only from those above it in this list:

- ``spec``: :class:`Generation`, :class:`Sampling`, the checks of a request;
- ``scheduler``: slots and requests as plain data, a plan per launch;
- ``blocks`` and ``paged_scheduler``: with a paged KV cache
  (``Generation(forward=..., cache=PagedCache(...))``), the pool's blocks and
  prefix cache, and the scheduler that hands them out (chunked prefill,
  preemption);
- ``picking``: how the programs pick tokens on the device (greedy, sampled,
  or scored: after penalties, with log-probabilities);
- ``programs`` and ``paged_programs``: the compiled prefills, slot updates and
  decode launches of each engine;
- ``delivery``: outputs handed over to the callers' streams (with their
  log-probabilities, :class:`TokenLogprobs`), and what each caller makes of
  them (:class:`Delivery`, :class:`StopText`, :func:`stacked`);
- ``server``: :class:`GenerationServer`'s loop (plan -> programs -> deliver)
  and lifecycle, and :class:`GenerationFront`, what callers of a generation
  server see, given what they ask, a :class:`Prompt`.
"""

from .delivery import Choices, Delivery, Piece, StopText, TokenLogprobs, stacked, stop_text
from .server import GenerationFront, GenerationServer, Prompt
from .spec import GREEDY, Generation, PagedCache, Sampling

__all__ = ["GREEDY", "Choices", "Delivery", "Generation", "GenerationFront", "GenerationServer", "PagedCache",
           "Piece", "Prompt", "Sampling", "StopText", "TokenLogprobs", "stacked", "stop_text"]
