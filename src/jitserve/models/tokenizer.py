"""A checkpoint's own tokenizer, through the ``tokenizers`` package (Hugging Face's Rust tokenizer;
``transformers`` is not needed): ``tokenizer.json`` encodes as ``transformers`` does (its post-processor
adds the special tokens; ``tokenizer_config.json``'s ``add_bos_token`` / ``add_eos_token`` where it says
so), :class:`TextStream` decodes a generation's tokens incrementally (a multi-byte character or a
merged piece is never split or repeated), and the chat template (``chat_template.jinja`` or
``tokenizer_config.json``'s ``chat_template``) renders chat messages with ``jinja2`` as ``transformers``
does."""

from __future__ import annotations

import functools
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import CheckpointError, ModelError
from .checkpoint import Checkpoint

TEMPLATE_CHARS = 1 << 20  # the most text a chat template may render, by default (render_chat's max_chars)
TEMPLATE_CPU_S = 1.0  # a chat template's rendering: at most this many seconds of its thread's CPU time
TEMPLATE_LINES_PER_CHECK = 256  # template lines run between two readings of the CPU clock
CONTEXT_TOKENS = 6  # the prompt's last tokens a stream decodes with its first ones, for their leading space


class Tokenizer:
    """The tokenizer of a checkpoint folder."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        path = os.path.join(checkpoint.folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint {checkpoint.folder!r} has no tokenizer.json (a fast tokenizer, "
                                  f"as transformers saves it); jitserve reads text with it")
        try:
            self.rust = RustTokenizer.from_file(path)
        except Exception as error:  # noqa: BLE001 - the Rust side raises its own class for anything unreadable
            raise CheckpointError(f"checkpoint {checkpoint.folder!r}: tokenizer.json is not readable: "
                                  f"{error}") from None
        settings = checkpoint.json("tokenizer_config.json") or {}
        self.bos = self._special(settings.get("bos_token"))
        self.eos = self._special(settings.get("eos_token"))
        self.pad = self._special(settings.get("pad_token"))
        # the end tokens tokenizer_config.json asks to add where tokenizer.json's post-processor does not
        self.add_bos = self.bos if settings.get("add_bos_token") is True else None
        self.add_eos = self.eos if settings.get("add_eos_token") is True else None
        template_file = os.path.join(checkpoint.folder, "chat_template.jinja")
        if os.path.isfile(template_file):
            with open(template_file, encoding="utf-8") as file:
                self.chat_template: str | None = file.read()
        else:
            template = settings.get("chat_template")
            self.chat_template = template if isinstance(template, str) else None
        # byte-fallback tokens (Llama 2's "<0xE2>") True, other tokens False, special ones absent: a run of
        # bytes decodes as one, to U+FFFD for each byte once one of them is wrong
        byte = self.rust.token_to_id("<0x41>")
        self.byte_runs = None if byte is None or self.token_text(byte) != "A" else self._byte_runs()
        self.bos_text = self._text(settings.get("bos_token"))
        self.eos_text = self._text(settings.get("eos_token"))
        self._chat_templates: dict[tuple[Any, int], Any] = {}  # (template, max_chars) -> it compiled within them

    @staticmethod
    def _text(token: Any) -> str | None:
        """A special token as tokenizer_config.json gives it: a string, or an object with its ``content``."""
        token = token.get("content") if isinstance(token, dict) else token
        return token if isinstance(token, str) else None

    def _special(self, token: Any) -> int | None:
        text = self._text(token)
        return None if text is None else self.rust.token_to_id(text)

    def _byte_runs(self) -> dict[int, bool]:
        special = {i for i, token in self.rust.get_added_tokens_decoder().items() if token.special}
        pieces = self.rust.get_vocab(with_added_tokens=True)
        return {i: re.fullmatch("<0x[0-9A-Fa-f]{2}>", piece) is not None for piece, i in pieces.items()
                if i not in special}

    @property
    def vocabulary(self) -> int:
        return int(self.rust.get_vocab_size(with_added_tokens=True))

    def encode(self, text: Any, special: bool = True) -> np.ndarray:
        """One text's token ids (int32), special tokens added as ``transformers`` adds them (``special``), or
        none added: a chat template's text, which holds its own (``apply_chat_template(tokenize=True)``)."""
        return self.encode_many([text], special)[0][0]

    def encode_many(self, texts: Sequence[Any], special: bool = True) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each text's token ids and token type ids (int32)."""
        decoded = [_as_text(text, i) for i, text in enumerate(texts)]
        encoded = []
        add_bos, add_eos = (self.add_bos, self.add_eos) if special else (None, None)
        for encoding in self.rust.encode_batch(decoded, add_special_tokens=special):
            ids, types = list(encoding.ids), list(encoding.type_ids)
            if add_bos is not None and (not ids or ids[0] != add_bos):
                ids, types = [add_bos, *ids], [0, *types]
            if add_eos is not None and (not ids or ids[-1] != add_eos):
                ids, types = [*ids, add_eos], [*types, 0]
            encoded.append((np.array(ids, np.int32), np.array(types, np.int32)))
        return encoded

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """The text of ``ids``, special tokens left out (unless not ``skip_special``)."""
        return str(self.rust.decode([int(i) for i in ids], skip_special_tokens=skip_special))

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each token's string in the vocabulary (``convert_ids_to_tokens``'s: GPT-2's "Ġthe", Llama's "▁the")."""
        return [str(self.rust.id_to_token(int(i))) for i in ids]

    def token_text(self, token: int) -> str:
        """One token's text alone, a special token's too (a piece of a character shows as U+FFFD)."""
        return str(self.rust.decode([int(token)], skip_special_tokens=False))

    def stream(self, prompt: Sequence[int] | np.ndarray) -> TextStream:
        """A new incremental decoder for the tokens generated after ``prompt``."""
        return TextStream(self, [int(i) for i in prompt[-CONTEXT_TOKENS:]])

    def render_chat(self, messages: Any, add_generation_prompt: bool = True, max_chars: int = TEMPLATE_CHARS,
                    **variables: Any) -> str:
        """Chat ``messages`` (``[{"role": ..., "content": ...}, ...]``) as the prompt text the checkpoint's
        chat template makes of them, rendered as ``transformers`` renders it (a sandboxed ``jinja2``), within
        bounds: at most ``max_chars`` characters of text (a repetition's size is checked before it is made)
        and ``TEMPLATE_CPU_S`` seconds of this thread's CPU time. Every failure, those bounds included, is a
        :class:`~jitserve.errors.ModelError` (a 400) naming the chat template."""
        if self.chat_template is None:
            raise ModelError("this model's tokenizer has no chat template (chat_template.jinja or "
                             "tokenizer_config.json's chat_template); send a plain prompt instead")
        import jinja2

        try:
            template = self._compiled_chat(max_chars)
            return _within(max_chars, template.generate(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_text or "",
                eos_token=self.eos_text or "", **variables))
        except ModelError:
            raise
        except (jinja2.TemplateError, ArithmeticError, RecursionError, MemoryError, TypeError, ValueError,
                LookupError, AttributeError) as error:
            raise ModelError(f"the chat template failed on these messages: {type(error).__name__}: "
                             f"{str(error)[:200]}") from None

    def _compiled_chat(self, max_chars: int) -> Any:
        """The chat template compiled in a bounded sandbox of ``max_chars``, once per template and bound:
        compiling it costs more than rendering it, and a compiled template renders on any thread."""
        key = (self.chat_template, max_chars)
        template = self._chat_templates.get(key)
        if template is None:
            def raise_exception(message: str) -> None:
                raise ModelError(f"the chat template refused the messages: {message}")

            environment = _bounded_sandbox()(trim_blocks=True, lstrip_blocks=True,
                                             extensions=["jinja2.ext.loopcontrols"])
            environment.max_chars = max_chars
            environment.globals["raise_exception"] = raise_exception
            environment.filters = {name: _bounded_filter(name, function, max_chars)
                                   for name, function in {**environment.filters, "tojson": _tojson}.items()}
            template = self._chat_templates[key] = environment.from_string(self.chat_template)
        return template


@functools.cache
def _bounded_sandbox() -> type:
    """jinja2's immutable sandbox (``transformers``' own) in which what could make a value larger than the
    environment's ``max_chars`` is checked before it runs: repetitions, sums, formats and concatenations
    (``'x' * n``, ``n ** m``, ``s + s``, ``'%*s' % (n, s)``, ``s ~ s``), and calls and filters given a
    count past it or a ``replace`` that would grow past it (jinja2 is imported on first use)."""
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCode(CodeGenerator):
        def visit_Concat(self, node: Any, frame: Any) -> None:  # noqa: N802 - ``a ~ b`` through a checked join
            self.write("environment.joined((")
            for value in node.nodes:
                self.visit(value, frame)
                self.write(", ")
            self.write("))")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedCode
        intercepted_binops = frozenset({"*", "**", "+", "%"})
        max_chars = TEMPLATE_CHARS

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_operation(operator, left, right, self.max_chars)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            _check_call(__obj, getattr(__obj, "__name__", ""), getattr(__obj, "__self__", None), args, kwargs,
                        __self.max_chars)
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj: Any, attribute: str) -> Any:  # a format method is checked as it is taken
            if isinstance(obj, str) and attribute in ("format", "format_map"):
                _check_widths(obj, self.max_chars)
            return super().getattr(obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            return self.getattr(obj, argument) if isinstance(obj, str) and isinstance(argument, str) else \
                super().getitem(obj, argument)

        def joined(self, values: Sequence[Any]) -> str:
            texts = [str(value) for value in values]
            if sum(map(len, texts)) > self.max_chars:
                raise ModelError(f"the chat template joins text past its bound of {self.max_chars:,} characters")
            return "".join(texts)

    return BoundedSandbox


def _bounded_filter(name: str, filter_: Any, max_chars: int) -> Any:
    """``filter_`` whose counts and ``replace`` are checked (see :func:`_check_call`) before it runs."""
    taken = 1 + hasattr(filter_, "jinja_pass_arg")  # its context, environment or evaluation context comes first

    @functools.wraps(filter_)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_call(filter_, name, args[taken - 1] if len(args) >= taken else None, args[taken:], kwargs,
                    max_chars)
        return filter_(*args, **kwargs)
    return bounded


def _too_large(what: str, max_chars: int) -> ModelError:
    return ModelError(f"the chat template {what}, past its bound of {max_chars:,} characters")


def _check_call(function: Any, name: str, subject: Any, args: Sequence[Any], kwargs: dict[str, Any],
                max_chars: int) -> None:
    """Refuse a call given a count past ``max_chars`` (``'x'.ljust(n)``, ``indent(n)``), a ``replace`` of
    ``subject`` whose result would pass it, or a format of ``subject`` whose widths would."""
    counts = [value for value in (*args, *kwargs.values()) if isinstance(value, int) and abs(value) > max_chars]
    if counts:
        raise _too_large(f"calls {name or function!r} with {counts[0]:.3g}", max_chars)
    if isinstance(subject, str):
        if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
            grown = len(subject) + subject.count(args[0]) * (len(args[1]) - len(args[0])) if args[0] else \
                len(subject) * (len(args[1]) + 1)
            if grown > max_chars:
                raise _too_large(f"replaces text into {grown:.3g} characters", max_chars)
        elif name == "format":  # the format filter (the format methods are checked as they are taken)
            _check_widths(subject, max_chars)


def _check_widths(text: str, max_chars: int) -> None:
    """Refuse a format string (``%`` or ``str.format``'s) that asks for a width past ``max_chars``."""
    for width in re.findall(r"%[-+ #0]*(\d+)|\{[^{}]*:[^{}]*?(\d+)[^{}]*\}", text):
        if int(width[0] or width[1]) > max_chars:
            raise _too_large(f"formats text {int(width[0] or width[1]):.3g} wide", max_chars)


def _check_operation(operator: str, left: Any, right: Any, max_chars: int) -> None:
    """Refuse ``left <operator> right`` whose result would be larger than ``max_chars`` (characters or items
    of a sequence, bits of a power)."""
    if operator == "*":
        for sequence, count in ((left, right), (right, left)):
            if isinstance(sequence, str | list | tuple) and isinstance(count, int) and \
                    len(sequence) * count > max_chars:
                raise _too_large(f"repeats a sequence of {len(sequence)} {count:.3g} times", max_chars)
    elif operator == "+":
        if isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple) and \
                len(left) + len(right) > max_chars:
            raise _too_large(f"adds sequences of {len(left) + len(right)}", max_chars)
    elif operator == "%":
        if isinstance(left, str):
            _check_widths(left, max_chars)
            _check_call(str.__mod__, "%", left, right if isinstance(right, tuple) else (right,), {}, max_chars)
    elif isinstance(left, int) and isinstance(right, int) and right > 0 and \
            max(abs(left), 2).bit_length() * right > 8 * max_chars:
        raise _too_large(f"raises a number to the power {right:.3g}", max_chars)


def _within(max_chars: int, pieces: Any) -> str:
    """The text of a template's ``pieces`` (its generator), rendered under a CPU-time deadline (a trace of the
    template's own lines), refused once it grows past ``max_chars``."""
    deadline = time.thread_time() + TEMPLATE_CPU_S
    lines = 0

    def line(frame: Any, event: str, argument: Any) -> Any:
        nonlocal lines
        lines += 1
        if lines % TEMPLATE_LINES_PER_CHECK == 0 and time.thread_time() > deadline:
            raise ModelError(f"the chat template ran past its bound of {TEMPLATE_CPU_S:g} s of CPU time")
        return line

    def call(frame: Any, event: str, argument: Any) -> Any:
        return line if frame.f_code.co_filename == "<template>" else None

    text: list[str] = []
    size = 0
    before = sys.gettrace()
    sys.settrace(call)
    try:
        for piece in pieces:
            size += len(piece)
            if size > max_chars:
                raise ModelError(f"the chat template rendered more than its bound of {max_chars:,} characters")
            text.append(piece)
    finally:
        sys.settrace(before)
    return "".join(text)


class TextStream:
    """Decodes a generation's tokens to text as they come (the offsets of TGI's and vLLM's detokenizer):
    text goes out only once it no longer ends in an unfinished character (U+FFFD), nor in a run of
    byte-fallback tokens that a next byte could still turn into U+FFFD, so a character split across byte
    tokens arrives whole, and pieces that merge on decoding are sent once. The prompt's last tokens lead, so a
    first token's leading space is kept as it reads after the prompt; where the prompt ends in an unfinished
    character, the piece that finishes it goes out whole."""

    __slots__ = ("tokenizer", "ids", "read", "sent", "in_bytes")

    def __init__(self, tokenizer: Tokenizer, context: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = context  # the ids sent last (their text leads the next decoding), then those held
        self.read = len(context)
        self.sent = tokenizer.decode(context)  # the text of ids[:read]
        self.in_bytes = False  # the ids held end in byte-fallback tokens (special tokens aside)

    def feed(self, token: Any) -> str:
        """The new text once ``token`` came ("" while a character is unfinished)."""
        token = int(token)
        self.ids.append(token)
        if self.tokenizer.byte_runs is not None:
            self.in_bytes = self.tokenizer.byte_runs.get(token, self.in_bytes)
        text = self.tokenizer.decode(self.ids)
        return "" if self.in_bytes or text.endswith("\ufffd") else self._send(text)

    def finish(self) -> str:
        """What is still held when the tokens end (an unfinished character, as decoding shows it), once."""
        return self._send(self.tokenizer.decode(self.ids))

    def _send(self, text: str) -> str:
        """``text``'s part past what went out (from the first character that changed, where the prompt's
        unfinished one did); the held ids then lead the next decoding."""
        kept = len(self.sent) if text.startswith(self.sent) else _common_start(self.sent, text)
        if kept == len(text):
            return ""
        del self.ids[:self.read]
        self.read = len(self.ids)
        self.sent = self.tokenizer.decode(self.ids)
        return text[kept:]


def _common_start(one: str, other: str) -> int:
    """How many characters ``one`` and ``other`` begin with alike."""
    return next((i for i, (a, b) in enumerate(zip(one, other)) if a != b), min(len(one), len(other)))


def _as_text(text: Any, index: int) -> str:
    if isinstance(text, np.generic):
        text = text.item()
    if isinstance(text, bytes):
        try:
            return text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ModelError(f"text {index} is not UTF-8: {error}") from None
    if not isinstance(text, str):
        raise ModelError(f"text {index} is {type(text).__name__}; expected a string (str, or UTF-8 bytes)")
    return text


def _tojson(value: Any, indent: int | None = None) -> str:
    import json

    return json.dumps(value, ensure_ascii=False, indent=indent)
