"""Scale-out on Ray: replicas of a Serving or a Generation as named, detached Ray core actors, and a
coalescer in each caller.

The rooms, each with its job:

- :mod:`.replicas`: the Ray actors (a replica of a serving or a generation, the holder of the weights, the
  owner actor of a process);
- :mod:`.operations`: connecting, the replicas' names, listing, describing and stopping them, owners and
  staleness, stats, and the fingerprint of what a serving computes;
- :mod:`.deployment`: ``serve`` and the handle of a deployment (:class:`RayServing`): scaling, placement,
  adoption;
- :mod:`.autoscaling`: the autoscaling policy and the thread that follows it;
- :mod:`.routing`: reaching the replicas from a caller's process: routing, retries, coalescing, the front
  of a generation, lookup by name, and a network front kept in step with the cluster.

Why Ray core actors and not Ray Serve: one Ray Serve handle call costs 2-5x
an actor call and ``@serve.batch`` does not coalesce in the caller; see
``bench/ray_serve.py``.
"""

from .autoscaling import Autoscaling
from .deployment import serve
from .operations import actor_names as _actor_names
from .operations import connect, describe, running_servings, stop_servings
from .routing import FrontSync, lookup

__all__ = ["Autoscaling", "FrontSync", "_actor_names", "connect", "describe", "lookup", "running_servings",
           "serve", "stop_servings"]
