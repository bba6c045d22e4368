"""What a generation is and what a request to it may ask, checked before anything runs.

:class:`Generation` holds the user's ``prefill`` and ``decode``, the weights, the
slots and the compiled prompt lengths; :class:`Sampling` is how one request of
a ``logits=True`` generation picks its tokens. The checks of a request, of a
prompt and of ``eos`` live here, so that a server, the network front and a
cluster replica all refuse the same things with the same words.
"""

from __future__ import annotations

import copy
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ... import compilers
from ...defn import resolve_options
from ...errors import BatchError, OptionError, PromptTooLongError
from ...mesh import MeshPlacement
from ...params import load_params
from ...template import Template, is_template, params_template, templates_of
from ..options import count_option, finite_number, optional_count, powers_of_two_up_to
from ..request import model_code


def _whole(name: str, value: Any, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 0 <= value < limit:
        raise OptionError(f"{name} must be an integer in [0, {limit}), got {value!r}")
    return int(value)


def _token_id(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | np.integer) and 0 <= int(value) < 2**31


GREEDY_KIND, SAMPLED_KIND, SCORED_KIND = range(3)  # which compiled program picks a request's tokens


class Sampling:
    """How one request of a ``logits=True`` generation picks its tokens: greedy (``temperature`` 0, the
    default), or drawn at ``temperature`` from the ``top_k`` most likely tokens (0: all of them) that make up
    ``top_p`` of the probability and have at least ``min_p`` times the probability of the most likely one (HF's
    order: top-k, top-p, min-p; 0: no cut), from a generator seeded with ``seed`` (None:
    a fresh one; a seed gives the same tokens whatever else runs). ``stop_token_ids``: up to
    ``MAX_STOP_IDS`` token ids that end the request as ``eos`` does (the id is its last output);
    ``min_tokens``: its first so many outputs are never ``eos`` nor one of those (held back on the device,
    as vLLM does). ``logprobs``: give each output's log-probability and those of the ``logprobs`` most likely
    tokens (0 to ``MAX_LOGPROBS``; None: none), under the model's own distribution (the log-softmax of its
    logits before any penalty, temperature or cut, as vLLM's and OpenAI's). ``repetition_penalty`` (HF's,
    > 0; 1: none) divides the positive logits and multiplies the negative ones of every token in the prompt or
    the outputs so far; ``presence_penalty`` and ``frequency_penalty`` (OpenAI's, -2 to 2; 0: none) take
    ``presence`` from the logit of each token among the outputs so far and ``frequency`` times its count.
    ``ignore_eos`` (vLLM's): the generation's ``eos`` does not end the request, which goes on to its
    ``max_steps`` (or ``max_length``); its stop ids still end it. Only this one needs no logits.
    ``logit_bias`` (OpenAI's): token id -> a number from -100 to 100 added to that token's logit before
    anything else (penalties, temperature, cuts; a greedy request picks the most likely after it), for up to
    ``MAX_LOGIT_BIAS`` ids of the vocabulary; the log-probabilities stay the model's own."""

    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "min_tokens", "stop_token_ids", "logprobs",
                 "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos", "logit_bias")
    MAX_STOP_IDS = 16
    MAX_LOGIT_BIAS = 300  # token ids one request may bias (OpenAI's limit)
    BIAS_LIMIT = 100.0  # the largest bias of a token's logit either way (OpenAI's)
    MAX_LOGPROBS = 20  # the most likely tokens a scored program gives per output (vLLM's default limit)

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 min_tokens: int = 0, stop_token_ids: Sequence[int] = (), logprobs: int | None = None,
                 repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, ignore_eos: bool = False, min_p: float = 0.0,
                 logit_bias: Mapping[int, float] | None = None) -> None:
        if not finite_number(temperature) or temperature < 0:
            raise OptionError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
        if not finite_number(top_p) or not 0 < top_p <= 1:
            raise OptionError(f"top_p must be a number in (0, 1], got {top_p!r}")
        if not finite_number(min_p) or not 0 <= min_p <= 1:
            raise OptionError(f"min_p must be a number in [0, 1] (0: no cut), got {min_p!r}")
        self.temperature = float(temperature)
        self.top_k = _whole("top_k (0: no limit)", top_k, 2**31)
        self.top_p = float(top_p)
        self.min_p = float(min_p)
        self.seed = secrets.randbits(32) if seed is None else _whole("seed", seed, 2**32)
        self.min_tokens = _whole("min_tokens", min_tokens, 2**31)
        if not isinstance(stop_token_ids, list | tuple) or len(stop_token_ids) > self.MAX_STOP_IDS or not all(
                _token_id(i) for i in stop_token_ids):
            raise OptionError(f"stop_token_ids must be a list of at most {self.MAX_STOP_IDS} token ids (integers "
                              f">= 0), got {stop_token_ids!r:.80}")
        self.stop_token_ids = tuple(int(i) for i in stop_token_ids)
        self.logprobs = None if logprobs is None else _whole(
            f"logprobs (the most likely tokens to give with each output, at most {self.MAX_LOGPROBS}; None: no "
            f"log-probabilities)", logprobs, self.MAX_LOGPROBS + 1)
        if not finite_number(repetition_penalty) or repetition_penalty <= 0:
            raise OptionError(f"repetition_penalty must be a finite number > 0 (1: none), got {repetition_penalty!r}")
        for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
            if not finite_number(value) or not -2 <= value <= 2:
                raise OptionError(f"{name} must be a number from -2 to 2 (0: none), got {value!r}")
        self.repetition_penalty = float(repetition_penalty)
        self.presence_penalty = float(presence_penalty)
        self.frequency_penalty = float(frequency_penalty)
        if not isinstance(ignore_eos, bool | np.bool_):
            raise OptionError(f"ignore_eos must be True or False, got {ignore_eos!r:.80}")
        self.ignore_eos = bool(ignore_eos)
        if logit_bias is not None and (not isinstance(logit_bias, Mapping) or len(logit_bias) > self.MAX_LOGIT_BIAS
                                       or not all(_token_id(i) and finite_number(bias) and abs(bias) <= self.BIAS_LIMIT
                                                  for i, bias in logit_bias.items())):
            raise OptionError(f"logit_bias must map at most {self.MAX_LOGIT_BIAS} token ids (integers >= 0) to numbers "
                              f"from -{self.BIAS_LIMIT:g} to {self.BIAS_LIMIT:g}, got {logit_bias!r:.80}")
        self.logit_bias = tuple((int(i), float(bias)) for i, bias in (logit_bias or {}).items())

    def choice(self, index: int) -> Sampling:
        """This sampling for choice ``index`` of a request of several (OpenAI's and vLLM's ``n``): its seed plus
        ``index``, so that choices differ and a seeded request gives the same choices again."""
        chosen = copy.copy(self)
        chosen.seed = (self.seed + index) % 2**32
        return chosen

    @property
    def penalized(self) -> bool:
        """Some penalty changes its logits: the device counts the tokens of its prompt and outputs."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def kind(self) -> int:
        """The program that picks its tokens: ``GREEDY_KIND`` (the most likely, nothing held back),
        ``SAMPLED_KIND`` (:func:`~.programs.sample_tokens`), or ``SCORED_KIND`` (sampled after its penalties,
        with log-probabilities: :func:`~.programs.score_tokens`)."""
        if self.logprobs is not None or self.penalized:
            return SCORED_KIND
        return SAMPLED_KIND if self.temperature or self.min_tokens or self.logit_bias else GREEDY_KIND


GREEDY = Sampling(seed=0)

PAGED_PREFILL_BATCHES = 8  # a paged generation prefills at most this many prompts' chunks in one program
PAGED_CHUNK = 256  # a paged generation's longest compiled prompt chunk, by default
PAGED_SHORTEST_CHUNK = 32  # and its shortest (a shorter chunk costs no less to run)


class PagedCache:
    """The layout of a paged KV cache (see :mod:`~jitserve.serving.generation.paged_scheduler`): ``layers``
    of keys and values, ``kv_heads`` heads of ``head_dim`` each, in ``dtype``; positions in blocks of
    ``block_size``; ``tokens``: the positions of the whole pool (every sequence's together; None: room for
    eight sequences of ``max_length``, what eight slots of a slot cache take); ``prefix_caching``: prompts
    reuse the blocks of a prefix computed before."""

    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, dtype: Any = "float32", block_size: int = 16,
                 tokens: int | None = None, prefix_caching: bool = True) -> None:
        self.layers = count_option("layers", layers)
        self.kv_heads = count_option("kv_heads", kv_heads)
        self.head_dim = count_option("head_dim", head_dim)
        self.dtype = np.dtype(dtype)
        self.block_size = count_option("block_size", block_size)
        self.tokens = optional_count("tokens", tokens)
        if not isinstance(prefix_caching, bool):
            raise OptionError(f"prefix_caching must be True or False, got {prefix_caching!r}")
        self.prefix_caching = prefix_caching

    def blocks(self, max_length: int) -> int:
        """The blocks of the pool, the reserved one included (see :class:`~.blocks.BlockPool`)."""
        tokens = self.tokens if self.tokens is not None else 8 * max_length
        return 1 + -(-tokens // self.block_size)

    def table_blocks(self, max_length: int) -> int:
        """The blocks of a sequence of ``max_length`` positions: a block table's width."""
        return -(-max_length // self.block_size)

    @staticmethod
    def decode_rows(slots: int) -> list[int]:
        """The numbers of sequences (rows) a decode launch is compiled for: powers of two below ``slots``,
        then ``slots``; a launch runs the fewest that hold its sequences, so one sequence alone reads the
        weights for itself, not for every slot (a step's cost grows with its rows). Every launch's table is
        :meth:`table_blocks` wide: attention reads only the blocks its sequences hold
        (:func:`jitserve.models.layers.paged_attend`), so a narrower table would buy nothing but programs."""
        return powers_of_two_up_to(slots)

    def __repr__(self) -> str:
        return (f"PagedCache(layers={self.layers}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype.name!r}, block_size={self.block_size}, tokens={self.tokens}, "
                f"prefix_caching={self.prefix_caching})")


class Generation:
    """A generation serving: ``prefill`` and ``decode`` (see :mod:`jitserve.serving.generation`), or with a
    paged KV cache, one ``forward`` and the ``cache``'s layout (:class:`PagedCache`; see
    :mod:`~jitserve.serving.generation.paged_programs` for what ``forward`` takes), its weights
    (``params``: a tree of arrays, or a file that :func:`jitserve.load_params` reads, remembered for
    ``reload_params``), and its slots. With ``logits=True`` both return logits (a vector per sequence)
    instead of outputs: the server picks each token on the device, greedy or sampled per request
    (:class:`Sampling`), and gives it to the caller and to the next ``decode``. ``steps_per_launch``: the
    decode steps each launch runs (see :mod:`~jitserve.serving.generation.server`); a request's outputs do
    not depend on it, only when they arrive and how many steps a slot idles after its request ends
    mid-launch. ``preprocess(prompt)``: the token ids of a prompt as callers send it (a tokenizer);
    ``postprocess(output)``: what a caller gets for each output (a token's text); ``detokenizer(prompt_ids)``:
    instead of ``postprocess``, a new incremental decoder per request, whose ``feed(token)`` gives the text
    that can go out and ``finish()`` what it still held at the end (a real tokenizer's text, which one token
    alone cannot give); such a generation answers text, and :func:`jitserve.generate` one string. All run in
    the caller. ``mesh``: a :class:`~jitserve.mesh.MeshPlacement`, to run every program over the devices of
    its mesh (tensor parallel, compiler ``xla``), the weights and the slots' state split as it says
    (``from_pretrained(..., devices=N)`` makes one); None: one device. ``default_sampling``: the
    :class:`Sampling` fields a request of a ``logits=True`` generation gets where it gives none of its own
    (a checkpoint's ``generation_config.json``; see :meth:`sampling`)."""

    generates = True  # its server generates (a Serving's batches rows)

    def __init__(self, prefill: Callable[..., Any] | None = None, decode: Callable[..., Any] | None = None, *,
                 params: Any, slots: int, max_length: int, forward: Callable[..., Any] | None = None,
                 cache: PagedCache | None = None, prefill_lengths: Sequence[int] | None = None, eos: Any = None,
                 compiler: str | None = None, max_queue: int | None = None, logits: bool = False,
                 steps_per_launch: int = 1, preprocess: Callable[[Any], Any] | None = None,
                 postprocess: Callable[[Any], Any] | None = None,
                 detokenizer: Callable[[np.ndarray], Any] | None = None, mesh: MeshPlacement | None = None,
                 default_sampling: Mapping[str, Any] | None = None, **compiler_options: Any) -> None:
        if cache is None and (not callable(prefill) or not callable(decode) or forward is not None):
            raise OptionError("a Generation needs two functions: prefill(params, tokens, length) and "
                              "decode(params, state, last_outputs) (or forward= and cache=, for a paged cache)")
        if cache is not None and (not callable(forward) or prefill is not None or decode is not None
                                  or not isinstance(cache, PagedCache) or not logits):
            raise OptionError("a Generation with a paged cache needs cache=js.PagedCache(...), one function "
                              "forward(params, cache, tokens, positions, tables, last) that gives logits "
                              "(logits=True), and no prefill or decode")
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
        self.forward = forward
        self.cache = cache
        self.params_source = os.fspath(params) if isinstance(params, str | os.PathLike) else None  # a reload reads it
        self.params = params if self.params_source is None else load_params(self.params_source)
        self.params_template = params_template(self.params)
        self.slots = count_option("slots", slots)
        self.max_length = count_option("max_length", max_length)
        longest, shortest = (self.max_length, 16) if cache is None else \
            (min(self.max_length, PAGED_CHUNK), PAGED_SHORTEST_CHUNK)
        lengths = powers_of_two_up_to(longest, shortest) if prefill_lengths is None else \
            sorted({count_option(f"each of prefill_lengths {list(prefill_lengths)}", n) for n in prefill_lengths})
        if not lengths or lengths[-1] > self.max_length:
            raise OptionError(f"prefill_lengths must be positive and at most max_length ({self.max_length}), "
                              f"got {list(prefill_lengths or [])}")
        self.prefill_lengths = lengths
        # prompts prefilled together, padded to these
        self.prefill_batches = powers_of_two_up_to(self.slots if cache is None else
                                                   min(self.slots, PAGED_PREFILL_BATCHES))
        self.eos = eos
        self.logits = bool(logits)
        self.default_sampling = dict(default_sampling or {})
        if self.default_sampling and not self.logits:
            raise OptionError("default_sampling picks tokens from logits: give it to a logits=True generation")
        Sampling(**self.default_sampling)  # a field Sampling does not take, or a value it refuses, raises here
        self.steps_per_launch = count_option("steps_per_launch", steps_per_launch)
        self.max_queue = optional_count("max_queue", max_queue)
        chosen, self.compiler_options = resolve_options({**({"compiler": compiler} if compiler else {}),
                                                         **compiler_options})
        self.compiler_name = chosen.name
        if cache is not None and not chosen.pages:
            raise OptionError(f"compiler {chosen.name!r} does not run a paged cache's programs as XLA does; serve "
                              f"this generation with compiler 'xla' or 'evaluator', or with a slot cache (prefill "
                              f"and decode; from_pretrained's kv_cache='slots')")
        self.mesh = _checked_mesh(mesh, chosen, self.compiler_options)
        if cache is not None and mesh is not None:
            raise OptionError("a paged cache runs on one device for now; a generation over several devices "
                              "(tensor parallel) keeps a slot cache")

    def prompt_of(self, prompt: Any) -> Any:
        """The token ids of a caller's prompt: ``preprocess(prompt)`` where given (a tokenizer; run by the
        caller), else the prompt itself."""
        return prompt if self.preprocess is None else model_code(self.preprocess, prompt)

    def output_of(self, output: Any) -> Any:
        """What the caller gets for one output: ``postprocess(output)`` where given (the text of a token, say;
        run by the caller), else the output itself."""
        return output if self.postprocess is None else model_code(self.postprocess, output)

    @property
    def engine(self) -> str:
        """How its server keeps the decode state: ``"slots"`` (a row of ``max_length`` per slot) or
        ``"paged"`` (blocks of a pool)."""
        return "slots" if self.cache is None else "paged"

    @property
    def functions(self) -> tuple[Callable[..., Any], ...]:
        """The user's functions it compiles (``prefill``, ``decode``, or ``forward``); the last names a server
        by default."""
        return tuple(f for f in (self.prefill, self.decode, self.forward) if f is not None)

    @property
    def has_params(self) -> bool:
        """False only for a copy made to travel without its weights (``with_params(None)``)."""
        return self.params is not None

    def sampling(self, **asked: Any) -> Sampling:
        """A request's :class:`Sampling`: the fields it ``asked`` (what each door read from it), over this
        generation's ``default_sampling`` (a field the request gives wins)."""
        return Sampling(**{**self.default_sampling, **asked})

    def with_params(self, params: Any) -> Generation:
        """This generation with other weights of the same shapes (None: without them, to travel light)."""
        changed = copy.copy(self)
        changed.params = params
        return changed

    def fingerprint_fields(self) -> dict[str, Any]:
        """What identifies what this generation computes (see ``Serving.fingerprint_fields``): its functions,
        its checked options, and its weights' templates and file, not their values (``params``)."""
        names = ("prefill", "decode", "forward", "cache", "preprocess", "postprocess", "detokenizer", "params_source",
                 "params_template", "slots", "max_length", "prefill_lengths", "prefill_batches", "eos", "logits",
                 "steps_per_launch", "max_queue", "compiler_name", "compiler_options", "mesh", "default_sampling")
        return {name: getattr(self, name) for name in names}

    def shapes(self) -> tuple[Any, Template, Template]:
        """The templates of a prompt's state row, of what ``prefill`` gives for it (an output, or logits),
        and of one output a caller gets per step (a token id, for ``logits=True``), which ``eos`` must be
        (or a list of them)."""
        length = self.prefill_lengths[0]
        assert self.prefill is not None  # called for a generation without a paged cache
        if compilers.get(self.compiler_name).compiles:
            row, first = jax.eval_shape(self.prefill, *jax.tree_util.tree_map(
                lambda t: t.abstract(), (self.params_template, Template((length,), np.int32),
                                         Template((), np.int32)), is_leaf=is_template))
        else:  # run as written (NumPy, PyTorch...): the shapes of one real call on a prompt of zeros
            row, first = model_code(self.prefill, self.params, np.zeros(length, np.int32), np.int32(1))
        first = templates_of(first)
        if self.logits and (len(first.shape) != 1 or first.dtype.kind != "f"):
            raise OptionError(f"a logits=True generation's prefill must return a vector of float logits per "
                              f"prompt; it returned {first}")
        output = Template((), np.int32) if self.logits else first
        if self.eos is not None:
            stop_outputs(self.eos, output)
        return templates_of(row), first, output

    def check_request(self, name: str, prompt: Any, max_steps: int, sampling: Sampling | None,
                      vocabulary: int | None = None) -> np.ndarray:
        """A request's prompt (see :meth:`check_prompt`) once its ``max_steps`` and ``sampling`` are checked
        for generation server ``name`` (its ``logit_bias`` against the ``vocabulary``, where it is known)."""
        count_option("max_steps", max_steps)
        if sampling is not None and not self.logits and (sampling.kind or sampling.stop_token_ids):
            raise OptionError(f"generation server {name!r} cannot sample, hold back, bias or stop at token ids, give "
                              f"log-probabilities or penalize tokens: its decode returns outputs, not logits (serve "
                              f"it with js.Generation(..., logits=True) to choose per request)")
        outside = [i for i, _ in sampling.logit_bias if i >= vocabulary] if sampling and vocabulary else []
        if outside:
            raise OptionError(f"logit_bias names token {outside[0]}, past the vocabulary of generation server "
                              f"{name!r} ({vocabulary} tokens)")
        array = self.check_prompt(prompt)
        if self.cache is not None:  # what it holds at its longest must fit the pool, else it could never finish
            positions = array.size + max(1, min(int(max_steps), self.max_length - array.size)) - 1
            blocks = self.cache.blocks(self.max_length) - 1
            if -(-positions // self.cache.block_size) > blocks:
                raise PromptTooLongError(
                    f"the prompt ({array.size} tokens) and its outputs (max_steps {max_steps}) need "
                    f"{positions} positions of KV cache; the whole cache of generation server {name!r} holds "
                    f"{blocks * self.cache.block_size} ({blocks} blocks of {self.cache.block_size})")
        return array

    def check_prompt(self, prompt: Any) -> np.ndarray:
        """The prompt as a 1-D int32 array of token ids, else a clear error naming what is wrong."""
        array = np.asarray(prompt)
        if array.size == 0:
            raise BatchError("the prompt is empty; send at least one token")
        if array.dtype.kind not in "iu" or array.ndim != 1:
            got = f"; got {Template(array.shape, array.dtype)}" if array.dtype.kind in "biufc" else ""
            raise BatchError(f"a prompt must be a 1-D array of integer token ids{got}")
        longest = self.prefill_lengths[-1] if self.cache is None else self.max_length  # paged: prefilled in chunks
        if array.size > longest:
            raise PromptTooLongError(f"the prompt has {array.size} tokens, more than the longest prefill length "
                                     f"({longest}; max_length is {self.max_length})" if self.cache is None else
                                     f"the prompt has {array.size} tokens, more than max_length ({self.max_length})")
        if array.dtype != np.int32:
            if array.min() < np.iinfo(np.int32).min or array.max() > np.iinfo(np.int32).max:
                raise BatchError("the prompt's token ids do not fit int32")
            array = array.astype(np.int32)
        return array

    def __repr__(self) -> str:
        functions = ", ".join(repr(getattr(f, "__name__", f)) for f in self.functions)
        cache = "" if self.cache is None else f", cache={self.cache!r}"
        return (f"Generation({functions}, slots={self.slots}, max_length={self.max_length}{cache}, "
                f"compiler={self.compiler_name!r})")


def _checked_mesh(mesh: Any, compiler: compilers.Compiler, options: dict[str, Any]) -> MeshPlacement | None:
    """``mesh`` where a generation can run over it with ``compiler`` and its ``options``, else a clear error."""
    if mesh is None:
        return None
    if not isinstance(mesh, MeshPlacement):
        raise OptionError(f"mesh must be a jitserve.mesh.MeshPlacement or None, got {type(mesh).__name__}")
    if not compiler.shards:
        raise OptionError(f"compiler {compiler.name!r} runs each program on one device; a generation over "
                          f"several devices (tensor parallel) needs compiler 'xla'")
    if "device" in options:
        raise OptionError(f"a generation runs over its mesh's devices or on device={options['device']!r}, not "
                          f"both")
    return mesh


def stop_outputs(eos: Any, output: Template) -> np.ndarray:
    """``eos`` as the outputs that end a request, stacked (n, *output shape): one output of the shape of
    ``output``, or several (a list of token ids, as models with more than one end token have), in values
    its dtype holds; else a clear error, as an ``eos`` that no output can equal would never stop a request."""
    array = np.asarray(eos)
    if output.shape not in (array.shape, array.shape[1:]) or array.size == 0 or array.dtype.kind not in "biuf" or \
            not np.array_equal(array.astype(output.dtype), array):
        raise OptionError(f"eos must be one output of this generation, {output}, or a list of them; got "
                          f"{eos!r} ({Template(array.shape, array.dtype)})")
    return array.astype(output.dtype).reshape(-1, *output.shape)
