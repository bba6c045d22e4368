"""The contract of a served thing (:class:`Front`): what the registry, the protocol layer, metrics, tracing,
the model repository and the cluster back ends use of a server, whatever its engine.

A :class:`~jitserve.serving.server.Server` (batches of a ``Serving``) and a
:class:`~jitserve.serving.generation.GenerationFront` (decode loops of a ``Generation``, here or on a
cluster) are both fronts: a name; ``stop`` and ``stopping``; weights (``update_params``,
``reload_params``, ``params_source``, and whether a reload may keep the server and swap them); typed
statistics (:class:`~jitserve.serving.stats.FrontStats`, each engine adding its own); reports to a
:class:`Listener`; and the entry points of a caller that asks for a result or its pieces: ``call`` and
``stream`` (``call_async`` and ``stream_async`` on an event loop), given the engine's typed request, which
``asks`` names: a serving's :class:`~jitserve.serving.corridor.Rows`, a generation's
:class:`~jitserve.serving.generation.Prompt`. A request of the other kind is refused by name
(:func:`wrong_request`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Generator
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, Self, TypeVar

from ..errors import OptionError
from ..params import load_params

if TYPE_CHECKING:
    from .partition import BatchReport
    from .stats import FrontStats


class Listener(Protocol):
    """What hears a front's reports: each executed batch of a serving (``batch``), each timed event of a
    generation (``step``: its kind, ``first_output`` or ``step``, and its seconds)."""

    def batch(self, report: BatchReport) -> None: ...

    def step(self, kind: str, seconds: float) -> None: ...


Ask = TypeVar("Ask")  # the typed request of a front's engine


def wrong_request(name: str, asks: Any, ask: Any) -> OptionError:
    """The error of server ``name``, which takes ``asks`` requests, given ``ask``: the kind of servable it
    serves and the function to call, or what it takes."""
    kind = getattr(type(ask), "servable", None)
    if kind is None:
        return OptionError(f"server {name!r} takes a {asks.__name__} request ({asks.servable}'s), got "
                           f"{type(ask).__name__}")
    return OptionError(f"server {name!r} serves a {asks.servable}, not a {kind}: call {asks.entry}")


class Front(Generic[Ask]):
    """A named, running server of either engine (see the module's docstring)."""

    asks: ClassVar[type]  # the request its entry points take, which names the kind of servable it serves
    name: str
    _stopping: bool
    _on_stop: list[Callable[[Any], None]]

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        raise NotImplementedError

    def stats(self) -> FrontStats:
        raise NotImplementedError

    @property
    def servable(self) -> Any:
        """What it serves: a ``Serving`` or a ``Generation``."""
        raise NotImplementedError

    # the entry points: what a caller asks, its result or its pieces --------------------------------

    def call(self, ask: Ask) -> Any:
        """The whole result of ``ask``, once it is done."""
        raise NotImplementedError

    async def call_async(self, ask: Ask) -> Any:
        """:meth:`call` for a caller on a running event loop."""
        raise NotImplementedError

    def stream(self, ask: Ask) -> Generator[Any, None, None]:
        """The result of ``ask`` in pieces as they are ready. The request is checked and queued now (its
        errors raise here); closing the iterator early takes back what has not run."""
        raise NotImplementedError

    def stream_async(self, ask: Ask) -> AsyncGenerator[Any, None]:
        """:meth:`stream` for a caller on a running event loop: an async iterator."""
        raise NotImplementedError

    async def open_stream(self, ask: Ask) -> AsyncGenerator[Any, None]:
        """:meth:`stream_async`, where what the request's own size makes long (a tokenizer over a client's
        text) runs off the event loop first: the network fronts' entry. The request is queued once it
        returns (its errors raise here)."""
        return self.stream_async(ask)

    def listen(self, listener: Listener) -> None:
        """Tell ``listener`` this front's reports from now on (a front whose work runs elsewhere has none)."""

    def update_params(self, params: Any) -> None:
        raise NotImplementedError

    def takes_weights_of(self, servable: Any) -> bool:
        """Whether a reload to ``servable`` (of the same model file) may keep this server and swap its
        weights: a server that swaps weights, given weights shaped as its own."""
        return False

    @property
    def params_source(self) -> str | None:
        """The file the weights were given as (``params=PATH``); None when they were given as arrays."""
        raise NotImplementedError

    def reload_params(self) -> None:
        """:meth:`update_params` with the weights read again from the file they were given as
        (``params=PATH``): replace that file (write a new one and rename it over the old, as
        ``save_params`` does: the served arrays may map the old one) and reload, compiling nothing."""
        source = self.params_source
        if source is None:
            raise OptionError(f"server {self.name!r} was given its weights as arrays, not as a file "
                              f"(params=PATH), so there is no file to reload them from")
        self.update_params(load_params(source))

    def on_stop(self, callback: Callable[[Any], None]) -> None:
        """Call ``callback(server)`` once the server has stopped (the registry forgets its name)."""
        self._on_stop.append(callback)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def stopping(self) -> bool:
        """True once ``stop()`` was called: no new requests are taken."""
        return self._stopping
