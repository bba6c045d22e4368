"""Serving with dynamic batching: ``Serving``, the in-process ``Server`` and the registry of names."""

from .registry import batched_run, batched_run_async, lookup, serve, servers
from .server import BatchReport, Server
from .serving import Serving

__all__ = ["BatchReport", "Server", "Serving", "batched_run", "batched_run_async", "lookup", "serve", "servers"]
