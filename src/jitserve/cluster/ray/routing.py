"""Reaching a serving on Ray from any process of the cluster: this process's view of its replicas (a
:class:`Router` each), the coalescer that turns concurrent callers into one Ray call per batch, the front of a
generation, the lookup of both by name, and the sync of a network front with what the cluster serves.

Concurrent callers of one process are coalesced into one Ray call per batch (a
local server whose partitions are dispatchers, at most ``batch_size`` rows and
``batch_timeout`` wait, several batches in flight), and the replica's server
merges those pieces with other processes'.

Routing is power of two choices: two candidates drawn with probability
proportional to ``partitions x weight`` (Nx's ``distribution_weight``), the
one with fewer rows outstanding per partition wins (rows this process has in
flight there plus the replica's queue depth, carried back in every reply).
Membership is read from Ray's named actors, again when a replica dies or
stops and at least every ``REFRESH_S`` seconds.

Failure: calls, streams and generations follow one retry policy
(:class:`Tries`). A request whose replica died (``ActorDiedError``,
``ActorUnavailableError``), is stopping, or did not answer within
``call_timeout`` is sent to another replica, at most ``MAX_TRIES`` times,
until its first output has reached the caller; ``QueueFullError`` tries the
other choice. For pure functions this is at-least-once execution on a hard
crash (the dead replica may have run the batch) and exactly-once on a
graceful stop (a stopping replica answers only requests none of whose rows
started, and finishes the others).

A generation's request is one Ray streaming call to the replica with the
fewest prompts per slot of two drawn (:class:`RemoteGeneration`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import threading
import time
from collections.abc import AsyncGenerator, Callable, Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
from ray.exceptions import RayTaskError

from ...batch import Batch
from ...errors import QueueFullError, RequestTooLargeError, ServerStoppedError, UnknownServerError
from ...serving.generation import GREEDY, Generation, GenerationFront, Sampling
from ...serving.server import Server
from ...serving.serving import Serving
from ...serving.stats import FrontStats, GenerationStats, Phases
from .operations import actor_names, replica_stats, running_servings
from .replicas import LOST, NAMESPACE

if TYPE_CHECKING:
    from ...protocol.service import InferenceService

log = logging.getLogger("jitserve.cluster")

MAX_TRIES = 3
REFRESH_S = 2.0
DEFAULT_CALL_TIMEOUT_S = 60.0


def _cause(error: BaseException) -> BaseException:
    """The exception a replica raised, out of Ray's wrapper."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


@contextlib.contextmanager
def _cancelled_at_exit(replies: Any) -> Iterator[Any]:
    """A Ray streaming call, cancelled when the block ends: a caller that stops reading frees what it held
    on the replica."""
    try:
        yield replies
    finally:
        ray.cancel(replies)


class _Member:
    """What a router knows of one replica."""

    __slots__ = ("name", "actor", "partitions", "capacity", "outstanding", "depth")

    def __init__(self, name: str, actor: Any, partitions: int, weight: float) -> None:
        self.name = name
        self.actor = actor
        self.partitions = partitions
        self.capacity = partitions * weight
        self.outstanding = 0
        self.depth = 0

    @property
    def load(self) -> float:
        return (self.outstanding + self.depth) / self.partitions


class Router:
    """This process's view of one serving's replicas: membership, load, and sending them calls and streaming
    calls, tried again as :class:`Tries` says."""

    def __init__(self, name: str, call_timeout: float) -> None:
        self.name = name
        self.call_timeout = call_timeout
        self._lock = threading.Lock()
        self._members: dict[str, _Member] = {}
        self._refreshed = 0.0
        self.serving: Serving | Generation | None = None

    def refresh(self) -> None:
        """Read the replicas from the cluster: new ones are asked for their capacity, gone ones dropped."""
        names = actor_names(self.name)
        with self._lock:
            known = dict(self._members)
        fresh = {actor_name: known[actor_name] for actor_name in names if actor_name in known}
        asked = {}
        for actor_name in names:
            if actor_name not in known:
                try:
                    actor = ray.get_actor(actor_name, namespace=NAMESPACE)
                except ValueError:
                    continue  # it went away between the listing and now
                asked[actor_name] = (actor, actor.info.remote())
        if asked:  # a replica that is (re)starting answers later: look again at the next refresh
            refs = [ref for _, ref in asked.values()]
            ray.wait(refs, num_returns=len(refs), timeout=self.call_timeout if not fresh else 1.0)
        for actor_name, (actor, ref) in asked.items():
            try:
                info = ray.get(ref, timeout=0)
            except (*LOST, RayTaskError):
                continue
            fresh[actor_name] = _Member(actor_name, actor, info["partitions"], info["weight"])
            if self.serving is None:
                self.serving = info["serving"]
        with self._lock:
            self._members = fresh
            self._refreshed = time.monotonic()

    def choose(self, exclude: set[str]) -> _Member | None:
        """A replica not in ``exclude``: of two drawn by capacity, the less loaded (None: none is left)."""
        if time.monotonic() - self._refreshed > REFRESH_S:
            self.refresh()
        with self._lock:
            members = [m for m in self._members.values() if m.name not in exclude]
        if not members:
            return None
        first, second = random.choices(members, weights=[m.capacity for m in members], k=2)
        return first if first.load <= second.load else second

    def add_outstanding(self, member: _Member, rows: int) -> None:
        with self._lock:  # several dispatcher threads send to one member: += is not atomic
            member.outstanding += rows

    def forget(self, member: _Member) -> None:
        with self._lock:
            if self._members.get(member.name) is member:
                del self._members[member.name]
        self._refreshed = 0.0  # look again before the next choice

    def send(self, rows: Any, size: int, batch_key: Any = None) -> Any:
        """Run ``size`` rows (a pytree of arrays, under ``batch_key``) on a replica, tried elsewhere as
        :class:`Tries` says."""
        tries = Tries(self, size)
        while True:
            with tries.attempt() as member:
                outputs, member.depth = ray.get(member.actor.run.remote(rows, batch_key), timeout=self.call_timeout)
                return outputs

    def stream(self, rows: Any, size: int, batch_key: Any = None) -> Generator[Any, None, None]:
        """:meth:`send` for a streaming serving: one replica's steps of the batch, as they come."""
        return self.streamed(size, lambda actor: actor.run_stream.options(num_returns="streaming").remote(
            rows, batch_key), self.call_timeout)

    def streamed(self, size: int, call: Callable[[Any], Any], timeout: float | None) -> Generator[Any, None, None]:
        """The outputs of one Ray streaming call, ``call(actor)``, whose every reply is an output and the
        replica's load, each within ``timeout``; tried elsewhere as :class:`Tries` says. Closing the
        generator cancels the call."""
        tries = Tries(self, size)
        while True:
            with tries.attempt() as member, _cancelled_at_exit(call(member.actor)) as replies:
                for ref in replies:
                    yield tries.output(member, ray.get(ref, timeout=timeout))
                return

    async def streamed_async(self, size: int, call: Callable[[Any], Any]) -> AsyncGenerator[Any, None]:
        """:meth:`streamed` for an asyncio caller, each reply waited for as long as it takes."""
        tries = Tries(self, size)
        while True:
            with tries.attempt() as member, _cancelled_at_exit(call(member.actor)) as replies:
                async for ref in replies:
                    yield tries.output(member, await ref)
                return

    def members(self) -> dict[str, Any]:
        with self._lock:
            return {name: member.actor for name, member in self._members.items()}


class Tries:
    """One request's tries on a router's replicas: the one retry policy of calls, streams and generations.

    A replica that is lost (it died, is unreachable, or did not answer in time) or stopping (it answers
    ``ServerStoppedError`` to what has not started there) is forgotten and another one tried, at most
    ``MAX_TRIES`` lost in all, but only until the request's first output has reached its caller: outputs
    delivered cannot be taken back, so a replica lost after them ends the request with
    ``ServerStoppedError``. A replica whose queue is full, or too small ever to hold the request, is passed
    over for another choice without counting as lost. Any other error is the caller's, as the replica
    raised it."""

    __slots__ = ("router", "size", "tried", "lost", "full", "produced")

    def __init__(self, router: Router, size: int) -> None:
        self.router = router
        self.size = size  # what the request adds to a replica's outstanding load: rows, or one prompt
        self.tried: set[str] = set()
        self.lost: list[str] = []
        self.full: dict[str, BaseException] = {}
        self.produced = 0  # outputs delivered to the caller

    def choose(self) -> _Member:
        """The replica to try next, loaded with the request (until the end of the :meth:`attempt`); else raises
        what ends the request."""
        member = self.router.choose(self.tried) if len(self.lost) < MAX_TRIES else None
        if member is None:
            raise self._exhausted()
        self.tried.add(member.name)
        self.router.add_outstanding(member, self.size)
        return member

    @contextlib.contextmanager
    def attempt(self) -> Iterator[_Member]:
        """One try on the replica :meth:`choose` gives: an error in the block goes to :meth:`failed` (the block
        ends for the next try, or raises what ends the request); the replica's load is released at its end."""
        member = self.choose()
        try:
            yield member
        except Exception as error:  # noqa: BLE001 - sorted by failed: another replica, or the caller's
            self.failed(member, error)
        finally:
            self.router.add_outstanding(member, -self.size)

    def output(self, member: _Member, reply: tuple[Any, int]) -> Any:
        """The output of one reply of ``member``, whose load it carries; counted as reaching the caller."""
        output, member.depth = reply
        self.produced += 1
        return output

    def failed(self, member: _Member, error: BaseException) -> None:
        """Return if the request may try another replica after ``error``, else raise what ends it."""
        cause = _cause(error)
        if isinstance(cause, (QueueFullError, RequestTooLargeError)):
            self.full[member.name] = cause
            return
        if not isinstance(error, LOST) and not isinstance(cause, ServerStoppedError):
            raise cause from None
        self.router.forget(member)
        if self.produced:
            raise ServerStoppedError(f"replica {member.name} of {self.router.name!r} was lost after "
                                     f"{self.produced} outputs ({type(cause).__name__})") from None
        self.lost.append(f"{member.name}: {type(cause).__name__}")
        log.warning("replica %s was lost (%s) before it answered; trying another one", member.name,
                    type(cause).__name__)

    def _exhausted(self) -> BaseException:
        name = self.router.name
        if self.full and not self.lost:
            too_large = [cause for cause in self.full.values() if isinstance(cause, RequestTooLargeError)]
            if len(too_large) == len(self.full):  # no replica could ever take it: not retryable
                return too_large[0]
            return QueueFullError(f"every replica of {name!r} has a full queue ({', '.join(sorted(self.full))})")
        if self.lost and self.router.members():
            return ServerStoppedError(f"no replica of {name!r} answered after {len(self.lost)} tries "
                                      f"({'; '.join(self.lost)})")
        return UnknownServerError(f"no replica of {name!r} is running in the ray cluster")


class _Dispatch:
    """A coalescer partition's executor: one coalesced batch, one Ray call."""

    def __init__(self, router: Router, streaming: bool) -> None:
        self.router = router
        self.streaming = streaming

    def compiled(self, rows: int, tree: Any, row_signature: Any, batch_key: Any = None) -> None:
        """Nothing to compile here: the replicas compiled at their warm-up."""

    def place(self, params: Any) -> tuple[()]:
        """Nothing to place here: the replicas hold the weights."""
        return ()

    def close(self) -> None:
        """Nothing to release: the router outlives the coalescer's partitions."""

    def execute(self, batch: Batch, params: Any) -> tuple[Any, Phases]:
        """``params`` is ``()``: the replicas hold the weights. A streaming serving's steps come as a
        generator, as a local streaming serving's do. Phases: the batch stacked (input), the Ray call, which
        runs, cuts and sends back the rows on a replica (infer)."""
        run = self.router.stream if self.streaming else self.router.send
        started = time.perf_counter()
        inputs = batch.materialize()
        sent = time.perf_counter()
        outputs = run(inputs, batch.size, batch.user_key)
        return outputs, Phases(sent - started, time.perf_counter() - sent)


class Coalescer(Server):
    """The local front of a cluster serving: callers in this process share one Ray call per batch."""

    def __init__(self, router: Router, serving: Serving, in_flight: int) -> None:
        # unpadded (the replica pads) and unbounded (the replicas' queues are the bound)
        policy = dataclasses.replace(serving.policy, max_queue=None, pad=False)
        super().__init__(serving, router.name, [_Dispatch(router, serving.streaming) for _ in range(in_flight)],
                         policy)
        self.router = router

    def replica_stats(self) -> dict[str, FrontStats]:
        """Each replica's server stats, as the replicas report them now."""
        return replica_stats(self.router.members())


class RemoteGeneration(GenerationFront):
    """The local front of a generation on Ray. Each request is one streaming call to a replica, chosen by
    power of two choices on prompts held per slot (this process's requests in flight there, plus what the
    replica reported with its last output); closing the outputs cancels the call, which frees the slot. A
    request is tried on other replicas as :class:`Tries` says: a replica lost before its first output is
    replaced by another, one lost after it ends the request with ``ServerStoppedError``."""

    def __init__(self, router: Router, generation: Generation) -> None:
        self.router = router
        self.name = router.name
        self.generation = generation
        self.output_template = generation.shapes()[2]
        self._stopping = False
        self._on_stop: list[Any] = []

    def submit(self, prompt: Any, max_steps: int, loop: asyncio.AbstractEventLoop | None = None,
               sampling: Sampling | None = None) -> tuple[np.ndarray, int, Sampling]:
        """Checked here (a bad request never travels); sent when its outputs are asked for."""
        if self._stopping:
            raise ServerStoppedError(f"the front of generation {self.name!r} is stopped")
        return self.generation.check_request(self.name, prompt, max_steps, sampling), max_steps, sampling or GREEDY

    @staticmethod
    def _generate(request: tuple[np.ndarray, int, Sampling], timeout: float | None) -> Callable[[Any], Any]:
        """The streaming call of ``request`` on a replica's actor: its outputs, each with the replica's load."""
        return lambda actor: actor.generate.options(num_returns="streaming").remote(*request, timeout)

    def outputs(self, request: Any, timeout: float | None) -> Generator[Any, None, None]:
        return self.router.streamed(1, self._generate(request, timeout), None)

    def outputs_async(self, request: Any, timeout: float | None) -> AsyncGenerator[Any, None]:
        return self.router.streamed_async(1, self._generate(request, timeout))

    def stats(self) -> GenerationStats:
        """The replicas' stats, summed."""
        return GenerationStats.total(replica_stats(self.router.members()).values())  # type: ignore[arg-type]

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests here; the replicas run on (``RayServing.stop`` stops them)."""
        if not self._stopping:
            self._stopping = True
            for callback in self._on_stop:
                callback(self)


_coalescers: dict[str, Coalescer | RemoteGeneration] = {}
_coalescers_lock = threading.Lock()
_session: list[str] = []


def lookup(name: str, call_timeout: float = DEFAULT_CALL_TIMEOUT_S, in_flight: int = 4
           ) -> Coalescer | RemoteGeneration | None:
    """This process's coalescer for the cluster serving ``name``, or its front of a generation (None if it
    has no replicas)."""
    if not ray.is_initialized():
        raise UnknownServerError(f"not connected to a Ray cluster: call ray.init(address=...) before looking up "
                                 f"{name!r} there")
    session = ray.get_runtime_context().get_job_id()
    with _coalescers_lock:
        if _session != [session]:  # a new connection: the old coalescers talk to a cluster that is gone
            for stale in _coalescers.values():
                stale.stop(drain=False)
            _coalescers.clear()
            _session[:] = [session]
        coalescer = _coalescers.get(name)
        if coalescer is not None:
            return coalescer
        router = Router(name, call_timeout)
        router.refresh()
        if router.serving is None:
            return None
        front: Coalescer | RemoteGeneration = RemoteGeneration(router, router.serving) \
            if isinstance(router.serving, Generation) else Coalescer(router, router.serving, in_flight).start()
        _coalescers[name] = front
        return front


def forget(name: str) -> None:
    """Stop and drop this process's front of ``name`` (its replicas are gone); a later lookup makes a new one."""
    with _coalescers_lock:
        front = _coalescers.pop(name, None)
    if front is not None:
        front.stop(drain=False)


class FrontSync:
    """Keeps a network front's models in step with the cluster (``jitserve front``): every ``period``
    seconds, a serving deployed since (one of ``names``, when given) is served, and one whose replicas are
    all gone is dropped, so that its requests get 404 rather than wait."""

    def __init__(self, service: InferenceService, names: Sequence[str] | None = None,
                 period: float = REFRESH_S) -> None:
        self.service = service
        self.names = None if names is None else set(names)
        self.period = period
        self._stopped = threading.Event()
        self.sync()
        self._thread = threading.Thread(target=self._follow, name="jitserve-front-sync", daemon=True)
        self._thread.start()

    def sync(self) -> None:
        running = set(running_servings())
        wanted = running if self.names is None else running & self.names
        for name in sorted(wanted - set(self.service.models)):
            front = lookup(name)
            if front is not None:
                self.service.put(name, front)
                log.info("serving '%s' from the cluster", name)
        for name in sorted(set(self.service.models) - wanted):
            self.service.remove(name)
            forget(name)
            log.info("'%s' has no replicas left in the cluster: no longer served", name)

    def _follow(self) -> None:
        while not self._stopped.wait(self.period):
            try:
                self.sync()
            except Exception:
                log.exception("could not read the cluster's servings; trying again in %.0f s", self.period)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
