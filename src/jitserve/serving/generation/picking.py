"""How a generation's programs pick each sequence's next token from its logits, on the device.

Three pickers, one per kind of program (:attr:`~.spec.Sampling.kind`), each a
function of rows of logits and per-row options, compiled into the programs
that give the logits: :func:`greedy_tokens` (the most likely),
:func:`sample_tokens` (a logit bias, temperature, top-k, top-p, min-p, a seed per row, ids
held back under ``min_tokens``) and :func:`score_tokens`, which samples after the
penalties (:func:`penalized`) and gives every row's log-probabilities: the
chosen token's and the ``MAX_LOGPROBS`` most likely tokens', always that many,
so that what each request asks costs no program of its own.

Penalties read ``seen``, (slots, vocabulary) on the device: per slot and
token, how many of its outputs are that token, plus ``IN_PROMPT`` where its
prompt holds it. A scored program adds each token it picks to its slot's row;
:func:`seeded` starts a slot's row from its prompt (and, for a sequence
prefilled again after a preemption, its outputs so far) when it takes a
request that asks for penalties.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .spec import Sampling

IN_PROMPT = 1 << 24  # seen[slot, token] holds this where the slot's prompt holds token (outputs count below it)


def greedy_tokens(logits: Any) -> Any:
    """The most likely token of each row of ``logits`` (rows, vocabulary)."""
    return jnp.argmax(jnp.asarray(logits, jnp.float32), axis=-1).astype(jnp.int32)


def biased(logits: Any, bias_ids: Any, biases: Any) -> Any:
    """``logits`` (rows, vocabulary, float32) with each row's ``biases`` added at its ``bias_ids`` (rows,
    ``MAX_LOGIT_BIAS``; padded with ids past the vocabulary, which add nothing)."""
    return logits.at[jnp.arange(logits.shape[0])[:, None], bias_ids].add(biases, mode="drop")


def sample_tokens(logits: Any, temperature: Any, top_k: Any, top_p: Any, min_p: Any, seed: Any, min_tokens: Any,
                  held: Any, bias_ids: Any, biases: Any, step: Any) -> Any:
    """One token per row of ``logits`` (rows, vocabulary) after its logit bias (:func:`biased`): the most
    likely where ``temperature`` is 0, else drawn from that row's top-k / top-p / min-p distribution at its
    temperature with the key ``fold_in(PRNGKey(seed), step)``: a row's token depends on its own row and
    options only. While a row's ``step`` is below its ``min_tokens``, the ids of its row of ``held`` (padded
    with ids past the vocabulary) are never picked."""
    return _sample(biased(jnp.asarray(logits, jnp.float32), bias_ids, biases), temperature, top_k, top_p, min_p,
                   seed, min_tokens, held, step)


def _sample(logits: Any, temperature: Any, top_k: Any, top_p: Any, min_p: Any, seed: Any, min_tokens: Any,
            held: Any, step: Any) -> Any:
    rows, vocabulary = logits.shape
    banned = jnp.zeros((rows, vocabulary), bool).at[jnp.arange(rows)[:, None], held].set(True, mode="drop")
    logits = jnp.where(banned & (step < min_tokens)[:, None], -jnp.inf, logits)

    def draw(row: Any, temperature: Any, top_k: Any, top_p: Any, min_p: Any, seed: Any, step: Any) -> Any:
        scaled = row / jnp.maximum(temperature, 1e-6)
        ordered = jnp.sort(scaled)[::-1]
        kept = jnp.where(top_k > 0, scaled >= ordered[jnp.clip(top_k - 1, 0, vocabulary - 1)], True)
        ordered = jnp.where(jnp.arange(vocabulary) < jnp.where(top_k > 0, top_k, vocabulary), ordered, -jnp.inf)
        reached = jnp.sum(jnp.cumsum(jax.nn.softmax(ordered)) < top_p)  # the last token still needed for top_p
        kept &= scaled >= ordered[jnp.clip(reached, 0, vocabulary - 1)]
        kept &= jnp.exp(scaled - ordered[0]) >= min_p  # p / p_max >= min_p (0: every token, no log of 0)
        key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
        return jax.random.categorical(key, jnp.where(kept, scaled, -jnp.inf)).astype(jnp.int32)

    drawn = jax.vmap(draw)(logits, temperature, top_k, top_p, min_p, seed, step)
    return jnp.where(temperature > 0, drawn, greedy_tokens(logits))


def penalized(logits: Any, seen: Any, repetition: Any, presence: Any, frequency: Any) -> Any:
    """``logits`` (rows, vocabulary, float32) after each row's penalties, given its row of ``seen``: Hugging
    Face's repetition penalty (``RepetitionPenaltyLogitsProcessor``: the logit of a token of the prompt or the
    outputs is divided by ``repetition`` if positive, else multiplied by it), then OpenAI's presence and
    frequency penalties over the outputs (``logit - presence * (count > 0) - frequency * count``)."""
    counts = (seen % IN_PROMPT).astype(jnp.float32)
    repeated = jnp.where(logits < 0, logits * repetition[:, None], logits / repetition[:, None])
    logits = jnp.where(seen > 0, repeated, logits)
    return logits - presence[:, None] * (counts > 0) - frequency[:, None] * counts


def score_tokens(logits: Any, seen: Any, slots: Any, temperature: Any, top_k: Any, top_p: Any, min_p: Any,
                 seed: Any, min_tokens: Any, held: Any, bias_ids: Any, biases: Any, step: Any, repetition: Any,
                 presence: Any, frequency: Any) -> tuple[Any, Any, Any, Any]:
    """One token per row, sampled as :func:`sample_tokens` does from the logits after the row's logit bias,
    then its penalties (:func:`penalized`; vLLM's order), the rows' slots being ``slots`` (None: row i is slot
    i; a slot past the last: not counted); and each row's log-probabilities under the model's own
    distribution, the log-softmax of ``logits`` as they came: the chosen token's, then the most likely
    tokens', highest first (rows, 1 + ``MAX_LOGPROBS``), and those tokens (rows, ``MAX_LOGPROBS``; fewer in a
    smaller vocabulary). Returns the tokens, the log-probabilities, the top tokens and ``seen`` with each
    chosen token counted in its slot."""
    logits = jnp.asarray(logits, jnp.float32)
    rows, vocabulary = logits.shape
    rows_seen = seen if slots is None else seen[slots]
    chosen = _sample(penalized(biased(logits, bias_ids, biases), rows_seen, repetition, presence, frequency),
                     temperature, top_k, top_p, min_p, seed, min_tokens, held, step)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    top, tokens = jax.lax.top_k(logprobs, min(Sampling.MAX_LOGPROBS, vocabulary))
    picked = jnp.take_along_axis(logprobs, chosen[:, None], axis=1)
    # a set of the count plus one, not an add: a slot update's padding repeats a prompt's row, its slot and its
    # token, and must count it once
    index = jnp.arange(rows) if slots is None else slots
    counted = jnp.take_along_axis(rows_seen, chosen[:, None], axis=1)[:, 0] + 1
    seen = seen.at[index, chosen].set(counted, mode="drop")
    return chosen, jnp.concatenate([picked, top], axis=1), tokens.astype(jnp.int32), seen


def seeded(seen: Any, slots: Any, sequences: Any, prompt_sizes: Any) -> Any:
    """``seen`` with the rows of ``slots`` started again from their ``sequences`` (rows, width; padded with
    ids past the vocabulary): ``IN_PROMPT`` for each token of the first ``prompt_sizes`` of a row, and a count
    of each of its tokens after them (outputs, where a preempted sequence is prefilled again). A slot past the
    last is not written."""
    seen = jnp.asarray(seen)
    rows, width = sequences.shape
    in_prompt = jnp.arange(width)[None, :] < prompt_sizes[:, None]
    at = (jnp.arange(rows)[:, None], sequences)
    fresh = jnp.zeros((rows, seen.shape[1]), seen.dtype)
    fresh = fresh.at[at].max(jnp.where(in_prompt, IN_PROMPT, 0).astype(seen.dtype), mode="drop")
    fresh = fresh.at[at].add(jnp.where(in_prompt, 0, 1).astype(seen.dtype), mode="drop")
    return seen.at[slots].set(fresh, mode="drop")
