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

Failure: a batch whose replica died (``ActorDiedError``,
``ActorUnavailableError``), is stopping, or did not answer within
``call_timeout`` is sent to another replica, at most ``MAX_TRIES`` times;
``QueueFullError`` tries the other choice. For pure functions this is
at-least-once execution on a hard crash (the dead replica may have run the
batch) and exactly-once on a graceful stop (a stopping replica answers only
requests none of whose rows started, and finishes the others).

A generation's request is one Ray streaming call to the replica with the
fewest prompts per slot of two drawn (:class:`RemoteGeneration`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import threading
import time
from collections.abc import AsyncGenerator, Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
from ray.exceptions import RayTaskError

from ...batch import Batch
from ...errors import QueueFullError, RequestTooLargeError, ServerStoppedError, UnknownServerError
from ...serving.generation import GREEDY, Generation, GenerationFront, Sampling
from ...serving.server import Server
from ...serving.serving import Serving
from .operations import actor_names, replica_stats, running_servings, total
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
    """This process's view of one serving's replicas: membership, load, and sending a batch with retries."""

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
        """Run ``size`` rows (a pytree of arrays, under ``batch_key``) on a replica; re-sent on a lost or
        stopping replica."""
        tried: set[str] = set()
        full: set[str] = set()
        too_large: dict[str, RequestTooLargeError] = {}  # replicas whose queue can never hold the batch
        lost: list[str] = []
        while len(lost) < MAX_TRIES:
            member = self.choose(tried)
            if member is None:
                break
            tried.add(member.name)
            self.add_outstanding(member, size)
            try:
                outputs, member.depth = ray.get(member.actor.run.remote(rows, batch_key), timeout=self.call_timeout)
                return outputs
            except BaseException as error:  # noqa: BLE001 - sorted below: retry, next choice, or the caller's
                cause = _cause(error)
                if isinstance(cause, (QueueFullError, RequestTooLargeError)):  # another replica may take it
                    full.add(member.name)
                    if isinstance(cause, RequestTooLargeError):
                        too_large[member.name] = cause
                    continue
                if not isinstance(error, LOST) and not isinstance(cause, ServerStoppedError):
                    raise cause from None
                lost.append(f"{member.name}: {type(cause).__name__}")
                log.warning("replica %s lost a batch of %d rows (%s); sending it elsewhere",
                            member.name, size, type(cause).__name__)
                self.forget(member)
            finally:
                self.add_outstanding(member, -size)
        if full and not lost:
            if set(too_large) == full:  # no replica could ever take it: not retryable
                raise next(iter(too_large.values()))
            raise QueueFullError(f"every replica of {self.name!r} has a full queue ({', '.join(sorted(full))})")
        if lost and self._members:
            raise ServerStoppedError(f"a batch of {size} rows for {self.name!r} was not answered after "
                                     f"{len(lost)} tries ({'; '.join(lost)})")
        raise UnknownServerError(f"no replica of {self.name!r} is running in the ray cluster")

    def stream(self, rows: Any, size: int, batch_key: Any = None) -> Iterator[Any]:
        """:meth:`send` for a streaming serving: one replica's steps of the batch, as they come. A lost or
        stopping replica's batch is re-sent elsewhere only before its first step arrived (later, the steps
        already delivered would come twice); closing the iterator cancels the replica's run."""
        tried: set[str] = set()
        while True:
            member = self.choose(tried)
            if member is None:
                raise UnknownServerError(f"no replica of {self.name!r} is running in the ray cluster") if not \
                    tried else ServerStoppedError(f"a streaming batch for {self.name!r} was not answered by "
                                                  f"{', '.join(sorted(tried))}")
            tried.add(member.name)
            self.add_outstanding(member, size)
            steps = member.actor.run_stream.options(num_returns="streaming").remote(rows, batch_key)
            produced, finished = 0, False
            try:
                for ref in steps:
                    yield ray.get(ref, timeout=self.call_timeout)
                    produced += 1
                finished = True
                return
            except Exception as error:  # noqa: BLE001 - a lost replica before any step: next one; else the caller's
                cause = _cause(error)
                retry = isinstance(error, LOST) or isinstance(cause, (ServerStoppedError, QueueFullError))
                if produced or not retry or len(tried) >= MAX_TRIES:
                    raise cause from None
                log.warning("replica %s lost a streaming batch of %d rows (%s) before its first step; sending it "
                            "elsewhere", member.name, size, type(cause).__name__)
                self.forget(member)
            finally:
                self.add_outstanding(member, -size)
                if not finished:
                    ray.cancel(steps)

    def members(self) -> dict[str, Any]:
        with self._lock:
            return {name: member.actor for name, member in self._members.items()}


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

    def execute(self, batch: Batch, params: Any) -> Any:
        """``params`` is ``()``: the replicas hold the weights. A streaming serving's steps come as a
        generator, as a local streaming serving's do."""
        run = self.router.stream if self.streaming else self.router.send
        return run(batch.materialize(), batch.size, batch.user_key)


class Coalescer(Server):
    """The local front of a cluster serving: callers in this process share one Ray call per batch."""

    def __init__(self, router: Router, serving: Serving, in_flight: int) -> None:
        # unpadded (the replica pads) and unbounded (the replicas' queues are the bound)
        policy = dataclasses.replace(serving.policy, max_queue=None, pad=False)
        super().__init__(serving, router.name, [_Dispatch(router, serving.streaming) for _ in range(in_flight)],
                         policy)
        self.router = router

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        """Each replica's server stats, as the replicas report them now."""
        return replica_stats(self.router.members())


class RemoteGeneration(GenerationFront):
    """The local front of a generation on Ray. Each request is one streaming call to a replica, chosen by
    power of two choices on prompts held per slot (this process's requests in flight there, plus what the
    replica reported with its last output); closing the outputs cancels the call, which frees the slot. A
    replica lost before a request's first output is replaced by another (at most ``MAX_TRIES``); one lost
    after it ends the request with ``ServerStoppedError`` (its outputs cannot be taken back)."""

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

    def _call(self, request: tuple[np.ndarray, int, Sampling], timeout: float | None, tried: set[str]
              ) -> tuple[_Member, Any]:
        member = self.router.choose(tried)
        if member is None:
            raise UnknownServerError(f"no replica of {self.name!r} is running in the ray cluster")
        tried.add(member.name)
        self.router.add_outstanding(member, 1)
        return member, member.actor.generate.options(num_returns="streaming").remote(*request, timeout)

    def _lost(self, member: _Member, error: BaseException, produced: int, tried: set[str]) -> None:
        """Raise what ends the request, or return to try another replica."""
        cause = _cause(error)
        if not isinstance(error, LOST) and not isinstance(cause, ServerStoppedError):
            raise cause from None
        self.router.forget(member)
        if produced or len(tried) >= MAX_TRIES:
            raise ServerStoppedError(f"replica {member.name} of {self.name!r} was lost after {produced} outputs "
                                     f"({type(cause).__name__})") from None
        log.warning("replica %s lost a request before its first output (%s); sending it elsewhere", member.name,
                    type(cause).__name__)

    def outputs(self, request: Any, timeout: float | None) -> Generator[Any, None, None]:
        tried: set[str] = set()
        produced = 0
        while True:
            member, outputs = self._call(request, timeout, tried)
            try:
                for ref in outputs:
                    output, member.depth = ray.get(ref)
                    produced += 1
                    yield output
                return
            except Exception as error:  # noqa: BLE001 - sorted by _lost: another replica, or the caller's
                self._lost(member, error, produced, tried)
            finally:
                self.router.add_outstanding(member, -1)
                ray.cancel(outputs)

    async def outputs_async(self, request: Any, timeout: float | None) -> AsyncGenerator[Any, None]:
        tried: set[str] = set()
        produced = 0
        while True:
            member, outputs = self._call(request, timeout, tried)
            try:
                async for ref in outputs:
                    output, member.depth = await ref
                    produced += 1
                    yield output
                return
            except Exception as error:  # noqa: BLE001 - sorted by _lost: another replica, or the caller's
                self._lost(member, error, produced, tried)
            finally:
                self.router.add_outstanding(member, -1)
                ray.cancel(outputs)

    def stats(self) -> dict[str, Any]:
        """The replicas' stats, summed."""
        return total(replica_stats(self.router.members()).values())

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
