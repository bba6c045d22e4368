"""Serving with dynamic batching: ``Serving``, the in-process ``Server``, its queues and the registry of names;
``Generation``, continuous batching of decode loops."""

from .corridor import Rows
from .generation import Generation, GenerationServer, PagedCache, Prompt, Sampling, TokenLogprobs
from .partition import BatchReport
from .queue import BatchPolicy
from .registry import (
                       batched_run,
                       batched_run_async,
                       batched_stream,
                       batched_stream_async,
                       generate,
                       generate_async,
                       generate_stream,
                       generate_stream_async,
                       lookup,
                       register_cluster,
                       serve,
                       servers,
)
from .request import Request
from .server import Server
from .serving import Serving

__all__ = ["BatchPolicy", "BatchReport", "Generation", "GenerationServer", "PagedCache", "Prompt", "Request",
           "Rows", "Sampling", "Server", "Serving", "TokenLogprobs",
           "batched_run", "batched_run_async", "batched_stream", "batched_stream_async", "generate", "generate_async",
           "generate_stream", "generate_stream_async", "lookup", "register_cluster", "serve", "servers"]
