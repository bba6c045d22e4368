"""Deploying a serving or a generation on Ray: ``serve`` starts its replicas and returns their handle
(:class:`RayServing`), which scales them, places new ones, adopts stale ones and stops them.

``serve(serving, name, replicas=N)`` starts N actors ``name/0 .. name/N-1``
in the ``jitserve`` namespace, each running the in-process server, and
returns once each has compiled its batch sizes. The weights are put once into
Ray's object store, owned by a detached holder actor that replicas started or
restarted later read them from. The user's own modules travel with the
serving (by value), so that replicas need only the installed packages.
"""

from __future__ import annotations

import logging
import sys
import sysconfig
import uuid
from pathlib import Path
from typing import Any, cast

import ray
from ray import cloudpickle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ...errors import OptionError
from ...serving.generation import Generation
from ...serving.options import finite_number
from ...serving.serving import Serving
from ...serving.stats import FrontStats
from .autoscaling import Autoscaler, Autoscaling
from .operations import (
    DeploymentStats,
    actor_names,
    check_replicas,
    connect,
    fingerprint,
    kill_named,
    process_owner,
    replica_infos,
    replica_stats,
    stale_check,
    stop_actor,
)
from .replicas import LOST, NAMESPACE, Deployment, GenerationActor, HolderActor, ReplicaActor

log = logging.getLogger("jitserve.cluster")

DEFAULT_MAX_RESTARTS = 3


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
        self._actor_class = GenerationActor if isinstance(serving, Generation) else ReplicaActor
        self._holder: str | None = None  # the actor that owns the weights new replicas read
        self._holders: set[str] = set()  # those of every replica of this handle, freed at its stop
        self.autoscaler: Autoscaler | None = None

    def _weights_holder(self) -> str | None:
        """The holder actor of the weights, made (and the weights put) before the first replica needs it."""
        if self._holder is None and self._params is not None:
            self._holder = f"{self.name}/weights-{uuid.uuid4().hex[:8]}"
            holder = HolderActor.options(name=self._holder, namespace=NAMESPACE, lifetime="detached", num_cpus=0)
            ray.get(holder.remote(self._params).ref.remote())
            self._holders.add(self._holder)
            self._params = None
        return self._holder

    def adopt_stale(self) -> list[str]:
        """Take over this name's replicas whose owner is gone and that serve the same (their fingerprint): a
        restarted owner keeps them instead of starting more. Stale ones that serve something else are
        stopped, since one name's replicas must run one function. Returns the adopted replicas."""
        adopted = []
        stale = stale_check()
        for actor_name, actor, info in replica_infos(self.name):
            if info is None or not stale(info):
                continue
            if info["fingerprint"] != self._fingerprint:
                log.warning("stopping replica %s: its owner is gone and it serves another version of '%s'",
                            actor_name, self.name)
                stop_actor(actor_name, actor)
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
        check_replicas(replicas)
        names = sorted(self._actors, key=lambda actor: int(actor.rpartition("/")[2]))
        if replicas < len(names):
            for actor in names[replicas:]:
                self._stop_replica(actor)
            return
        existing = actor_names(self.name)
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
            except (ValueError, *LOST):
                continue
            if node in counts:
                counts[node] += 1
        return counts

    def _stop_replica(self, actor_name: str) -> None:
        stop_actor(actor_name, self._actors.pop(actor_name))

    def stats(self) -> DeploymentStats:
        """Stats per replica (``replicas``) and summed over them (``total``)."""
        per_replica = replica_stats(self._actors)
        return DeploymentStats(per_replica, FrontStats.total(per_replica.values()))

    def stop(self) -> None:
        """Stop every replica gracefully (what has not started is re-sent elsewhere by its router), then
        free the weights."""
        if self.autoscaler is not None:
            self.autoscaler.stop()
        for actor_name in list(self._actors):
            self._stop_replica(actor_name)
        for holder in self._holders:
            kill_named(holder)

    def __enter__(self) -> RayServing:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _travel_by_value(serving: Serving | Generation) -> None:
    """Let the user's own modules travel with the serving (cloudpickle by value), so that replicas need
    only the installed packages it imports, not the caller's source tree on their ``sys.path``."""
    installed = {Path(p).resolve() for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])}
    for fn in (*serving.functions, serving.preprocess, serving.postprocess):
        module = sys.modules.get(getattr(fn, "__module__", None) or "")
        path = getattr(module, "__file__", None)
        if module is None or path is None or module.__name__ == "__main__":
            continue
        if not any(parent in installed for parent in Path(path).resolve().parents):
            cloudpickle.register_pickle_by_value(module)


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
    check_replicas(replicas)
    if autoscaling is not None and serving.generates:
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
    if autoscaling is not None:
        handle.autoscaler = Autoscaler(handle, autoscaling, cast(Serving, serving).batch_size)
    return handle
