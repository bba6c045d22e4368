"""The contract of a served thing (:class:`Front`): what the registry, the protocol layer, metrics, tracing,
the model repository and the cluster back ends use of a server, whatever its engine.

A :class:`~jitserve.serving.server.Server` (batches of a ``Serving``) and a
:class:`~jitserve.serving.generation.GenerationFront` (decode loops of a ``Generation``, here or on a
cluster) are both fronts: a name; ``stop`` and ``stopping``; weights (``update_params``,
``reload_params``, ``params_source``, and whether a reload may keep the server and swap them); typed
statistics (:class:`~jitserve.serving.stats.FrontStats`, each engine adding its own); reports to a
:class:`Listener`. ``generates`` says which entry points it has: ``call``/``open_stream`` of rows, or
``submit``/``outputs`` of a prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self

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


class Front:
    """A named, running server of either engine (see the module's docstring)."""

    generates: ClassVar[bool] = False  # True: a generation's prompts; False: a serving's rows
    name: str
    _stopping: bool
    _on_stop: list[Callable[[Any], None]]

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        raise NotImplementedError

    def stats(self) -> FrontStats:
        raise NotImplementedError

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
