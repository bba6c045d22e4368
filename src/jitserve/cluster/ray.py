"""Scale-out on Ray: replicas of a Serving as named, detached Ray core actors, and a coalescer in each caller.

``serve(serving, name, replicas=N)`` starts N actors ``name/0 .. name/N-1``
in the ``jitserve`` namespace, each running the in-process server (warm-up
done before it counts as ready). Any process connected to the cluster reaches
them by name through ``batched_run``: its concurrent callers are coalesced
into one Ray call per batch (a local server whose partitions are dispatchers,
at most ``batch_size`` rows and ``batch_timeout`` wait, several batches in
flight), and the replica's server merges those pieces with other processes'.

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

A :class:`~jitserve.Generation` runs the same way, each replica owning its
slots (:class:`GenerationReplica`); a caller's request is one Ray streaming
call to the replica with the fewest prompts per slot of two drawn
(:class:`RemoteGeneration`).

Why Ray core actors and not Ray Serve: one Ray Serve handle call costs 2-5x
an actor call and ``@serve.batch`` does not coalesce in the caller; see
``bench/ray_serve.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import socket
import sys
import sysconfig
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray import cloudpickle
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..batch import Batch
from ..compilers.xla import run_cpu_computations_inline
from ..errors import OptionError, QueueFullError, RequestTooLargeError, ServerStoppedError, UnknownServerError
from ..serving.generation import GREEDY, Generation, GenerationFront, GenerationServer, Sampling
from ..serving.options import finite_number
from ..serving.server import Server
from ..serving.serving import Serving

log = logging.getLogger("jitserve.cluster")

NAMESPACE = "jitserve"
MAX_TRIES = 3
REFRESH_S = 2.0
DEFAULT_CALL_TIMEOUT_S = 60.0
DEFAULT_MAX_RESTARTS = 3
_LOST = (RayActorError, ActorDiedError, ActorUnavailableError, GetTimeoutError)


def _cause(error: BaseException) -> BaseException:
    """The exception a replica raised, out of Ray's wrapper."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


class WeightsHolder:
    """A detached actor that owns a serving's weights in Ray's object store, so that they outlive the driver
    that deployed them: a replica started or restarted later (its constructor arguments are the serving
    without its weights, small enough to live in the actor's own record) fetches them from here, and the
    replicas of one node map the same shared-memory copy instead of each unpickling its own."""

    def __init__(self, params: Any) -> None:
        self._ref = [ray.put(params)]  # owned by this actor, not by the driver

    def ref(self) -> list[Any]:
        """The weights' object reference, in a list so that Ray hands it over rather than resolving it."""
        return self._ref


_HolderActor = ray.remote(WeightsHolder)


class Replica:
    """One replica: the in-process server of a serving, inside a Ray actor (asyncio: many calls in flight)."""

    def __init__(self, serving: Serving, name: str, index: int, weight: float, holder: str | None = None) -> None:
        run_cpu_computations_inline()  # too late only if unpickling the serving already ran JAX (its arrays)
        if holder is not None:
            serving = serving.with_params(_held(holder))
        self.name = f"{name}/{index}"
        self.serving = serving
        self.weight = weight
        # preprocess and postprocess run in the callers (their coalescers), never twice
        self.server = Server(serving.replace(preprocess=None, postprocess=None), self.name).start()

    def info(self) -> dict[str, Any]:
        """What routers need: the serving (its configuration travels to callers), capacity and place."""
        return {"serving": self.serving.with_params(None), "partitions": self.server.partitions, "weight": self.weight,
                "node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    async def run(self, rows: Any, batch_key: Any = None) -> tuple[Any, int]:
        """Run one coalesced batch (a pytree of arrays, rows on axis 0, under its batch key); the outputs
        and the queue depth."""
        outputs = await self.server.call_async(Batch.concatenate([rows]).key(batch_key))
        return outputs, self.server.queue_depth

    async def stats(self) -> dict[str, Any]:
        return self.server.stats()

    async def stop(self) -> dict[str, Any]:
        """Stop without drain: requests that have not started are answered ``ServerStoppedError`` (their
        routers send them elsewhere), started ones finish. Returns the final stats."""
        await asyncio.to_thread(self.server.stop, False)
        return self.server.stats()


_ReplicaActor = ray.remote(Replica)


def _held(holder: str) -> Any:
    """The weights a holder actor owns, from the object store (zero-copy, shared on this node)."""
    (ref,) = ray.get(ray.get_actor(holder, namespace=NAMESPACE).ref.remote())
    return ray.get(ref)


class GenerationReplica:
    """One replica of a generation: its own server, slots and decode state, inside a Ray actor. Each
    request is one streaming call (``generate``): its outputs as they come, each with the replica's load."""

    def __init__(self, generation: Generation, name: str, index: int, weight: float,
                 holder: str | None = None) -> None:
        run_cpu_computations_inline()
        if holder is not None:
            generation = generation.with_params(_held(holder))
        self.name = f"{name}/{index}"
        self.generation = generation
        self.weight = weight
        self.server = GenerationServer(generation, self.name).start()

    def info(self) -> dict[str, Any]:
        """What routers need: the generation (without its weights), its slots as capacity, and its place."""
        return {"serving": self.generation.with_params(None), "partitions": self.generation.slots,
                "weight": self.weight, "node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    async def generate(self, prompt: Any, max_steps: int, sampling: Sampling, timeout: float | None
                       ) -> AsyncIterator[tuple[Any, int]]:
        """One request's outputs, each with the prompts this replica holds (in slots or waiting); a caller
        that cancels the call frees the slot at the next step."""
        server = self.server
        request = server.submit(prompt, max_steps, asyncio.get_running_loop(), sampling)
        async for output in server.outputs_async(request, timeout):
            stats = server.stats()
            yield output, stats["slots_busy"] + stats["queue_depth"]

    async def stats(self) -> dict[str, Any]:
        return self.server.stats()

    async def stop(self) -> dict[str, Any]:
        """Stop without drain: waiting and running requests end with ``ServerStoppedError``."""
        await asyncio.to_thread(self.server.stop, False)
        return self.server.stats()


_GenerationActor = ray.remote(GenerationReplica)


def _travel_by_value(serving: Serving | Generation) -> None:
    """Let the user's own modules travel with the serving (cloudpickle by value), so that replicas need
    only the installed packages it imports, not the caller's source tree on their ``sys.path``."""
    installed = {Path(p).resolve() for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])}
    functions = (serving.prefill, serving.decode) if isinstance(serving, Generation) else \
        (serving.fn, serving.preprocess, serving.postprocess)
    for fn in functions:
        module = sys.modules.get(getattr(fn, "__module__", None) or "")
        path = getattr(module, "__file__", None)
        if module is None or path is None or module.__name__ == "__main__":
            continue
        if not any(parent in installed for parent in Path(path).resolve().parents):
            cloudpickle.register_pickle_by_value(module)


def _actor_names(name: str) -> list[str]:
    """The replicas of ``name`` now registered in the cluster, by index."""
    prefix = f"{name}/"
    found = [entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
             if entry["namespace"] == NAMESPACE and entry["name"].startswith(prefix)
             and entry["name"][len(prefix):].isdigit()]
    return sorted(found, key=lambda actor: int(actor.rpartition("/")[2]))


def running_servings() -> list[str]:
    """The names of every serving with replicas in the cluster."""
    names = {entry["name"].rpartition("/")[0] for entry in ray.util.list_named_actors(all_namespaces=True)
             if entry["namespace"] == NAMESPACE and entry["name"].rpartition("/")[2].isdigit()}
    return sorted(names)


def connect(address: str | None) -> None:
    """Connect this process to the Ray cluster at ``address`` ("host:port"; None: Ray's own default) unless
    it is connected already. An address that does not answer is a clear error, not a long hang."""
    if ray.is_initialized():
        return
    if address not in (None, "auto", "local"):
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except (OSError, ValueError) as error:
            raise OptionError(f"cannot reach a Ray cluster at {address!r} ({error}); expected the head node's "
                              f"host:port, as printed by 'ray start --head'") from None
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)


class RayServing:
    """The handle of a serving running on a Ray cluster: ``stats()``, ``scale(n)``, ``stop()``."""

    def __init__(self, serving: Serving | Generation, name: str, weight: float, actor_options: dict[str, Any],
                 spread: bool) -> None:
        self.serving = serving
        self.name = name
        self.weight = weight
        self._actor_options = actor_options
        self._spread = spread
        self._actors: dict[str, Any] = {}
        self._actor_class = _GenerationActor if isinstance(serving, Generation) else _ReplicaActor
        self._holder: str | None = None  # the actor that owns the weights, for a serving with params
        if serving.has_params:
            self._holder = f"{name}/weights-{uuid.uuid4().hex[:8]}"
            holder = _HolderActor.options(name=self._holder, namespace=NAMESPACE, lifetime="detached", num_cpus=0)
            ray.get(holder.remote(serving.params).ref.remote())  # created, and the weights put, before replicas
            self.serving = serving.with_params(None)

    @property
    def replicas(self) -> list[str]:
        """The actor names of this serving's replicas."""
        return list(self._actors)

    def scale(self, replicas: int) -> None:
        """Start or gracefully stop replicas until there are ``replicas``; returns when they are ready."""
        _check_replicas(replicas)
        names = sorted(self._actors, key=lambda actor: int(actor.rpartition("/")[2]))
        if replicas < len(names):
            for actor in names[replicas:]:
                self._stop_replica(actor)
            return
        existing = _actor_names(self.name)
        taken = {int(actor.rpartition("/")[2]) for actor in existing}
        free = (index for index in range(replicas + len(taken)) if index not in taken)
        placement = self._placement(existing) if self._spread else None
        started = {}
        for _, index in zip(range(replicas - len(names)), free):
            actor_name = f"{self.name}/{index}"
            options = dict(self._actor_options)
            if placement:
                node = min(placement, key=placement.__getitem__)  # the node with the fewest replicas of this name
                placement[node] += 1
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
            started[actor_name] = self._actor_class.options(name=actor_name, **options).remote(
                self.serving, self.name, index, self.weight, self._holder)
        try:
            ray.get([actor.info.remote() for actor in started.values()])  # warm-up done: ready
        except BaseException:
            for actor in started.values():
                ray.kill(actor, no_restart=True)
            raise
        self._actors.update(started)

    @staticmethod
    def _placement(existing: list[str]) -> dict[str, int]:
        """Replicas of this name per alive node (soft affinity to the emptiest: Ray's SPREAD is best effort)."""
        counts = {node["NodeID"]: 0 for node in ray.nodes() if node["Alive"]}
        for actor_name in existing:
            try:
                node = ray.get(ray.get_actor(actor_name, namespace=NAMESPACE).info.remote(), timeout=10)["node"]
            except (ValueError, *_LOST):
                continue
            if node in counts:
                counts[node] += 1
        return counts

    def _stop_replica(self, actor_name: str) -> None:
        actor = self._actors.pop(actor_name)
        try:
            ray.get(actor.stop.remote())
        except _LOST:
            pass  # already gone: nothing left to drain
        ray.kill(actor, no_restart=True)

    def stats(self) -> dict[str, Any]:
        """Stats per replica (``replicas``) and summed over them (``total``)."""
        per_replica = _replica_stats(self._actors)
        return {"replicas": per_replica, "total": _total(per_replica.values())}

    def stop(self) -> None:
        """Stop every replica gracefully (what has not started is re-sent elsewhere by its router), then
        free the weights."""
        for actor_name in list(self._actors):
            self._stop_replica(actor_name)
        if self._holder is not None:
            try:
                ray.kill(ray.get_actor(self._holder, namespace=NAMESPACE), no_restart=True)
            except ValueError:  # already gone
                pass

    def __enter__(self) -> RayServing:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _replica_stats(actors: dict[str, Any]) -> dict[str, dict[str, Any]]:
    refs = {name: actor.stats.remote() for name, actor in actors.items()}
    stats = {}
    for name, ref in refs.items():
        try:
            stats[name] = ray.get(ref, timeout=10)
        except _LOST:
            continue
    return stats


def _total(stats: Sequence[dict[str, Any]] | Any) -> dict[str, Any]:
    total: dict[str, Any] = {}
    for one in stats:
        for key, value in one.items():
            if isinstance(value, dict):
                merged = total.setdefault(key, {})
                for size, count in value.items():
                    merged[size] = merged.get(size, 0) + count
            else:
                total[key] = total.get(key, 0) + value
    return total


def _check_replicas(replicas: Any) -> None:
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise OptionError(f"replicas must be a non-negative integer, got {replicas!r}")


def serve(serving: Serving | Generation, name: str, *, replicas: int = 1, weight: float = 1,
          num_cpus: float | None = None,
          num_gpus: float | None = None, resources: dict[str, float] | None = None, address: str | None = None,
          max_restarts: int = DEFAULT_MAX_RESTARTS, spread: bool = True) -> RayServing:
    """Start ``replicas`` replicas of ``serving`` named ``name`` on the Ray cluster at ``address`` (or the
    one this process is connected to); returns once every replica has compiled its batch sizes.

    As with Nx.Serving, a name may be served from several places: a second ``serve`` of a name that
    already has replicas adds its own (with its own ``weight``, e.g. from a node with more devices), and
    its handle scales and stops only those. Replicas of one name must run the same function.

    ``spread`` (without ``resources``) places each new replica on the alive node with the fewest replicas
    of this name (a soft affinity: Ray falls back elsewhere if that node cannot take it);
    ``resources`` pins replicas with Ray custom resources instead. ``num_gpus=1`` with ``partitions=1``
    gives one replica per GPU; ``num_gpus=k`` with ``partitions=k`` one replica per node of k GPUs."""
    _check_replicas(replicas)
    if not finite_number(weight) or weight <= 0:
        raise OptionError(f"weight must be a finite number > 0, got {weight!r}")
    if isinstance(serving, Serving) and serving.streaming:
        raise OptionError("a streaming serving runs in the process that reads its steps; serve it locally "
                          "(js.serve(serving, name)) or behind jitserve serve")
    connect(address)
    _travel_by_value(serving)
    actor_options: dict[str, Any] = {"namespace": NAMESPACE, "lifetime": "detached", "max_restarts": max_restarts,
                                     "max_concurrency": 1000}
    actor_options.update({k: v for k, v in [("num_cpus", num_cpus), ("num_gpus", num_gpus),
                                            ("resources", resources)] if v is not None})
    handle = RayServing(serving, name, weight, actor_options, spread and resources is None)
    handle.scale(replicas)
    return handle


# callers ---------------------------------------------------------------------------------------


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
        names = _actor_names(self.name)
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
            except (*_LOST, RayTaskError):
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
                if not isinstance(error, _LOST) and not isinstance(cause, ServerStoppedError):
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

    def members(self) -> dict[str, Any]:
        with self._lock:
            return {name: member.actor for name, member in self._members.items()}


class _Dispatch:
    """A coalescer partition's executor: one coalesced batch, one Ray call."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def compiled(self, rows: int, tree: Any, row_signature: Any, batch_key: Any = None) -> None:
        """Nothing to compile here: the replicas compiled at their warm-up."""

    def place(self, params: Any) -> tuple[()]:
        """Nothing to place here: the replicas hold the weights."""
        return ()

    def close(self) -> None:
        """Nothing to release: the router outlives the coalescer's partitions."""

    def execute(self, batch: Batch, params: Any) -> Any:
        """``params`` is ``()``: the replicas hold the weights."""
        return self.router.send(batch.materialize(), batch.size, batch.user_key)


class Coalescer(Server):
    """The local front of a cluster serving: callers in this process share one Ray call per batch."""

    def __init__(self, router: Router, serving: Serving, in_flight: int) -> None:
        # unpadded (the replica pads) and unbounded (the replicas' queues are the bound)
        policy = dataclasses.replace(serving.policy, max_queue=None, pad=False)
        super().__init__(serving, router.name, [_Dispatch(router) for _ in range(in_flight)], policy)
        self.router = router

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        """Each replica's server stats, as the replicas report them now."""
        return _replica_stats(self.router.members())


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
        if not isinstance(error, _LOST) and not isinstance(cause, ServerStoppedError):
            raise cause from None
        self.router.forget(member)
        if produced or len(tried) >= MAX_TRIES:
            raise ServerStoppedError(f"replica {member.name} of {self.name!r} was lost after {produced} outputs "
                                     f"({type(cause).__name__})") from None
        log.warning("replica %s lost a request before its first output (%s); sending it elsewhere", member.name,
                    type(cause).__name__)

    def outputs(self, request: Any, timeout: float | None) -> Iterator[Any]:
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

    async def outputs_async(self, request: Any, timeout: float | None) -> AsyncIterator[Any]:
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
        return _total(_replica_stats(self.router.members()).values())

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
