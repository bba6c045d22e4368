"""Servers by name: ``serve``, ``batched_run`` and ``batched_run_async``, local servers first, then clusters.

A name is looked up in this process first and then in every cluster this
process is connected to (Nx.Serving's order); ``("local", name)`` or
``("ray", name)`` forces one. Cluster back ends live above this layer and
plug themselves in with :func:`register_cluster`; to this module a cluster is
only something that starts servings and finds a :class:`Front` by name (the
cluster's caller-side coalescer, or its front of a generation). The calls
are each a typed request (:class:`Rows`, :class:`Prompt`) given to the
front's entry points, which refuse one of the other kind.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol, TypeGuard

from ..errors import OptionError, ServerExistsError, UnknownServerError
from .corridor import Rows
from .front import Front
from .generation import Generation, GenerationServer, Prompt, Sampling
from .server import Server
from .serving import Serving

LOCAL = "local"

_servers: dict[str, Front] = {}
_lock = threading.Lock()


class Cluster(Protocol):
    """What a cluster back end gives the registry."""

    def connected(self) -> bool:
        """True when this process is connected to such a cluster (no lookups otherwise)."""

    def serve(self, serving: Serving | Generation, name: str, **options: Any) -> Any:
        """Start ``serving`` as ``name`` in the cluster; returns the back end's handle."""

    def lookup(self, name: str) -> Front | None:
        """This process's front of the cluster serving ``name``, or None if the cluster has none."""


_clusters: dict[str, Cluster] = {}


def register_cluster(kind: str, cluster: Cluster) -> None:
    """Make ``serve(..., cluster=kind)`` and lookups of ``(kind, name)`` use ``cluster``."""
    _clusters[kind] = cluster


def serve(serving: Serving | Generation, name: str | None = None, cluster: str | None = None,
          **cluster_options: Any) -> Any:
    """Start a server for ``serving`` registered as ``name`` (default: the function's name).

    With ``input_template`` set, every batch size is compiled on every
    partition before the server accepts requests. Use it as a context manager,
    or call ``stop()``. ``cluster="ray"`` starts it on a Ray cluster instead
    (``replicas=``, ``weight=``, ``num_cpus=``, ``num_gpus=``; see
    :mod:`jitserve.cluster.ray`) and returns the cluster's handle.
    """
    name = name or getattr(serving.functions[-1], "__name__", None) or "serving"
    if cluster is not None:
        return _cluster(cluster).serve(serving, name, **cluster_options)
    if cluster_options:
        raise OptionError(f"{', '.join(sorted(cluster_options))}: only for a cluster serving (cluster='ray')")
    server = unstarted_server(serving, name)
    with _lock:
        if name in _servers:
            raise ServerExistsError(f"a server named {name!r} is already running; stop it or pick another name")
        _servers[name] = server
    server.on_stop(lambda stopped: unregister(name, stopped))
    try:
        return server.start()
    except BaseException:
        unregister(name, server)
        raise


def is_servable(value: Any) -> TypeGuard[Serving | Generation]:
    """Whether ``value`` is something to serve: a :class:`Serving` or a :class:`Generation`."""
    return isinstance(value, (Serving, Generation))


def unstarted_server(serving: Serving | Generation, name: str) -> Front:
    """A server of ``serving`` named ``name``, not started and not registered: ``start()`` warms it up. A model
    repository keeps two of one name while it reloads, which the registry does not allow."""
    return GenerationServer(serving, name) if isinstance(serving, Generation) else Server(serving, name)


def _cluster(kind: str) -> Cluster:
    cluster = _clusters.get(kind)
    if cluster is None:
        raise OptionError(f"unknown cluster {kind!r}; expected one of {', '.join(sorted(_clusters)) or 'none'}")
    return cluster


def unregister(name: str, server: Front) -> None:
    with _lock:
        if _servers.get(name) is server:
            del _servers[name]


def lookup(name: str | tuple[str, str]) -> Front:
    """The server for ``name``: here first, then in every connected cluster; ``(kind, name)`` forces one."""
    scope, bare = name if isinstance(name, tuple) else (None, name)
    if scope not in (None, LOCAL):
        found = _cluster(scope).lookup(bare)
        if found is None:
            raise UnknownServerError(f"no serving named {bare!r} is running in the {scope} cluster")
        return found
    server = _servers.get(bare)
    if server is not None:
        return server
    searched = []
    for kind, cluster in _clusters.items() if scope is None else ():
        if cluster.connected():
            searched.append(kind)
            found = cluster.lookup(bare)
            if found is not None:
                return found
    running = ", ".join(sorted(_servers)) or "none"
    where = "" if not searched else f", nor in the {' or '.join(searched)} cluster"
    raise UnknownServerError(f"no server named {bare!r} is running here (running: {running}){where}")


def servers() -> dict[str, Front]:
    """The running servers of this process by name."""
    return dict(_servers)


def batched_run(name: str | tuple[str, str], value: Any, timeout: float | None = None,
                priority: int | None = None) -> Any:
    """Run ``value`` (a Batch, or what the serving's ``preprocess`` takes) on server ``name``, batched
    with concurrent callers, at ``priority`` (1 the most urgent level; None: the default); returns exactly
    this caller's rows. ``preprocess`` and ``postprocess`` run here, in the caller."""
    return lookup(name).call(Rows(value, timeout, priority))


async def batched_run_async(name: str | tuple[str, str], value: Any, timeout: float | None = None,
                            priority: int | None = None) -> Any:
    """``batched_run`` for asyncio callers: awaits the rows without blocking the event loop."""
    return await lookup(name).call_async(Rows(value, timeout, priority))


def batched_stream(name: str | tuple[str, str], value: Any, timeout: float | None = None,
                   priority: int | None = None) -> Iterator[Any]:
    """``batched_run`` whose results come as they are ready: this caller's rows in order, one part per
    batch that ran some of them (the first rows while later ones still run), or one item per step of a
    serving that yields steps (``Serving(..., streaming=True)``). ``postprocess`` runs on each item.
    Closing the iterator early takes the rows that have not started off the queue."""
    yield from lookup(name).stream(Rows(value, timeout, priority))


async def batched_stream_async(name: str | tuple[str, str], value: Any, timeout: float | None = None,
                               priority: int | None = None) -> AsyncIterator[Any]:
    """``batched_stream`` for asyncio callers (``async for``)."""
    async for outputs in lookup(name).stream_async(Rows(value, timeout, priority)):
        yield outputs


def _prompt(front: Front, prompt: Any, max_steps: int, stop: Any, timeout: float | None,
            sampling: dict[str, Any]) -> Prompt:
    """What ``js.generate`` asks ``front``: its ``sampling`` over the generation's defaults
    (:meth:`Generation.sampling`), where the front serves one."""
    generation = getattr(front, "generation", None)
    chosen = generation.sampling(**sampling) if isinstance(generation, Generation) else Sampling(**sampling)
    return Prompt(prompt, max_steps, chosen, stop, timeout)


def generate(name: str | tuple[str, str], prompt: Any, max_steps: int, timeout: float | None = None,
             stop: Any = None, **sampling: Any) -> Any:
    """Generate from ``prompt`` (1-D integer token ids, or what the generation's ``preprocess`` takes) on
    generation server ``name``: every output, stacked on a first axis; at most ``max_steps`` of them,
    ending right after one equal to the serving's ``eos`` (unless ``ignore_eos=True``). ``timeout``: give
    up if no slot frees within that many seconds. ``stop``: a string or a list of them that ends a text
    generation's request where its text reaches one (left out; see :class:`StopText`). ``sampling``: how a
    ``logits=True`` generation picks the tokens (:class:`Sampling`: ``temperature``, ``top_k``, ``top_p``,
    ``min_p``, ``seed``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``, ``logit_bias``, the penalties; greedy
    without). A generation with a ``detokenizer`` (a checkpoint's, from :func:`jitserve.from_pretrained`)
    answers one string. With ``logprobs=N``: ``(answer, logprobs)``, the second a list of
    :class:`TokenLogprobs`, one per output."""
    return (front := lookup(name)).call(_prompt(front, prompt, max_steps, stop, timeout, sampling))


def generate_stream(name: str | tuple[str, str], prompt: Any, max_steps: int, timeout: float | None = None,
                    stop: Any = None, **sampling: Any) -> Iterator[Any]:
    """:func:`generate` one output at a time, each as its step finishes; closing the iterator cancels the
    request and frees its slot at the next step. With ``logprobs=N``, each item comes paired with the
    :class:`TokenLogprobs` of the outputs that gave it: ``(item, [TokenLogprobs, ...])`` (a piece of text
    may come of several outputs, or of none)."""
    yield from (front := lookup(name)).stream(_prompt(front, prompt, max_steps, stop, timeout, sampling))


async def generate_async(name: str | tuple[str, str], prompt: Any, max_steps: int, timeout: float | None = None,
                         stop: Any = None, **sampling: Any) -> Any:
    """:func:`generate` for asyncio callers."""
    return await (front := lookup(name)).call_async(_prompt(front, prompt, max_steps, stop, timeout, sampling))


async def generate_stream_async(name: str | tuple[str, str], prompt: Any, max_steps: int,
                                timeout: float | None = None, stop: Any = None, **sampling: Any
                                ) -> AsyncIterator[Any]:
    """:func:`generate_stream` for asyncio callers (``async for``)."""
    items = (front := lookup(name)).stream_async(_prompt(front, prompt, max_steps, stop, timeout, sampling))
    try:
        async for item in items:
            yield item
    finally:
        await items.aclose()  # closed early: the request is cancelled now, not when the stream is collected
