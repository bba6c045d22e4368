"""The Ray actors of a deployment: the replicas of a serving or a generation, the holder of their weights,
and the owner actor of a process whose replicas stop with it.

Every actor is named in the ``jitserve`` namespace (:data:`NAMESPACE`) and, but
for an owner, detached: it outlives the driver that started it. A replica
runs the in-process server (warm-up done in its constructor, before it counts
as ready) and records its deployment (:class:`Ownership`). What the other
rooms catch when an actor is gone is :data:`LOST`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

from ...batch import Batch
from ...compilers.xla import run_cpu_computations_inline
from ...serving.corridor import Rows
from ...serving.generation import Generation, GenerationServer, Sampling
from ...serving.server import Server
from ...serving.serving import Serving
from ...serving.stats import GenerationStats, ServerStats

NAMESPACE = "jitserve"
LOST = (RayActorError, ActorDiedError, ActorUnavailableError, GetTimeoutError)  # an actor died, or did not answer


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


HolderActor = ray.remote(WeightsHolder)


def _held(holder: str) -> Any:
    """The weights a holder actor owns, from the object store (zero-copy, shared on this node)."""
    (ref,) = ray.get(ray.get_actor(holder, namespace=NAMESPACE).ref.remote())
    return ray.get(ref)


@dataclasses.dataclass(frozen=True)
class Deployment:
    """How a replica was deployed (see :class:`Ownership`)."""

    owner: str | None = None
    holder: str | None = None
    fingerprint: str = ""


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
        outputs = await self.server.call_async(Rows(Batch.concatenate([rows]).key(batch_key)))
        return outputs, self.server.queue_depth

    async def run_stream(self, rows: Any, batch_key: Any = None) -> AsyncIterator[tuple[Any, int]]:
        """Run one coalesced batch of a streaming serving: its steps as the serving yields them, each with the
        queue depth (one Ray streaming call; a caller that cancels it stops the batch at its next step)."""
        async for outputs in self.server.stream_async(Rows(Batch.concatenate([rows]).key(batch_key))):
            yield outputs, self.server.queue_depth

    async def stats(self) -> ServerStats:
        return self.server.stats()

    async def stop(self) -> ServerStats:
        """Stop without drain: requests that have not started are answered ``ServerStoppedError`` (their
        routers send them elsewhere), started ones finish. Returns the final stats."""
        await asyncio.to_thread(self.server.stop, False)
        return self.server.stats()


ReplicaActor = ray.remote(Replica)


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
        """One request's outputs, then its ``End`` with why it ended, each with the prompts this replica holds
        (in slots or waiting); a caller that cancels the call frees the slot at the next step."""
        server = self.server
        request = server.submit(prompt, max_steps, asyncio.get_running_loop(), sampling)
        async for output in server.outputs_async(request, timeout):
            stats = server.stats()
            yield output, stats.slots_busy + stats.queue_depth

    async def stats(self) -> GenerationStats:
        return self.server.stats()

    async def stop(self) -> GenerationStats:
        """Stop without drain: waiting and running requests end with ``ServerStoppedError``."""
        await asyncio.to_thread(self.server.stop, False)
        return self.server.stats()


GenerationActor = ray.remote(GenerationReplica)


class Owner:
    """A process that owns replicas and stops them at exit (``jitserve serve --ray``), as Ray sees it: a
    named actor of its job, which Ray ends with the process, however it ends. A replica whose owner actor
    is gone is stale: ``jitserve cluster list`` says so, a restarted owner adopts it."""

    def alive(self) -> bool:
        return True


OwnerActor = ray.remote(Owner)
