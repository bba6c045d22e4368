"""Cluster back ends, plugged into the serving registry without importing them.

``serve(..., cluster="ray")`` and lookups of names in a Ray cluster reach
:mod:`jitserve.cluster.ray` through a light stand-in that imports Ray only
when a Ray serving is started, or when this process is connected to a Ray
cluster (``ray`` imported and initialised) and a name is not found locally.
"""

from __future__ import annotations

import sys
from typing import Any

from ..errors import OptionError
from ..serving.front import Front
from ..serving.generation import Generation
from ..serving.registry import register_cluster
from ..serving.serving import Serving


class _LazyRay:
    """The Ray back end, imported on first use."""

    def connected(self) -> bool:
        ray = sys.modules.get("ray")
        return ray is not None and ray.is_initialized()

    @staticmethod
    def _backend() -> Any:
        try:
            from . import ray as backend
        except ImportError as error:
            raise OptionError(f"cluster='ray' needs Ray: pip install 'jitserve[ray]' ({error})") from None
        return backend

    def serve(self, serving: Serving | Generation, name: str, **options: Any) -> Any:
        return self._backend().serve(serving, name, **options)

    def lookup(self, name: str) -> Front | None:
        return self._backend().lookup(name)


register_cluster("ray", _LazyRay())
