"""Operating what runs on a Ray cluster: connecting to it, the replicas' names, listing, describing and
stopping them, their owners and which are stale, their stats, and the fingerprint of what a serving computes.

A replica is the actor ``NAME/INDEX`` in the ``jitserve`` namespace; the
holder of a deployment's weights is ``NAME/weights-ID``. A replica deployed by
``jitserve serve --ray`` records the owner actor of that process: once the
owner is gone, the replica is stale (``jitserve cluster list`` says so,
``jitserve cluster stop --stale`` stops it, and a restarted owner adopts it
if its fingerprint matches).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
import types
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import ray
from ray.exceptions import RayTaskError

from ...errors import OptionError
from ...serving.generation import Generation
from ...serving.serving import Serving
from ...serving.stats import FrontStats
from .replicas import LOST, NAMESPACE, OwnerActor

log = logging.getLogger("jitserve.cluster")
ACTOR_END_S = 60.0  # how long a killed actor may keep its name before stopping it goes on with a warning


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


def check_replicas(replicas: Any) -> None:
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise OptionError(f"replicas must be a non-negative integer, got {replicas!r}")


def actor_names(name: str | None = None) -> list[str]:
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
    return sorted({actor.rpartition("/")[0] for actor in actor_names()})


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


_owner: list[Any] = []  # this process's owner actor's name and handle (kept: the handle holds the actor)


def process_owner() -> str:
    """This process's owner actor's name, started on first use."""
    if not _owner:
        name = f"owner-{uuid.uuid4().hex[:12]}"
        actor = OwnerActor.options(name=name, namespace=NAMESPACE, num_cpus=0).remote()
        ray.get(actor.alive.remote())
        _owner[:] = [name, actor]
    return str(_owner[0])


def _owner_alive(owner: str) -> bool:
    try:
        return bool(ray.get(ray.get_actor(owner, namespace=NAMESPACE).alive.remote(), timeout=10))
    except (ValueError, *LOST):
        return False


def stale_check() -> Callable[[dict[str, Any] | None], bool]:
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


def replica_infos(name: str | None = None) -> list[tuple[str, Any, dict[str, Any] | None]]:
    """Every replica of ``name`` (None: of every serving) with its actor and ``info()`` (None when it does
    not answer within 10 s: restarting, or lost)."""
    names = actor_names(name)
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
        except (*LOST, RayTaskError):
            answers.append((actor_name, actor, None))
    return answers


def stop_actor(name: str, actor: Any) -> None:
    """Stop a replica gracefully (what has not started goes elsewhere), then end its actor."""
    try:
        ray.get(actor.stop.remote())
    except LOST:
        pass  # already gone: nothing left to drain
    end_actor(name, actor)


def kill_named(name: str) -> None:
    """End the actor of that name (a weights holder), if there is one."""
    try:
        end_actor(name, ray.get_actor(name, namespace=NAMESPACE))
    except ValueError:  # already gone
        pass


def end_actor(name: str, actor: Any) -> None:
    """End an actor for good and return once Ray has let its name go, so that a new actor may take it: ``ray.kill``
    returns before the actor is dead, and a call made meanwhile may still be answered."""
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + ACTOR_END_S
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.05)
    log.warning("Ray actor %s was killed but still holds its name after %g s", name, ACTOR_END_S)


def describe() -> list[dict[str, Any]]:
    """Every replica in the cluster (``jitserve cluster list``): its serving, node, process, owner and
    state (``ready``; ``stale`` when its owner is gone; ``unreachable`` when it does not answer)."""
    stale = stale_check()
    rows = []
    for actor_name, _, info in replica_infos():
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
    is_stale = stale_check()
    stopped, holders, kept_holders = [], set(), set()
    for actor_name, actor, info in replica_infos():
        if actor_name.rpartition("/")[0] in names or (stale and is_stale(info)):
            stop_actor(actor_name, actor)
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
        kill_named(holder)
    return stopped


def replica_stats(actors: dict[str, Any]) -> dict[str, FrontStats]:
    """Each replica's server stats (by actor name), as the replicas report them now; one that is gone is left
    out."""
    refs = {name: actor.stats.remote() for name, actor in actors.items()}
    stats = {}
    for name, ref in refs.items():
        try:
            stats[name] = ray.get(ref, timeout=10)
        except LOST:
            continue
    return stats


class DeploymentStats(NamedTuple):
    """A deployment's stats: each replica's (by actor name) and their sum (``total``)."""

    replicas: dict[str, FrontStats]
    total: FrontStats
