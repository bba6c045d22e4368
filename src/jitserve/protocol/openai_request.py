"""An OpenAI API request's body, checked field by field before anything runs: the fields each endpoint takes
(any other is refused by name, as OpenAI's own API refuses an unrecognized argument), those jitserve's engine
does not implement yet (refused by name unless given the value that asks for nothing, such as
``suffix: ""``; ``best_of`` only equal to ``n``), and each value's type and range; prompts, chat messages and
embedding inputs in the forms OpenAI's API reference gives. Every refusal is a :class:`ParameterError` naming
the field."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from ..errors import OptionError, ParameterError, ProtocolError
from ..serving.generation import Sampling
from .codec import shown
from .llm import PROMPT_CHARS_PER_TOKEN, logit_bias

MAX_CHOICES = 128  # choices of one request (n times its prompts): each is a generation request
MAX_INPUTS = 2048  # texts of one embeddings request (OpenAI's limit)
SEEDS = 2**32  # a seed is any integer, taken modulo this (the engine's seeds are 32-bit)
# the fields that make a choice's Sampling; top_k, min_p, repetition_penalty, min_tokens, stop_token_ids and
# ignore_eos: vLLM's extensions, which the engine has
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos", "logit_bias")
ALL_TOKENS = -1  # vLLM's top_k for "no limit", beside 0 (the engine's)
OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0}  # OpenAI's defaults: a request samples unless told not to

# vLLM's extensions whose defaults are jitserve's way (the text leaves special tokens and a stop string out) ->
# those defaults
VLLM_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "include_stop_str_in_output": (False,),
}
# fields that jitserve's engine does not implement yet -> the values that ask for nothing (null always does); any
# other value is refused by name
NOT_YET: dict[str, tuple[Any, ...]] = {
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none",),
    "response_format": ({"type": "text"},),
    **VLLM_DEFAULTS,
}
_GENERATING = {"model", "max_tokens", "n", "stop", "stream", "stream_options", "user", *SAMPLING, "logprobs",
               *VLLM_DEFAULTS}
FIELDS: dict[str, frozenset[str]] = {  # endpoint -> the fields it takes
    "completions": frozenset({*_GENERATING, "prompt", "echo", "best_of", "suffix"}),
    # parallel_tool_calls: how tools are called, which asks for nothing without tools (vLLM takes it so; OpenAI
    # refuses it there), and tools are refused by name
    "chat/completions": frozenset({*_GENERATING, "messages", "max_completion_tokens", "top_logprobs", "tools",
                                   "tool_choice", "response_format", "parallel_tool_calls"}),
    "embeddings": frozenset({"model", "input", "encoding_format", "dimensions", "user"}),
    # vLLM's, beside /v1: a text's or a chat's token ids, and token ids' text
    "tokenize": frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                           "return_token_strs"}),
    "detokenize": frozenset({"model", "tokens"}),
}
ROOT_ENDPOINTS = ("tokenize", "detokenize")  # served at /{endpoint}, as vLLM serves them; the others at /v1/
ENCODINGS = ("float", "base64")
STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})  # the last one vLLM's


def check_fields(request: dict[str, Any], endpoint: str) -> None:
    """Every field of a request to ``endpoint`` (see :func:`path`) is one it takes, and none asks for what jitserve does
    not do yet."""
    known = FIELDS[endpoint]
    for name, value in request.items():
        if name not in known:
            raise ParameterError(f"unknown parameter '{shown(name)}': {path(endpoint)} takes "
                                 f"{', '.join(sorted(known))}", shown(name), "unknown_parameter")
        neutral = NOT_YET.get(name)
        if neutral is not None and value is not None and not any(
                type(value) is type(one) and value == one for one in neutral):
            raise ParameterError(f"'{name}' is not supported yet: jitserve's engine does not implement it; leave "
                                 f"it out or send {orjson.dumps(neutral[0]).decode()}", name, "unsupported_parameter")


def path(endpoint: str) -> str:
    return f"/{endpoint}" if endpoint in ROOT_ENDPOINTS else f"/v1/{endpoint}"


def model_name(request: dict[str, Any]) -> str:
    model = request.get("model")
    if not isinstance(model, str) or not model:
        raise ParameterError("'model' must name a served model (GET /v1/models lists them)", "model",
                             "missing_parameter" if model is None else "invalid_value")
    return model


def _shown(value: Any) -> str:
    return shown(orjson.dumps(value, default=repr).decode())


def integer(request: dict[str, Any], name: str, default: int | None, low: int = 1,
            high: int | None = None) -> int | None:
    """An integer field from ``low`` to ``high`` (None: no limit), or ``default`` when null or absent."""
    value = request.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bounds = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise ParameterError(f"'{name}' must be an integer {bounds}, got {_shown(value)}", name)
    return value


def flag(request: dict[str, Any], name: str, default: bool = False) -> bool:
    """A true/false field (``default`` when null or absent)."""
    value = request.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ParameterError(f"'{name}' must be true or false, got {_shown(value)}", name)
    return value


def text(request: dict[str, Any], name: str) -> str:
    """A text field."""
    value = request.get(name)
    if not isinstance(value, str):
        raise ParameterError(f"'{name}' must be a text, got {_shown(value)}", name)
    return value


def stream_usage(request: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """``stream_options``, given only with ``stream``: ``include_usage`` (a last chunk with the usage) and vLLM's
    ``continuous_usage_stats`` (with ``include_usage``, as vLLM reads it: every chunk with its choice's usage so
    far)."""
    options = request.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise ParameterError("'stream_options' is only allowed with 'stream': true", "stream_options")
    if not isinstance(options, dict) or set(options) - STREAM_OPTIONS:
        raise ParameterError(f"'stream_options' takes {', '.join(sorted(STREAM_OPTIONS))} (each true or false); "
                             f"got {_shown(options)}", "stream_options")
    last, every = flag(options, "include_usage"), flag(options, "continuous_usage_stats")
    return last, last and every


def best_of(request: dict[str, Any], count: int) -> None:
    """``best_of``, the choices to generate of which the ``count`` (``n``) best are returned: only ``count``
    itself, which returns every one (vLLM V1 takes 1 alone: "vLLM V1 does not yet support best_of.")."""
    asked = request.get("best_of")
    if asked is not None and (type(asked) is not int or asked != count):
        raise ParameterError(f"'best_of' is {_shown(asked)}; jitserve's engine returns every choice it generates, so "
                             f"'best_of' can only be 'n' ({count}) or left out (vLLM V1 does not support best_of "
                             f"either)", "best_of", "unsupported_parameter")


def sampling(request: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The request's sampling fields over the model's ``defaults`` (its ``generation_config.json``'s, as vLLM
    applies them) over OpenAI's (temperature 1, top_p 1), each checked as the engine's :class:`Sampling`
    checks it; ``seed`` any 64-bit integer, ``top_k`` -1 (vLLM's) the engine's 0, ``logit_bias``'s keys
    (strings) token ids."""
    chosen = {**OPENAI_SAMPLING, **defaults,
              **{name: request[name] for name in SAMPLING if request.get(name) is not None}}
    if type(chosen.get("top_k")) is int and chosen["top_k"] == ALL_TOKENS:
        chosen["top_k"] = 0
    if "logit_bias" in chosen:  # JSON's keys are strings: token ids written out
        try:
            chosen["logit_bias"] = logit_bias(chosen["logit_bias"], "'logit_bias'")
        except ProtocolError as error:
            raise ParameterError(str(error), "logit_bias") from None
    for name, value in chosen.items():
        if name == "seed":
            # JSON's integers beyond 64 bits parse as floats
            if isinstance(value, float) and value.is_integer() and not -2**63 <= value < 2**64:
                raise ParameterError(f"'seed' must be an integer from -2**63 to 2**64 - 1, got {value:.0f}", "seed")
            if isinstance(value, bool) or not isinstance(value, int):
                raise ParameterError(f"'seed' must be an integer, got {_shown(value)}", "seed")
            continue
        try:
            Sampling(**{name: value})
        except OptionError as error:
            raise ParameterError(f"'{name}': {error}", name) from None
    return chosen


def logprobs(request: dict[str, Any], endpoint: str) -> int | None:
    """How many of the most likely tokens to give with each output's log-probability (None: no
    log-probabilities): a completion's ``logprobs`` (0 to ``Sampling.MAX_LOGPROBS``), or a chat's
    ``logprobs: true`` with its ``top_logprobs`` (0 by default)."""
    most = Sampling.MAX_LOGPROBS
    if endpoint == "completions":
        asked = integer(request, "logprobs", None, 0, most)
        if asked is not None and flag(request, "echo"):
            raise ParameterError("'echo' with 'logprobs' asks for the prompt's log-probabilities, which jitserve "
                                 "does not compute; send one of them", "echo", "unsupported_parameter")
        return asked
    top = integer(request, "top_logprobs", None, 0, most)
    if not flag(request, "logprobs"):
        if top is not None:
            raise ParameterError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return top or 0


def request_sampling(chosen: dict[str, Any]) -> Sampling:
    """The sampling of a request's choices: a given seed (any integer, taken modulo ``SEEDS``), else a fresh
    one; choice ``i`` samples with it plus ``i`` (``Sampling.choice``: choices differ, and the same seeded
    request gives the same choices)."""
    seed = chosen.get("seed")
    return Sampling(**{**chosen, "seed": None if seed is None else seed % SEEDS})


def stop_sequences(request: dict[str, Any]) -> Any:
    """``stop``: a string, a list of them, or none (null or an empty list)."""
    stop = request.get("stop")
    return None if stop is None or stop == [] else stop


def prompts(value: Any) -> list[Any]:
    """A completion's ``prompt`` as a list of prompts, each a text or a list of token ids: a text, a list of
    texts, a list of token ids, or a list of such lists."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(_token(one) for one in value)):
        return [value]
    if isinstance(value, list) and value and all(
            isinstance(one, str) or (isinstance(one, list) and one and all(_token(t) for t in one)) for one in value):
        return value
    raise ParameterError(f"'prompt' must be a text, a list of texts, a list of token ids or a list of such lists "
                         f"(none empty), got {_shown(value)}",
                         "prompt", "missing_parameter" if value is None else "invalid_value")


def _token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def within(text: str, longest: int, field: str) -> str:
    """``text`` (a prompt's ``field``), refused before it is tokenized when longer than ``longest`` characters."""
    if len(text) > longest:
        raise ParameterError(f"'{field}' is {len(text):,} characters long; the model's context takes at most "
                             f"{longest:,} ({PROMPT_CHARS_PER_TOKEN} per token of its max_length): shorten it",
                             field, "context_length_exceeded")
    return text


def token_ids(ids: Any, vocabulary: int, field: str = "prompt") -> np.ndarray:
    """A prompt (``field``) given as token ids, each in the tokenizer's vocabulary."""
    if not isinstance(ids, list) or not all(_token(one) for one in ids):
        raise ParameterError(f"'{field}' must be a list of token ids (integers), got {_shown(ids)}", field)
    outside = next((one for one in ids if not 0 <= one < vocabulary), None)
    if outside is not None:
        raise ParameterError(f"'{field}' holds the token id {outside}, outside the model's vocabulary (0 to "
                             f"{vocabulary - 1})", field)
    return np.array(ids, np.int32)


def messages(value: Any) -> list[dict[str, Any]]:
    """Chat ``messages``, each an object with a string ``role`` and a ``content``: a string or a list of text
    parts (joined by new lines, as vLLM joins them); null or absent only in an assistant's message (one that
    made tool calls), as OpenAI's API takes them, and then "" to the chat template, as vLLM gives it; what
    else each message holds goes to the template as it came."""
    if not isinstance(value, list) or not value:
        raise ParameterError('\'messages\' must be a non-empty list of {"role": ..., "content": ...} objects',
                             "messages", "missing_parameter" if value is None else "invalid_value")
    checked = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ParameterError(f"{where} must be an object with a string 'role', got {_shown(message)}", where)
        content = message.get("content")
        if isinstance(content, list):
            content = "\n".join(_text_part(part, f"{where}.content[{at}]") for at, part in enumerate(content))
        elif not isinstance(content, str) and (content is not None or message["role"] != "assistant"):
            raise ParameterError(f"{where}.content must be a string or a list of text parts (null only in an "
                                 f"assistant's message), got {_shown(content)}", f"{where}.content",
                                 "missing_parameter" if content is None else "invalid_value")
        checked.append({**message, "content": "" if content is None else content})
    return checked


def _text_part(part: Any, where: str) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return str(part["text"])
    kind = part.get("type") if isinstance(part, dict) else None
    raise ParameterError(f"{where} is {f'a {kind!r} part' if isinstance(kind, str) else _shown(part)}; jitserve's "
                         f"chat models read text parts only ({{\"type\": \"text\", \"text\": ...}})", where)


def texts(value: Any) -> list[str]:
    """An embeddings request's ``input``: a text or a non-empty list of at most ``MAX_INPUTS`` texts (token ids
    are refused: the model's tokenizer reads the texts, with its own special tokens)."""
    chosen: Sequence[Any] = [value] if isinstance(value, str) else value if isinstance(value, list) else ()
    if chosen and len(chosen) <= MAX_INPUTS and all(isinstance(one, str) for one in chosen):
        return list(chosen)
    if isinstance(value, list) and len(value) > MAX_INPUTS:
        raise ParameterError(f"'input' holds {len(value)} texts; send at most {MAX_INPUTS} per request", "input")
    if isinstance(value, list) and value and all(_token(one) or isinstance(one, list) for one in value):
        raise ParameterError("'input' as token ids is not supported: send the texts, which the model's tokenizer "
                             "reads", "input", "unsupported_parameter")
    raise ParameterError(f"'input' must be a text or a non-empty list of texts, got {_shown(value)}", "input",
                         "missing_parameter" if value is None else "invalid_value")


def encoding_format(request: dict[str, Any]) -> str:
    """``encoding_format``: float (when null or absent) or base64."""
    chosen = request.get("encoding_format")
    if chosen is None:
        return "float"
    if chosen not in ENCODINGS:
        raise ParameterError(f"'encoding_format' must be one of {', '.join(ENCODINGS)}, got {_shown(chosen)}",
                             "encoding_format")
    return str(chosen)
