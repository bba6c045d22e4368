"""Outputs on their way to a generation's callers, from the loop's hand-over to what each caller reads.

On the loop's side, :func:`hand_over` gives each request the outputs of a launch
that the scheduler's update gave it, in step order, then its end with the reason,
in one hand-over for all the streams of one asyncio event loop. On the caller's
side, the request's stream is read by the one waiting loop of both engines
(:func:`~jitserve.serving.request.read`), and :class:`Delivery` makes what
the caller gets of each output (``postprocess``, or the text of a request's
own incremental ``detokenizer``, cut at a stop sequence: :class:`StopText`);
:func:`stacked` puts a whole request's outputs on one axis.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, Generator, Sequence
from typing import Any, NamedTuple

import numpy as np

from ...errors import OptionError
from ..request import End, Stream, put_all
from .scheduler import SlotRequest
from .spec import Generation, Sampling


class GenerationRequest(SlotRequest):
    """One prompt in flight: its outputs go to ``stream`` as they come, then END (or an exception);
    ``admitted`` is set once it has a slot; ``submitted``: when it was queued; ``waited_s``: how long it
    waited for its prefill; ``input_s``, ``infer_s``, ``output_s``: the phases of the launches it was part
    of so far (its statistics once it completes)."""

    __slots__ = ("stream", "admitted", "submitted", "waited_s", "input_s", "infer_s", "output_s")

    def __init__(self, prompt: np.ndarray, max_steps: int, sampling: Sampling, max_length: int,
                 loop: asyncio.AbstractEventLoop | None) -> None:
        super().__init__(prompt, max_steps, sampling, max_length)
        self.stream = Stream(loop)
        self.admitted = threading.Event()
        self.submitted = time.perf_counter()
        self.waited_s = self.input_s = self.infer_s = self.output_s = 0.0


class TokenLogprobs(NamedTuple):
    """One output of a request that asked for ``logprobs`` (see :class:`~.spec.Sampling`): its ``token``, its
    log-probability under the model (``logprob``), and the ``top`` most likely tokens and theirs, as many as
    the request asked, highest first: ``((token, logprob), ...)``."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def hand_over(requests: Sequence[GenerationRequest], rows: Sequence[int], outputs: np.ndarray,
              taken: Sequence[int], scores: Sequence[np.ndarray] = ()) -> int:
    """Each of ``requests`` gets the first ``taken[i]`` outputs of row ``rows[i]`` of ``outputs`` (steps,
    rows, ...), as :meth:`~.scheduler.Scheduler.update` gave them, then its :class:`~..request.End` with its
    reason if they ended it, all in one :func:`~jitserve.serving.request.put_all`; a request that asked for
    ``logprobs`` gets each as a :class:`TokenLogprobs`, from ``scores`` (a scored program's
    log-probabilities, (steps, rows, 1 + top), and top tokens). Returns the outputs handed over."""
    deliveries: list[tuple[Stream, Any]] = []
    handed = 0
    for request, row, took in zip(requests, rows, taken):
        if not took:
            continue
        handed += took
        top = request.sampling.logprobs
        stream = request.stream
        if top is None:
            deliveries.extend((stream, output) for output in outputs[:took, row])
        else:
            for step in range(took):
                logprobs, tokens = scores[0][step, row], scores[1][step, row]
                deliveries.append((stream, TokenLogprobs(int(outputs[step, row]), float(logprobs[0]), tuple(
                    zip(tokens[:top].tolist(), logprobs[1:1 + top].tolist())))))
        if request.finish_reason is not None:  # set by this update: an earlier end takes no outputs
            deliveries.append((stream, End(request.finish_reason)))
    put_all(deliveries)
    return handed


class Piece(NamedTuple):
    """What a door gets of a generation, typed (:meth:`Delivery.pieces_async`): ``item``, a piece of text (or
    a ``postprocess``'s item; None in the last piece), the :class:`TokenLogprobs` of the outputs it came of
    where the request asked (else None), the request's ``outputs`` so far, and in the last piece only, why
    it ended (``finish_reason``: ``"stop"`` or ``"length"``)."""

    item: Any
    logprobs: list[TokenLogprobs] | None
    outputs: int
    finish_reason: str | None = None


class StopText:
    """A request's stop sequences (OpenAI's and vLLM's ``stop``), applied by the caller to the text pieces a
    ``postprocess`` gives: the text goes out up to the first stop sequence, which ends the request and is
    left out; text that may be the start of one is held back until it is not. At most ``MAX_STOPS``
    sequences of at most ``MAX_STOP_LENGTH`` characters each: matching costs their lengths' squares per
    piece, on the caller's event loop over the network."""

    MAX_STOPS = 16
    MAX_STOP_LENGTH = 256

    def __init__(self, stop: Any) -> None:
        stops = [stop] if isinstance(stop, str | bytes) else list(stop) if isinstance(stop, list | tuple) else []
        if not stops or not all(isinstance(one, str | bytes) and one for one in stops):
            raise OptionError(f"stop must be a non-empty string or a list of them, got {stop!r:.80}")
        if len(stops) > self.MAX_STOPS or max(map(len, stops)) > self.MAX_STOP_LENGTH:
            raise OptionError(f"stop takes at most {self.MAX_STOPS} sequences of at most {self.MAX_STOP_LENGTH} "
                              f"characters each; got {len(stops)}, the longest {max(map(len, stops)):,} long")
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


def stop_text(generation: Generation, stop: Any) -> StopText | None:
    """A request's ``stop`` for ``generation`` (None: none), else an OptionError saying what was wrong."""
    if stop is None:
        return None
    if generation.postprocess is None and generation.detokenizer is None:
        raise OptionError("stop needs a generation whose postprocess gives text; this one gives its outputs "
                          "as they are")
    return StopText(stop)


class Delivery:
    """What one caller of a generation gets, in the caller: each output through ``postprocess``, and with
    ``stop`` (text pieces only) the text cut at the first stop sequence (:class:`StopText`). ``scored``: the
    request asked for ``logprobs``, its outputs are :class:`TokenLogprobs`, and the caller gets each item
    paired with those of the outputs that gave it: ``(item, [TokenLogprobs, ...])`` (a piece of text may come
    of several outputs, or of none, while a character or a possible stop sequence is held back). Once the
    outputs end, ``finish_reason`` says why: ``"stop"`` (an end token, a stop id or a stop sequence) or
    ``"length"``, as the engine's :class:`~..request.End` gave it."""

    def __init__(self, generation: Generation, stop: Any = None, prompt: Any = None, scored: bool = False) -> None:
        self.generation = generation
        self.stop = stop_text(generation, stop)
        # a detokenizer's decoder for this request, which reads the prompt's token ids for context
        self.text = None if generation.detokenizer is None else generation.detokenizer(np.asarray(prompt))
        self.scores: list[TokenLogprobs] | None = [] if scored else None  # those of outputs not paired yet
        self.empty: Any = ""  # a piece of no text, of the pieces' type
        self.reason: str | None = None  # the engine's, from the outputs' End
        self.read = 0  # outputs read so far

    def of(self, output: Any) -> list[Any]:
        """What the caller gets for ``output``: its piece; with stop sequences, the text that can go out;
        ``scored``, paired with log-probabilities."""
        if self.scores is None:
            return self._pieces(output)
        self.scores.append(output)
        return self._paired(self._pieces(output.token))

    def _pieces(self, output: Any) -> list[Any]:
        if self.text is None:
            return self._cut(self.generation.output_of(output))
        text = self.text.feed(output)
        return self._cut(text) if text else []

    def _cut(self, piece: Any) -> list[Any]:
        if self.stop is None:
            return [piece]
        text = self.stop.feed(piece)
        self.empty = text[:0]
        return [text] if text else []

    def _paired(self, items: list[Any]) -> list[Any]:
        """``items`` of a scored request, the first with the log-probabilities not paired yet."""
        if not items or self.scores is None:
            return items
        paired = [(items[0], self.scores), *((item, []) for item in items[1:])]
        self.scores = []
        return paired

    @property
    def done(self) -> bool:
        """A stop sequence was reached: the caller stops reading, which frees the slot at the next step."""
        return self.stop is not None and self.stop.ended

    @property
    def finish_reason(self) -> str | None:
        """Why the outputs ended: at a stop sequence ``"stop"``, else the engine's reason (None before)."""
        return "stop" if self.done else self.reason

    def rest(self) -> list[Any]:
        """What was held back when the outputs ended without a stop sequence: a decoder's unfinished text,
        then text that might have begun a stop sequence."""
        tail = "" if self.text is None else self.text.finish()
        items = self._cut(tail) if tail else []
        held = None if self.stop is None or self.stop.ended else self.stop.held
        return self._paired([*items, held] if held else items)

    def leftover(self) -> list[Any]:
        """At the end of a scored request, the log-probabilities of outputs whose text never came out (cut at
        a stop sequence, or no text at all), with an empty piece."""
        return self._paired([self.empty]) if self.scores else []

    def _counted(self, output: Any) -> bool:
        """Note one item of the engine's outputs: an output is counted (True), its :class:`~..request.End`
        gives the reason (False: nothing to hand out)."""
        if type(output) is End:
            self.reason = output.reason
            return False
        self.read += 1
        return True

    def each(self, outputs: Generator[Any, None, None]) -> Generator[Any, None, None]:
        """What the caller gets from a request's ``outputs`` (a server's ``outputs``, ending with its
        :class:`~..request.End`), one item at a time; closed early, or at a stop sequence, it closes them:
        the request is cancelled now."""
        try:
            for output in outputs:
                if not self._counted(output):
                    continue
                yield from self.of(output)
                if self.done:
                    break
            else:
                yield from self.rest()
            yield from self.leftover()
        finally:
            outputs.close()

    async def each_async(self, outputs: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
        """:meth:`each` for a server's ``outputs_async``."""
        try:
            async for output in outputs:
                if not self._counted(output):
                    continue
                for item in self.of(output):
                    yield item
                if self.done:
                    break
            else:
                for item in self.rest():
                    yield item
            for item in self.leftover():
                yield item
        finally:
            await outputs.aclose()

    async def pieces_async(self, outputs: AsyncGenerator[Any, None]) -> AsyncGenerator[Piece, None]:
        """:meth:`each_async` typed, as a door reads it: each item a :class:`Piece`, then a last one with why
        the outputs ended."""
        items = self.each_async(outputs)
        scored = self.scores is not None
        try:
            async for item in items:
                yield Piece(item[0], item[1], self.read) if scored else Piece(item, None, self.read)
            yield Piece(None, [] if scored else None, self.read, self.finish_reason)
        finally:
            await items.aclose()


class Choices:
    """The choices of one caller's request (OpenAI's and vLLM's ``n``, over one prompt or several), each read
    by a task of its own from the moment it is added (a choice nobody reads would run to its last token):
    :meth:`each` merges their typed pieces as they come, each with its choice's index (the order they were
    added in)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[int, Piece | Exception | None]] = asyncio.Queue()  # None: a choice's end
        self.tasks: list[asyncio.Future[None]] = []

    def add(self, pieces: AsyncGenerator[Piece, None]) -> None:
        self.tasks.append(asyncio.ensure_future(self._read(len(self.tasks), pieces)))

    async def _read(self, index: int, pieces: AsyncGenerator[Piece, None]) -> None:
        try:
            async for piece in pieces:
                self.queue.put_nowait((index, piece))
            self.queue.put_nowait((index, None))
        except Exception as error:  # noqa: BLE001 - handed to the reader of the pieces, which raises it
            self.queue.put_nowait((index, error))

    async def each(self) -> AsyncGenerator[tuple[int, Piece], None]:
        """Every choice's pieces as they come, ``(index, piece)``, until each choice's pieces ended; the first
        error raises, and ends the other choices."""
        try:
            left = len(self.tasks)
            while left:
                index, piece = await self.queue.get()
                if piece is None:
                    left -= 1
                    continue
                if isinstance(piece, Exception):
                    raise piece
                yield index, piece
        finally:
            await self.close()

    async def close(self) -> None:
        """End every choice still running (its slot freed at the next step)."""
        await asyncio.sleep(0)  # every task past its first step: one cancelled before it never closes its request
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def stacked(outputs: Sequence[Any]) -> np.ndarray:
    """A request's outputs on a first axis: arrays stacked; text (bytes or str, from a ``postprocess``) as an
    object array, every piece as it was (a fixed-size bytes array would drop trailing zero bytes); no
    outputs (text cut at a stop sequence before any), an empty object array."""
    if not outputs or isinstance(outputs[0], bytes | str):
        array = np.empty(len(outputs), object)
        array[:] = outputs
        return array
    return np.stack(outputs)
