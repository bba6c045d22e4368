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
import hashlib
import logging
import math
import os
import random
import socket
import sys
import sysconfig
import threading
import time
import types
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
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

if TYPE_CHECKING:
    from ..protocol.service import InferenceService

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


class Ownership:
    """What every replica records of its deployment: the owner actor of the process that stops it at exit
    (None: a detached deployment, stopped by its handle or ``jitserve cluster stop``), the weights' holder,
    and the fingerprint of what it serves (a restarted owner adopts only replicas serving the same)."""

    name: str
    weight: float
    owner: str | None
    holder: str | None
    fingerprint: str

    def _own(self, name: str, weight: float, deployment: Deployment) -> None:
        self.name, self.weight = name, weight
        self.owner, self.holder, self.fingerprint = deployment.owner, deployment.holder, deployment.fingerprint

    def adopt(self, owner: str | None) -> None:
        """Belong to ``owner`` from now on (a restarted ``jitserve serve --ray`` taking over)."""
        self.owner = owner

    def _info(self, serving: Serving | Generation, partitions: int) -> dict[str, Any]:
        """What routers need: the serving (its configuration travels to callers), capacity and place; and
        what ``jitserve cluster list`` shows."""
        return {"serving": serving.with_params(None), "partitions": partitions, "weight": self.weight,
                "node": ray.get_runtime_context().get_node_id(), "pid": os.getpid(), "owner": self.owner,
                "holder": self.holder, "fingerprint": self.fingerprint}


@dataclasses.dataclass(frozen=True)
class Deployment:
    """How a replica was deployed (see :class:`Ownership`)."""

    owner: str | None = None
    holder: str | None = None
    fingerprint: str = ""


class Replica(Ownership):
    """One replica: the in-process server of a serving, inside a Ray actor (asyncio: many calls in flight)."""

    def __init__(self, serving: Serving, name: str, index: int, weight: float,
                 deployment: Deployment = Deployment()) -> None:
        run_cpu_computations_inline()  # too late only if unpickling the serving already ran JAX (its arrays)
        if deployment.holder is not None:
            serving = serving.with_params(_held(deployment.holder))
        self._own(f"{name}/{index}", weight, deployment)
        self.serving = serving
        # preprocess and postprocess run in the callers (their coalescers), never twice
        self.server = Server(serving.replace(preprocess=None, postprocess=None), self.name).start()

    def info(self) -> dict[str, Any]:
        return self._info(self.serving, self.server.partitions)

    async def run(self, rows: Any, batch_key: Any = None) -> tuple[Any, int]:
        """Run one coalesced batch (a pytree of arrays, rows on axis 0, under its batch key); the outputs
        and the queue depth."""
        outputs = await self.server.call_async(Batch.concatenate([rows]).key(batch_key))
        return outputs, self.server.queue_depth

    async def run_stream(self, rows: Any, batch_key: Any = None) -> AsyncIterator[Any]:
        """Run one coalesced batch of a streaming serving: its steps as the serving yields them (one Ray
        streaming call; a caller that cancels it stops the batch at its next step)."""
        async for outputs in self.server.open_stream_async(Batch.concatenate([rows]).key(batch_key)):
            yield outputs

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


class GenerationReplica(Ownership):
    """One replica of a generation: its own server, slots and decode state, inside a Ray actor. Each
    request is one streaming call (``generate``): its outputs as they come, each with the replica's load."""

    def __init__(self, generation: Generation, name: str, index: int, weight: float,
                 deployment: Deployment = Deployment()) -> None:
        run_cpu_computations_inline()
        if deployment.holder is not None:
            generation = generation.with_params(_held(deployment.holder))
        self._own(f"{name}/{index}", weight, deployment)
        self.generation = generation
        self.server = GenerationServer(generation, self.name).start()

    def info(self) -> dict[str, Any]:
        """The generation's slots are its capacity."""
        return self._info(self.generation, self.generation.slots)

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
    functions = (serving.prefill, serving.decode) if isinstance(serving, Generation) else (serving.fn,)
    for fn in (*functions, serving.preprocess, serving.postprocess):
        module = sys.modules.get(getattr(fn, "__module__", None) or "")
        path = getattr(module, "__file__", None)
        if module is None or path is None or module.__name__ == "__main__":
            continue
        if not any(parent in installed for parent in Path(path).resolve().parents):
            cloudpickle.register_pickle_by_value(module)


def _actor_names(name: str | None = None) -> list[str]:
    """The replicas of ``name`` (None: of every serving) now registered in the cluster, by serving and
    index: one listing of Ray's named actors."""
    found = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        serving, _, index = entry["name"].rpartition("/")
        if entry["namespace"] == NAMESPACE and index.isdigit() and name in (None, serving):
            found.append((serving, int(index), entry["name"]))
    return [actor for _, _, actor in sorted(found)]


def running_servings() -> list[str]:
    """The names of every serving with replicas in the cluster."""
    return sorted({actor.rpartition("/")[0] for actor in _actor_names()})


def fingerprint(serving: Serving | Generation) -> str:
    """What a serving computes, as a digest that another process computes alike: the fields it declares
    (``fingerprint_fields``: its functions by their bytecode and constants, closures included, and its
    options) and its weights' bytes. (A pickle is no such digest: cloudpickle orders a function's globals by
    hash, which differs between processes.)"""
    digest = hashlib.sha256()
    _digest(digest, serving.fingerprint_fields())
    for leaf in jax.tree_util.tree_leaves(serving.params if serving.has_params else None):
        array = np.ascontiguousarray(leaf)
        digest.update(f"{array.dtype}{array.shape}".encode())
        digest.update(array.reshape(-1).view(np.uint8).data)
    return digest.hexdigest()[:16]


def _digest(digest: Any, value: Any, depth: int = 0) -> None:
    """Feed ``value`` to ``digest`` by content: code by its bytecode, containers by their items."""
    code = getattr(value, "__code__", None)
    if isinstance(value, types.CodeType) or code is not None:
        code = code or value
        digest.update(code.co_code + repr(code.co_names).encode())
        for item in (*code.co_consts, *(cell.cell_contents for cell in getattr(value, "__closure__", None) or ())):
            _digest(digest, item, depth + 1)
    elif isinstance(value, dict):
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode())
            _digest(digest, value[key], depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _digest(digest, item, depth + 1)
    elif isinstance(value, np.ndarray | jax.Array):
        array = np.ascontiguousarray(value)
        digest.update(f"{array.dtype}{array.shape}".encode() + array.tobytes())
    elif hasattr(value, "__dict__") and depth < 8 and not isinstance(value, type):
        digest.update(type(value).__qualname__.encode())
        _digest(digest, dict(vars(value)), depth + 1)
    else:
        digest.update(repr(value).encode() if isinstance(value, (str, int, float, bool, type(None))) or
                      type(value).__repr__ is not object.__repr__ else type(value).__qualname__.encode())


class Owner:
    """A process that owns replicas and stops them at exit (``jitserve serve --ray``), as Ray sees it: a
    named actor of its job, which Ray ends with the process, however it ends. A replica whose owner actor
    is gone is stale: ``jitserve cluster list`` says so, a restarted owner adopts it."""

    def alive(self) -> bool:
        return True


_OwnerActor = ray.remote(Owner)
_owner: list[Any] = []  # this process's owner actor's name and handle (kept: the handle holds the actor)


def process_owner() -> str:
    """This process's owner actor's name, started on first use."""
    if not _owner:
        name = f"owner-{uuid.uuid4().hex[:12]}"
        actor = _OwnerActor.options(name=name, namespace=NAMESPACE, num_cpus=0).remote()
        ray.get(actor.alive.remote())
        _owner[:] = [name, actor]
    return str(_owner[0])


def _owner_alive(owner: str) -> bool:
    try:
        return bool(ray.get(ray.get_actor(owner, namespace=NAMESPACE).alive.remote(), timeout=10))
    except (ValueError, *_LOST):
        return False


def _stale_check() -> Callable[[dict[str, Any] | None], bool]:
    """Whether a replica (its ``info()``; None: it did not answer) is stale: it has an owner, and the owner
    is gone. Each owner is asked once per check."""
    alive: dict[str, bool] = {}

    def stale(info: dict[str, Any] | None) -> bool:
        owner = None if info is None else info.get("owner")
        if owner is None:
            return False
        if owner not in alive:
            alive[owner] = _owner_alive(owner)
        return not alive[owner]

    return stale


def _replicas(name: str | None = None) -> list[tuple[str, Any, dict[str, Any] | None]]:
    """Every replica of ``name`` (None: of every serving) with its actor and ``info()`` (None when it does
    not answer within 10 s: restarting, or lost)."""
    names = _actor_names(name)
    found = []
    for actor_name in names:
        try:
            found.append((actor_name, ray.get_actor(actor_name, namespace=NAMESPACE)))
        except ValueError:
            continue  # gone since the listing
    refs = [actor.info.remote() for _, actor in found]
    ray.wait(refs, num_returns=len(refs), timeout=10)
    answers = []
    for (actor_name, actor), ref in zip(found, refs):
        try:
            answers.append((actor_name, actor, ray.get(ref, timeout=0)))
        except (*_LOST, RayTaskError):
            answers.append((actor_name, actor, None))
    return answers


def _stop_actor(actor: Any) -> None:
    """Stop a replica gracefully (what has not started goes elsewhere), then end its actor."""
    try:
        ray.get(actor.stop.remote())
    except _LOST:
        pass  # already gone: nothing left to drain
    ray.kill(actor, no_restart=True)


def _kill_named(name: str) -> None:
    try:
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
    except ValueError:  # already gone
        pass


def describe() -> list[dict[str, Any]]:
    """Every replica in the cluster (``jitserve cluster list``): its serving, node, process, owner and
    state (``ready``; ``stale`` when its owner is gone; ``unreachable`` when it does not answer)."""
    stale = _stale_check()
    rows = []
    for actor_name, _, info in _replicas():
        row = {"replica": actor_name, "serving": actor_name.rpartition("/")[0], "node": "", "pid": "",
               "owner": "", "state": "unreachable"}
        if info is not None:
            row.update(node=info["node"][:12], pid=info["pid"], owner=info.get("owner") or "(detached)",
                       state="stale" if stale(info) else "ready")
        rows.append(row)
    return rows


def stop_servings(names: Sequence[str] = (), stale: bool = False) -> list[str]:
    """Stop every replica of each serving of ``names`` and free its weights; with ``stale``, also every
    replica whose owner is gone. Returns the replicas stopped."""
    is_stale = _stale_check()
    stopped, holders, kept_holders = [], set(), set()
    for actor_name, actor, info in _replicas():
        if actor_name.rpartition("/")[0] in names or (stale and is_stale(info)):
            _stop_actor(actor)
            stopped.append(actor_name)
            if info is not None and info.get("holder"):
                holders.add(info["holder"])
        elif info is not None and info.get("holder"):
            kept_holders.add(info["holder"])
    for entry in ray.util.list_named_actors(all_namespaces=True):  # weights of stopped servings
        holder = entry["name"]
        if entry["namespace"] == NAMESPACE and "/weights-" in holder and holder.rpartition("/")[0] in names:
            holders.add(holder)
    for holder in holders - kept_holders:
        _kill_named(holder)
    return stopped


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
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    except ConnectionError as error:  # the port answers, but the cluster did not take this process
        token = os.environ.get("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token"
        raise OptionError(f"the Ray cluster at {address!r} did not accept this process ({error}); with token "
                          f"authentication, this process must present the cluster's token: {token} holds another "
                          f"one (a stale token of an earlier cluster?); copy the one its head was started with, or "
                          f"set RAY_AUTH_TOKEN_PATH to it") from None


class RayServing:
    """The handle of a serving running on a Ray cluster: ``stats()``, ``scale(n)``, ``stop()``. With an
    ``owner`` (the actor of the process that stops it at exit), its replicas are that process's."""

    def __init__(self, serving: Serving | Generation, name: str, weight: float, actor_options: dict[str, Any],
                 spread: bool, owner: str | None = None) -> None:
        self.serving = serving.with_params(None) if serving.has_params else serving
        self.name = name
        self.weight = weight
        self._params = serving.params if serving.has_params else None  # until a holder actor owns them
        self._fingerprint = fingerprint(serving) if owner is not None else ""  # only owned replicas are adopted
        self._owner = owner
        self._actor_options = actor_options
        self._spread = spread
        self._actors: dict[str, Any] = {}
        self._actor_class = _GenerationActor if isinstance(serving, Generation) else _ReplicaActor
        self._holder: str | None = None  # the actor that owns the weights new replicas read
        self._holders: set[str] = set()  # those of every replica of this handle, freed at its stop
        self.autoscaler: Autoscaler | None = None

    def _weights_holder(self) -> str | None:
        """The holder actor of the weights, made (and the weights put) before the first replica needs it."""
        if self._holder is None and self._params is not None:
            self._holder = f"{self.name}/weights-{uuid.uuid4().hex[:8]}"
            holder = _HolderActor.options(name=self._holder, namespace=NAMESPACE, lifetime="detached", num_cpus=0)
            ray.get(holder.remote(self._params).ref.remote())
            self._holders.add(self._holder)
            self._params = None
        return self._holder

    def adopt_stale(self) -> list[str]:
        """Take over this name's replicas whose owner is gone and that serve the same (their fingerprint): a
        restarted owner keeps them instead of starting more. Stale ones that serve something else are
        stopped, since one name's replicas must run one function. Returns the adopted replicas."""
        adopted = []
        stale = _stale_check()
        for actor_name, actor, info in _replicas(self.name):
            if info is None or not stale(info):
                continue
            if info["fingerprint"] != self._fingerprint:
                log.warning("stopping replica %s: its owner is gone and it serves another version of '%s'",
                            actor_name, self.name)
                _stop_actor(actor)
                continue
            ray.get(actor.adopt.remote(self._owner))
            self._actors[actor_name] = actor
            if info["holder"] is not None:
                self._holder = self._holder or info["holder"]
                self._holders.add(info["holder"])
            adopted.append(actor_name)
        if self._holder is not None:
            self._params = None  # the adopted replicas' holder has the same weights (same fingerprint)
        return adopted

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
            deployment = Deployment(self._owner, self._weights_holder(), self._fingerprint)
            started[actor_name] = self._actor_class.options(name=actor_name, **options).remote(
                self.serving, self.name, index, self.weight, deployment)
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
        _stop_actor(self._actors.pop(actor_name))

    def stats(self) -> dict[str, Any]:
        """Stats per replica (``replicas``) and summed over them (``total``)."""
        per_replica = _replica_stats(self._actors)
        return {"replicas": per_replica, "total": _total(per_replica.values())}

    def stop(self) -> None:
        """Stop every replica gracefully (what has not started is re-sent elsewhere by its router), then
        free the weights."""
        if self.autoscaler is not None:
            self.autoscaler.stop()
        for actor_name in list(self._actors):
            self._stop_replica(actor_name)
        for holder in self._holders:
            _kill_named(holder)

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
          max_restarts: int = DEFAULT_MAX_RESTARTS, spread: bool = True, owned: bool = False,
          autoscaling: Autoscaling | None = None) -> RayServing:
    """Start ``replicas`` replicas of ``serving`` named ``name`` on the Ray cluster at ``address`` (or the
    one this process is connected to); returns once every replica has compiled its batch sizes.

    As with Nx.Serving, a name may be served from several places: a second ``serve`` of a name that
    already has replicas adds its own (with its own ``weight``, e.g. from a node with more devices), and
    its handle scales and stops only those. Replicas of one name must run the same function.

    ``spread`` (without ``resources``) places each new replica on the alive node with the fewest replicas
    of this name (a soft affinity: Ray falls back elsewhere if that node cannot take it);
    ``resources`` pins replicas with Ray custom resources instead. ``num_gpus=1`` with ``partitions=1``
    gives one replica per GPU; ``num_gpus=k`` with ``partitions=k`` one replica per node of k GPUs.

    ``owned=True`` (``jitserve serve --ray``) makes the replicas this process's: they are stale once it is
    gone without stopping them, and this call first adopts the stale replicas of ``name`` that serve the
    same (:meth:`RayServing.adopt_stale`), starting only the rest.

    ``autoscaling`` (:class:`Autoscaling`) starts ``min_replicas`` and then adds and removes replicas by
    load from a thread of this process (``handle.autoscaler.events`` records the changes); ``replicas``
    is then ignored."""
    _check_replicas(replicas)
    if autoscaling is not None and isinstance(serving, Generation):
        raise OptionError("autoscaling follows a serving's queue; scale a generation's replicas with scale(n)")
    if not finite_number(weight) or weight <= 0:
        raise OptionError(f"weight must be a finite number > 0, got {weight!r}")
    connect(address)
    _travel_by_value(serving)
    actor_options: dict[str, Any] = {"namespace": NAMESPACE, "lifetime": "detached", "max_restarts": max_restarts,
                                     "max_concurrency": 1000}
    actor_options.update({k: v for k, v in [("num_cpus", num_cpus), ("num_gpus", num_gpus),
                                            ("resources", resources)] if v is not None})
    handle = RayServing(serving, name, weight, actor_options, spread and resources is None,
                        process_owner() if owned else None)
    if owned:
        adopted = handle.adopt_stale()
        if adopted:
            log.info("adopted %d replicas of '%s' whose owner is gone: %s", len(adopted), name, ", ".join(adopted))
    handle.scale(replicas if autoscaling is None else autoscaling.min_replicas)
    if isinstance(serving, Serving) and autoscaling is not None:
        handle.autoscaler = Autoscaler(handle, autoscaling, serving.batch_size)
    return handle


@dataclasses.dataclass(frozen=True)
class Autoscaling:
    """When a serving on Ray adds and removes replicas, between ``min_replicas`` and ``max_replicas``.

    Up: once the rows waiting per replica stay at ``target_queue`` or above (default: the serving's
    ``batch_size``: a full batch waiting behind the one running) or, with ``target_wait_s``, the rows run
    lately waited longer than that on average, for ``upscale_delay_s``: to as many replicas as would bring
    the queue to the target (at least one more). Down: once the queue stays at most half the target and
    one replica fewer would have been less than ``busy_after_down`` busy (the hysteresis that keeps it from
    flapping), for ``downscale_delay_s``: to as few replicas as stay under that (at least one fewer). Read
    every ``period_s`` from the replicas' own counters."""

    min_replicas: int = 1
    max_replicas: int = 1
    target_queue: float | None = None
    target_wait_s: float | None = None
    upscale_delay_s: float = 1.0
    downscale_delay_s: float = 10.0
    busy_after_down: float = 0.7
    period_s: float = 0.25

    def __post_init__(self) -> None:
        _check_replicas(self.min_replicas)
        _check_replicas(self.max_replicas)
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise OptionError(f"autoscaling needs 1 <= min_replicas <= max_replicas, got {self.min_replicas} and "
                              f"{self.max_replicas}")
        for name in ("target_queue", "target_wait_s"):
            value = getattr(self, name)
            if value is not None and (not finite_number(value) or value <= 0):
                raise OptionError(f"{name} must be a finite number > 0 or None, got {value!r}")
        for name in ("upscale_delay_s", "downscale_delay_s", "period_s"):
            if not finite_number(getattr(self, name)) or getattr(self, name) < 0:
                raise OptionError(f"{name} must be a finite number of seconds >= 0, got {getattr(self, name)!r}")


class Autoscaler:
    """Scales a :class:`RayServing` by its :class:`Autoscaling` on a thread of the deploying process;
    ``events`` records each decision: (seconds since start, replicas before, after, why)."""

    def __init__(self, handle: RayServing, policy: Autoscaling, batch_size: int) -> None:
        self.handle = handle
        self.policy = policy
        self.target = policy.target_queue if policy.target_queue is not None else float(batch_size)
        self.events: list[tuple[float, int, int, str]] = []
        self._started = time.monotonic()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"jitserve-autoscale-{handle.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _watch(self) -> None:
        policy = self.policy
        last = None
        high_since = low_since = None
        while not self._stopped.wait(policy.period_s):
            try:
                now, totals = time.monotonic(), _total(self.handle.stats()["replicas"].values())
            except Exception:  # noqa: BLE001 - a replica restarting: look again next period
                continue
            replicas = len(self.handle.replicas)
            if last is None or replicas == 0:
                last = (now, totals)
                continue
            (then, before), last = last, (now, totals)
            rows = totals["rows"] - before["rows"]
            wait = (totals["queue_wait_s"] - before["queue_wait_s"]) / rows if rows > 0 else 0.0
            busy = max(totals["execution_s"] - before["execution_s"], 0.0) / max(now - then, 1e-9) / replicas
            depth = totals["queue_depth"] / replicas
            high = depth >= self.target or (policy.target_wait_s is not None and wait > policy.target_wait_s)
            low = depth <= self.target / 2 and busy * replicas / max(replicas - 1, 1) < policy.busy_after_down \
                and (policy.target_wait_s is None or wait <= policy.target_wait_s / 2)
            high_since = (high_since or now) if high else None
            low_since = (low_since or now) if low else None
            if high_since is not None and now - high_since >= policy.upscale_delay_s \
                    and replicas < policy.max_replicas:
                wanted = min(policy.max_replicas, max(replicas + 1, math.ceil(replicas * depth / self.target)))
                self._scale(replicas, wanted, f"{depth:.1f} rows waiting per replica, {wait * 1000:.0f} ms waits")
                high_since = last = None
            elif low_since is not None and now - low_since >= policy.downscale_delay_s \
                    and replicas > policy.min_replicas:
                wanted = max(policy.min_replicas, math.ceil(busy * replicas / policy.busy_after_down))
                self._scale(replicas, min(wanted, replicas - 1), f"idle: {depth:.1f} rows waiting, {busy:.0%} busy")
                low_since = last = None

    def _scale(self, replicas: int, wanted: int, why: str) -> None:
        """Decide (the event's time), then scale: returns once new replicas are warm."""
        log.info("autoscaling '%s': %d -> %d replicas (%s)", self.handle.name, replicas, wanted, why)
        self.events.append((time.monotonic() - self._started, replicas, wanted, why))
        self.handle.scale(wanted)


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
                retry = isinstance(error, _LOST) or isinstance(cause, (ServerStoppedError, QueueFullError))
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
