"""OpenAI's API on the HTTP port: the ``/v1`` door to the text generations and embedding models that
``js.from_pretrained`` made (their ``preprocess`` a ``TextHook``, which gives the tokenizer and the task).

- ``GET /v1/models`` and ``/v1/models/{id}``: those models, in OpenAI's list shape (``owned_by: jitserve``,
  ``created`` when this server started; a generation's ``max_model_len``, as vLLM lists it).
- ``POST /v1/completions``: ``prompt`` (a text, a list of texts, token ids, or lists of them), ``max_tokens``
  (default 16), ``temperature`` and ``top_p`` (OpenAI's defaults, 1: a request samples unless it sends
  ``temperature: 0``), ``top_k`` (-1 or 0: no limit), ``min_p``, ``repetition_penalty``, ``min_tokens`` (outputs
  before which the end token is never picked), ``stop_token_ids`` (ids that end the text as the end
  token does, kept in it) and ``ignore_eos`` (the end token ends nothing: vLLM's extensions), ``presence_penalty``,
  ``frequency_penalty``, ``logit_bias`` (token ids as string keys), ``seed``, ``stop``, ``n`` (n requests, the
  ``i``-th seeded ``seed + i`` when a seed is given), ``echo``, ``logprobs`` (0 to 20: each token's
  log-probability under the model, the most likely tokens' and the chosen one's by text, and ``text_offset``;
  not with ``echo``, whose prompt's log-probabilities jitserve does not compute), ``stream``, ``best_of`` only
  equal to ``n`` (every choice generated is returned; vLLM V1 does not support it either).
- ``POST /v1/chat/completions``: ``messages`` rendered by the checkpoint's chat template and encoded without
  adding special tokens (the template writes its own, as ``transformers``' ``apply_chat_template`` encodes
  it); a checkpoint without a chat template is a 400 naming it. ``max_tokens`` (or
  ``max_completion_tokens``) defaults to the room the model has left; ``logprobs: true`` with
  ``top_logprobs`` (0 to 20) gives ``logprobs.content``, per token its text, log-probability and UTF-8 bytes;
  ``parallel_tool_calls`` (true or false) asks for nothing without ``tools`` and is taken, as vLLM takes it
  (OpenAI refuses it there); ``tools`` themselves are refused by name.
- ``POST /v1/embeddings``: ``input`` (a text or a list of texts), ``encoding_format`` ``float`` or
  ``base64``.
- vLLM's ``POST /tokenize`` and ``/detokenize`` (beside ``/v1``, as vLLM serves them): a text generation's
  tokenizer over HTTP, in vLLM's shapes; ``model`` may be left out where one text generation is served. And
  vLLM's ``GET /tokenizer_info`` for that one (lm-eval's ``tokenizer_backend=remote`` reads the three): its
  special tokens, length and chat template.

A prompt and its ``max_tokens`` must fit the generation's ``max_length``, as OpenAI's API refuses a
request past the context (code ``context_length_exceeded``, ``param`` the field to shorten). ``usage``
counts the tokens the engine read and produced (an ``eos`` included);
``finish_reason`` is the engine's (its scheduler decides every end: ``stop`` at an end token or a stop id, ``length``
at ``max_tokens``), or ``stop`` at a stop sequence, which this door cuts. A stream is
server-sent ``data:`` chunks ending in ``data: [DONE]``, each with the log-probabilities of the tokens its
text came of where asked; ``stream_options.include_usage`` adds a last chunk with the usage, and with it vLLM's
``continuous_usage_stats`` gives every chunk its choice's usage so far (its prompt's tokens and those it has
generated), as vLLM does; an error once it started is a chunk ``{"error": ...}`` before it.

Each request goes to the engine the in-process and KServe callers use (one engine, three doors): a
generation's typed ``pieces_async`` (text, log-probabilities, tokens so far, why it ended: the engine's
``Delivery``, with the stop sequences), as ``protocol/model.py`` reads its ``open_stream``; a serving through
``InferenceService.infer``. Fields are checked in
``protocol/openai_request.py``; errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import base64
import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import orjson

from ..errors import OptionError, ParameterError, UnknownServerError
from ..models.pretrained import TextHook, text_hook
from ..models.tokenizer import Tokenizer
from ..serving.generation import Choices, Prompt, TokenLogprobs, stop_text
from ..serving.request import off_loop
from . import openai_request as fields
from .access import REQUEST_ROWS
from .http_request import json_object
from .llm import prompt_chars
from .model import GenerationSpec, ModelSpec
from .service import InferenceService, Spec, status_of

Response = tuple[int, list[tuple[bytes, bytes]], bytes]
JSON_HEADERS = [(b"content-type", b"application/json")]
DONE = b"data: [DONE]\n\n"
COMPLETION_TOKENS = 16  # /v1/completions' default max_tokens (OpenAI's)
KINDS = {GenerationSpec: "generation", ModelSpec: "embedding"}  # the OpenAI models of each spec, by the hook's task
WHAT = {"generation": "a text generation", "embedding": "an embedding model"}
NAME_ONE = "'model' must name one of the {count} text generations served: {names}"  # where several are served
INFO_OF_ONE = ("GET /tokenizer_info answers where one text generation is served (vLLM's takes no model, as it "
               "serves one); this server serves {count}: {names}")


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> Response:
    """An error response in OpenAI's shape (``type``: ``invalid_request_error`` for a client's mistake,
    ``server_error`` for the server's)."""
    error = {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
             "param": param, "code": code}
    headers = [*JSON_HEADERS, (b"retry-after", b"1")] if status == 503 else JSON_HEADERS
    return status, headers, orjson.dumps({"error": error})


def _where(error: BaseException) -> tuple[str | None, str | None]:
    """The ``param`` and ``code`` of an error."""
    if isinstance(error, ParameterError):
        return error.param, error.code
    return ("model", "model_not_found") if isinstance(error, UnknownServerError) else (None, None)


def _finite(logprob: float) -> float:
    """A log-probability JSON can carry: -inf (a token the model rules out) as -9999.0, as vLLM gives it."""
    return max(logprob, -9999.0)


def _event(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n\n"


class _Choice:
    """What the answer keeps of one choice: the text echo repeats (``prompt``), its prompt's tokens, its own
    counted as its pieces come (``tokens``), why it ended (``finish_reason``: the engine's reason, or a stop
    sequence's), whether it asked for the ``top`` most likely tokens' log-probabilities, and where its next
    token's text starts (``offset``, for a completion's ``text_offset``)."""

    __slots__ = ("index", "prompt", "prompt_tokens", "tokens", "finish_reason", "top", "offset")

    def __init__(self, index: int, prompt: str, prompt_tokens: int, top: int | None) -> None:
        self.index = index
        self.prompt = prompt
        self.prompt_tokens = prompt_tokens
        self.tokens = 0
        self.finish_reason: str | None = None
        self.top = top
        self.offset = 0

    def usage(self) -> dict[str, int]:
        """This choice's usage so far (vLLM's ``continuous_usage_stats``): its prompt and its tokens."""
        return _usage(self.prompt_tokens, self.tokens)


class _Choices:
    """A request's choices in the engine (``engine``: the generation's ``choices_async``, which fans out
    ``n``) and what the answer keeps of each (``all``)."""

    def __init__(self, engine: Choices, all: list[_Choice]) -> None:
        self.engine = engine
        self.all = all

    async def each(self) -> AsyncIterator[tuple[_Choice, str | None, list[TokenLogprobs]]]:
        """Every choice's text pieces as they come, each with the log-probabilities of its tokens (where the
        choice asked for them), and ``(choice, None, [])`` once it ended; the first error raises, and ends the
        other choices."""
        async for index, piece in self.engine.each():
            choice = self.all[index]
            choice.tokens = piece.outputs
            choice.finish_reason = piece.finish_reason
            yield choice, piece.item, piece.logprobs or []

    async def close(self) -> None:
        await self.engine.close()

    def usage(self, prompt_tokens: int) -> dict[str, int]:
        return _usage(prompt_tokens, sum(choice.tokens for choice in self.all))


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _Completion:
    """How ``/v1/completions`` answers: ``text_completion`` objects, ``text`` per choice."""

    object = "text_completion"
    chunk_object = "text_completion"
    prefix = "cmpl-"
    prompt_field = "prompt"  # the field a request past the model's context must shorten

    def __init__(self, tokenizer: Tokenizer, echo: bool = False) -> None:
        self.tokenizer = tokenizer
        self.echo = echo

    def opening(self, choice: _Choice) -> dict[str, Any] | None:
        return self.choice(choice, choice.prompt, None) if self.echo else None

    def choice(self, choice: _Choice, text: str | None, finish: str | None,
               scores: Sequence[TokenLogprobs] = ()) -> dict[str, Any]:
        return {"index": choice.index, "text": text or "", "logprobs": self.logprobs(choice, scores),
                "finish_reason": finish}

    def whole(self, choice: _Choice, text: str, scores: Sequence[TokenLogprobs]) -> dict[str, Any]:
        return self.choice(choice, choice.prompt + text if self.echo else text, choice.finish_reason, scores)

    def logprobs(self, choice: _Choice, scores: Sequence[TokenLogprobs]) -> dict[str, Any] | None:
        """The log-probabilities of ``scores`` (a choice's tokens, or a chunk's) as the legacy completions give
        them: each token's text, its log-probability, the most likely tokens' (and always the chosen one's) by
        text, and where its text starts; None where the request did not ask."""
        if choice.top is None or not scores:
            return None
        tokens = [self.tokenizer.token_text(score.token) for score in scores]
        offsets = []
        for text in tokens:
            offsets.append(choice.offset)
            choice.offset += len(text)
        top = [{**{self.tokenizer.token_text(token): _finite(logprob) for token, logprob in score.top},
                **{text: _finite(score.logprob)}} for text, score in zip(tokens, scores)]
        return {"tokens": tokens, "token_logprobs": [_finite(score.logprob) for score in scores],
                "top_logprobs": top, "text_offset": offsets}


class _Chat(_Completion):
    """How ``/v1/chat/completions`` answers: ``chat.completion`` objects, an assistant ``message`` per choice;
    streamed, a ``delta`` with the role first, then the content's pieces."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prefix = "chatcmpl-"
    prompt_field = "messages"

    def opening(self, choice: _Choice) -> dict[str, Any] | None:
        return {"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def choice(self, choice: _Choice, text: str | None, finish: str | None,
               scores: Sequence[TokenLogprobs] = ()) -> dict[str, Any]:
        return {"index": choice.index, "delta": {} if text is None else {"content": text},
                "logprobs": self.logprobs(choice, scores), "finish_reason": finish}

    def whole(self, choice: _Choice, text: str, scores: Sequence[TokenLogprobs]) -> dict[str, Any]:
        return {"index": choice.index, "message": {"role": "assistant", "content": text},
                "logprobs": self.logprobs(choice, scores), "finish_reason": choice.finish_reason}

    def logprobs(self, choice: _Choice, scores: Sequence[TokenLogprobs]) -> dict[str, Any] | None:
        """The log-probabilities of ``scores`` as chat gives them: per token its text, log-probability and
        UTF-8 bytes, and the ``top_logprobs`` most likely tokens' alike; None where the request did not ask."""
        if choice.top is None or not scores:
            return None
        return {"content": [{**self._token(score.token, score.logprob),
                             "top_logprobs": [self._token(token, logprob) for token, logprob in score.top]}
                            for score in scores]}

    def _token(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.tokenizer.token_text(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}


class OpenAIDoor:
    """The ``/v1`` routes' handlers over ``service``'s models."""

    def __init__(self, service: InferenceService) -> None:
        self.service = service
        self.started = int(time.time())
        self.endpoints = {"completions": self.completions, "chat/completions": self.chat,
                          "embeddings": self.embeddings, "tokenize": self.tokenize, "detokenize": self.detokenize}

    async def models(self) -> Response:
        cards = [self._card(name, spec) for name, spec in self.service.models.items() if _hook(spec) is not None]
        return 200, JSON_HEADERS, orjson.dumps({"object": "list", "data": cards})

    async def model(self, model: str) -> Response:
        try:
            spec, _ = self._spec(model, None)
        except Exception as error:  # noqa: BLE001 - statuses by error class
            return openai_error(status_of(error)[0], str(error), *_where(error))
        return 200, JSON_HEADERS, orjson.dumps(self._card(model, spec))

    def _card(self, name: str, spec: Spec) -> dict[str, Any]:
        """OpenAI's model object; a text generation's with its ``max_model_len`` too, as vLLM lists it."""
        card = {"id": name, "object": "model", "created": self.started, "owned_by": "jitserve"}
        return {**card, "max_model_len": spec.server.generation.max_length} if isinstance(spec, GenerationSpec) \
            else card

    def _spec(self, model: str, kind: str | None) -> tuple[Any, TextHook]:
        """The served model ``model`` and its hook, if it is an OpenAI model (of ``kind``, when given)."""
        spec = self.service.model(model)
        hook = _hook(spec)
        if hook is None:
            raise UnknownServerError(f"model '{model}' is not served by the OpenAI API: it is neither a text "
                                     f"generation nor an embedding model made by from_pretrained; call "
                                     f"/v2/models/{model}/infer")
        if kind is not None and hook.task != kind:
            raise ParameterError(f"model '{model}' is {WHAT[hook.task]}, not {WHAT[kind]}", "model",
                                 "model_not_supported")
        return spec, hook

    def _only_generation(self, refusal: str = NAME_ONE) -> str:
        """The one text generation served (vLLM's tokenizer routes take no ``model`` where one model is served),
        else ``refusal`` (``{count}`` and ``{names}`` those served)."""
        names = [name for name, spec in self.service.models.items()
                 if isinstance(spec, GenerationSpec) and _hook(spec) is not None]
        if len(names) != 1:
            raise ParameterError(refusal.format(count=len(names), names=", ".join(names) or "none"), "model",
                                 "missing_parameter")
        return names[0]

    def refused(self, model: str, error: BaseException) -> Response:
        """A failed request: counted, logged (see ``InferenceService.failed``), answered in OpenAI's shape."""
        status, _, message = self.service.failed("http", model, error)
        return openai_error(status, message, *_where(error))

    async def post(self, endpoint: str, body: bytes) -> Response | AsyncIterator[bytes]:
        """``POST /v1/{endpoint}`` (or vLLM's ``/tokenize`` and ``/detokenize``): the answer, or a stream's
        events."""
        model = ""
        try:
            request = await off_loop(len(body), lambda: json_object(body, "the request"))
            model = request["model"] if isinstance(request.get("model"), str) else ""
            fields.check_fields(request, endpoint)
            model = self._only_generation() if endpoint in fields.ROOT_ENDPOINTS and request.get("model") is None \
                else fields.model_name(request)
            return await self.endpoints[endpoint](model, request, len(body))
        except Exception as error:  # noqa: BLE001 - statuses by error class; the model's own failure is a 500
            return self.refused(model, error)

    async def completions(self, model: str, request: dict[str, Any], size: int) -> Response | AsyncIterator[bytes]:
        spec, hook = self._spec(model, "generation")
        longest = prompt_chars(spec.server.generation.max_length)
        prompts = await off_loop(size, lambda: [_prompt(hook, one, longest)
                                                for one in fields.prompts(request.get("prompt"))])
        return await self._generate(spec, request, prompts, "max_tokens", COMPLETION_TOKENS,
                                    _Completion(hook.tokenizer, fields.flag(request, "echo")),
                                    fields.logprobs(request, "completions"))

    async def chat(self, model: str, request: dict[str, Any], size: int) -> Response | AsyncIterator[bytes]:
        spec, hook = self._spec(model, "generation")
        tokenizer = hook.tokenizer
        fields.flag(request, "parallel_tool_calls")  # checked; it asks for nothing without tools (refused by name)
        text = await off_loop(size, lambda: _chat_text(model, tokenizer, request, True, spec))
        ids = await off_loop(len(text), lambda: tokenizer.encode(text, special=False))
        given = [name for name in ("max_completion_tokens", "max_tokens") if request.get(name) is not None]
        if len(given) == 2 and request["max_tokens"] != request["max_completion_tokens"]:
            raise ParameterError("'max_tokens' and 'max_completion_tokens' differ; send one of them",
                                 "max_completion_tokens")
        return await self._generate(spec, request, [(ids, "")], given[0] if given else "max_tokens", None,
                                    _Chat(tokenizer), fields.logprobs(request, "chat/completions"))

    async def tokenize(self, model: str, request: dict[str, Any], size: int) -> Response:
        """vLLM's ``POST /tokenize``: the token ids of a ``prompt`` (special tokens added as the tokenizer adds
        them, unless ``add_special_tokens`` is false) or of chat ``messages`` as ``/v1/chat/completions``
        encodes them (``add_generation_prompt`` true, ``add_special_tokens`` false, unless told otherwise);
        their count, the model's length, and each token's string where ``return_token_strs`` asks."""
        spec, hook = self._spec(model, "generation")
        tokenizer = hook.tokenizer
        if (request.get("prompt") is None) == (request.get("messages") is None):
            raise ParameterError("send a 'prompt' (a text) or chat 'messages', one of them", "prompt")
        if request.get("messages") is not None:
            generation_prompt = fields.flag(request, "add_generation_prompt", True)
            text = await off_loop(size, lambda: _chat_text(model, tokenizer, request, generation_prompt, spec))
            special = fields.flag(request, "add_special_tokens")
        else:
            text = fields.within(fields.text(request, "prompt"), prompt_chars(spec.server.generation.max_length),
                                 "prompt")
            special = fields.flag(request, "add_special_tokens", True)
        strings = fields.flag(request, "return_token_strs")
        ids, shown = await off_loop(len(text), lambda: _tokens(tokenizer, text, special, strings))
        return 200, JSON_HEADERS, orjson.dumps({"count": len(ids), "max_model_len": spec.server.generation.max_length,
                                                "tokens": ids, "token_strs": shown})

    async def tokenizer_info(self) -> Response:
        """vLLM's ``GET /tokenizer_info`` (lm-eval's ``tokenizer_backend=remote`` reads it, with ``/tokenize`` and
        ``/detokenize``) for the one text generation served: the tokenizer's class as ``transformers`` reads a
        ``tokenizer.json`` alone, its special tokens' text, the model's length and its chat template (see
        :func:`_tokenizer_info`)."""
        try:
            spec, hook = self._spec(self._only_generation(INFO_OF_ONE), "generation")
        except Exception as error:  # noqa: BLE001 - statuses by error class
            return self.refused("", error)
        return 200, JSON_HEADERS, orjson.dumps(_tokenizer_info(hook.tokenizer, spec.server.generation.max_length))

    async def detokenize(self, model: str, request: dict[str, Any], size: int) -> Response:
        """vLLM's ``POST /detokenize``: the text of ``tokens``, special tokens included (as vLLM decodes it)."""
        _, hook = self._spec(model, "generation")
        text = await off_loop(size, lambda: hook.tokenizer.decode(
            fields.token_ids(request.get("tokens"), hook.vocabulary, "tokens").tolist(), skip_special=False))
        return 200, JSON_HEADERS, orjson.dumps({"prompt": text})

    async def _generate(self, spec: GenerationSpec, request: dict[str, Any], prompts: list[tuple[np.ndarray, str]],
                        steps_field: str, default_steps: int | None, shape: _Completion, top: int | None
                        ) -> Response | AsyncIterator[bytes]:
        """Submit every choice of every prompt now (their errors raise here, before the answer starts), each
        with log-probabilities where ``top`` (the most likely tokens to give with them) is not None; the
        answer once they end, or a stream of their pieces."""
        server = spec.server
        max_length = server.generation.max_length
        count = fields.integer(request, "n", 1, 1, fields.MAX_CHOICES) or 1
        if count * len(prompts) > fields.MAX_CHOICES:
            if count > 1:
                raise ParameterError(f"{len(prompts)} prompts of {count} choices each make {count * len(prompts)} "
                                     f"generations; ask for at most {fields.MAX_CHOICES}", "n")
            raise ParameterError(f"{len(prompts)} prompts make {len(prompts)} generations; send at most "
                                 f"{fields.MAX_CHOICES} per request", "prompt")
        stream = fields.flag(request, "stream")
        usage = fields.stream_usage(request, stream)
        fields.best_of(request, count)
        chosen = {**fields.sampling(request, server.generation.default_sampling), "logprobs": top}
        stop = fields.stop_sequences(request)
        try:
            stop_text(server.generation, stop)
        except OptionError as error:
            raise ParameterError(f"'stop': {error}", "stop") from None
        asked = fields.integer(request, steps_field, default_steps)
        if asked is not None and chosen.get("min_tokens", 0) > asked:
            raise ParameterError(f"'min_tokens' ({chosen['min_tokens']}) must be at most '{steps_field}' ({asked})",
                                 "min_tokens")
        for ids, _ in prompts:
            room = max_length - ids.size
            if room < 1 or (asked is not None and asked > room):
                raise ParameterError(f"model '{spec.name}' generates at most {max_length} tokens per sequence (its "
                                     f"max_length); the prompt has {ids.size}"
                                     + (f", which leaves room for {room}: ask for at most {room} with "
                                        f"'{steps_field}'" if room >= 1 else ": shorten it"),
                                     steps_field if room >= 1 else shape.prompt_field, "context_length_exceeded")
        if self.service.access_log:
            REQUEST_ROWS.set(count * len(prompts))
        sampling = fields.request_sampling(chosen)
        timeout = self.service.request_timeout
        engine = await server.choices_async([(Prompt(text, asked or max_length - ids.size, sampling, stop, timeout),
                                              ids) for ids, text in prompts], count)
        choices = _Choices(engine, [_Choice(index, prompts[index // count][1], prompts[index // count][0].size,
                                            top) for index in range(count * len(prompts))])
        answer = {"id": shape.prefix + os.urandom(12).hex(), "object": shape.object, "created": int(time.time()),
                  "model": spec.name}
        prompt_tokens = sum(ids.size for ids, _ in prompts)
        if stream:
            return self._stream(spec, choices, shape, answer, prompt_tokens, *usage)
        pieces: list[list[str]] = [[] for _ in choices.all]
        scores: list[list[TokenLogprobs]] = [[] for _ in choices.all]
        with self.service.tallied(spec):
            async for choice, piece, scored in choices.each():
                if piece:
                    pieces[choice.index].append(piece)
                scores[choice.index] += scored
        self.service.count(spec.name, "http", 200, spec.version)
        answer["choices"] = [shape.whole(choice, "".join(pieces[choice.index]), scores[choice.index])
                             for choice in choices.all]
        answer["usage"] = choices.usage(prompt_tokens)
        return 200, JSON_HEADERS, orjson.dumps(answer)

    async def _stream(self, spec: GenerationSpec, choices: _Choices, shape: _Completion, answer: dict[str, Any],
                      prompt_tokens: int, usage_chunk: bool, usage_always: bool) -> AsyncIterator[bytes]:
        """The chunks of a streamed answer: each choice's opening (a chat's role, a completion's echo), its
        pieces, its end with its ``finish_reason``, each with its choice's usage so far where ``usage_always``
        (vLLM's ``continuous_usage_stats``); the usage when asked; then ``[DONE]``."""
        chunk = {**answer, "object": shape.chunk_object, **({"usage": None} if usage_chunk else {})}

        def event(choice: _Choice, body: dict[str, Any]) -> bytes:
            return _event({**chunk, "choices": [body], **({"usage": choice.usage()} if usage_always else {})})

        try:
            with self.service.tallied(spec):
                for choice in choices.all:
                    opening = shape.opening(choice)
                    if opening is not None:
                        yield event(choice, opening)
                async for choice, piece, scored in choices.each():
                    finish = None if piece is not None else choice.finish_reason
                    yield event(choice, shape.choice(choice, piece, finish, scored))
            if usage_chunk:
                yield _event({**chunk, "choices": [], "usage": choices.usage(prompt_tokens)})
        except Exception as error:  # noqa: BLE001 - the stream has started: the error is its last chunk
            status, _, message = self.service.failed("http", spec.name, error, spec.version)
            yield _event(orjson.loads(openai_error(status, message, *_where(error))[2]))
        else:
            self.service.count(spec.name, "http", 200, spec.version)
        finally:
            await choices.close()
        yield DONE

    async def embeddings(self, model: str, request: dict[str, Any], size: int) -> Response:
        spec, hook = self._spec(model, "embedding")
        texts = fields.texts(request.get("input"))
        encoding = fields.encoding_format(request)
        width = spec.outputs[0].row_shape[0]
        if request.get("dimensions") is not None and request["dimensions"] != width:
            raise ParameterError(f"'dimensions' is {request['dimensions']!r:.40}, but model '{model}' gives vectors "
                                 f"of {width}; shortening them is not supported: leave it out", "dimensions",
                                 "unsupported_parameter")
        tokens = await off_loop(size, lambda: sum(ids.size for ids, _ in hook.tokenizer.encode_many(texts)))
        text = np.empty(len(texts), object)
        text[:] = texts
        served, outputs = await self.service.infer(model, {"text": text}, None)
        vectors = np.asarray(dict(outputs)["embedding"], np.float32)
        self.service.count(model, "http", 200, served)
        data = [{"object": "embedding", "index": index,
                 "embedding": base64.b64encode(vector.astype("<f4").tobytes()).decode() if encoding == "base64"
                 else vector} for index, vector in enumerate(vectors)]
        return 200, JSON_HEADERS, orjson.dumps({"object": "list", "data": data, "model": model,
                                                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
                                               option=orjson.OPT_SERIALIZE_NUMPY)


def _prompt(hook: TextHook, prompt: Any, longest: int) -> tuple[np.ndarray, str]:
    """One prompt of a completion (a text of at most ``longest`` characters, or token ids): its ids, its text."""
    if isinstance(prompt, str):
        return hook.tokenizer.encode(fields.within(prompt, longest, "prompt")), prompt
    return fields.token_ids(prompt, hook.vocabulary), hook.tokenizer.decode(prompt)


def _tokens(tokenizer: Tokenizer, text: str, special: bool, strings: bool) -> tuple[list[int], list[str] | None]:
    """``/tokenize``'s answer: the ids of ``text`` and, where asked, each one's string."""
    ids = tokenizer.encode(text, special).tolist()
    return ids, tokenizer.token_strings(ids) if strings else None


def _tokenizer_info(tokenizer: Tokenizer, max_length: int) -> dict[str, Any]:
    """``/tokenizer_info``'s answer: the fields of ``tokenizer_config.json`` jitserve reads, in vLLM's shape
    (``transformers``' ``init_kwargs``, special tokens as their text): ``tokenizer_class``, ``bos_token``,
    ``eos_token`` and ``pad_token`` (null where the checkpoint has none), ``model_max_length`` (the generation's
    ``max_length``, what it takes), and ``chat_template`` where it has one."""
    pad = None if tokenizer.pad is None else tokenizer.token_strings([tokenizer.pad])[0]
    info = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_text,
            "eos_token": tokenizer.eos_text, "pad_token": pad, "model_max_length": max_length}
    return info if tokenizer.chat_template is None else {**info, "chat_template": tokenizer.chat_template}


def _chat_text(model: str, tokenizer: Tokenizer, request: dict[str, Any], generation_prompt: bool,
               spec: GenerationSpec) -> str:
    """A request's chat ``messages`` rendered by the checkpoint's chat template (a 400 where it has none), at
    most as long as a prompt ``spec``'s generation could take."""
    messages = fields.messages(request.get("messages"))
    if tokenizer.chat_template is None:
        raise ParameterError(f"model '{model}' has no chat template (its checkpoint has no chat_template.jinja "
                             f"and no chat_template in tokenizer_config.json) to render the messages with; "
                             f"send a 'prompt' instead (to /v1/completions for a completion)", "messages",
                             "missing_chat_template")
    return tokenizer.render_chat(messages, add_generation_prompt=generation_prompt,
                                 max_chars=prompt_chars(spec.server.generation.max_length))


def _hook(spec: Spec) -> TextHook | None:
    """The hook of a model the OpenAI API serves: a checkpoint's text generation or embedding model."""
    hook = text_hook(spec.server.servable)
    return hook if hook is not None and KINDS[type(spec)] == hook.task else None

