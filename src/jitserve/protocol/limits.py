"""The limits one network server enforces on its clients, with their defaults, and its TLS files.

Each limit turns a way to exhaust the server (memory, file descriptors,
event-loop time) into a clear refusal of the client that hits it; the
defaults admit any ordinary client, including tritonclient with large tensors.
``jitserve serve`` sets each with the flag named in its field's comment.
"""

from __future__ import annotations

import dataclasses
import ssl
from pathlib import Path

from ..errors import OptionError
from ..serving.options import finite_number

MiB = 2**20
MAX_COUNT = 2**31 - 1  # gRPC's and uvicorn's settings are 32-bit integers
MAX_SECONDS = MAX_COUNT // 1000  # gRPC takes times in 32-bit milliseconds: about 24.8 days


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one client may take of the server, per connection or per call."""

    max_body_bytes: int = 64 * MiB  # --max-body-bytes: a larger request body is 413 / RESOURCE_EXHAUSTED
    max_header_bytes: int = 32 * 1024  # --max-header-bytes: request line and headers; larger is 431
    read_timeout: float = 30.0  # --read-timeout: seconds for the headers, and for each pause in the body; 408
    write_timeout: float = 30.0  # --write-timeout: seconds a client may stop reading its response; then closed
    max_connections: int = 4096  # --max-connections: open HTTP connections; one more is answered 503 and closed
    max_grpc_calls: int = 4096  # --max-grpc-calls: gRPC calls in flight; one more is RESOURCE_EXHAUSTED
    max_grpc_connections: int = 1024  # --max-grpc-connections: open gRPC connections, handshakes included
    idle_timeout: float = 300.0  # --idle-timeout: seconds a gRPC connection may go without a call; then closed
    max_stream_requests: int = 16  # --max-stream-requests: requests of one gRPC stream in flight; beyond, unread
    stream_buffer_bytes: int = 16 * MiB  # --stream-buffer-bytes: replies of one gRPC stream waiting to be sent
    offload_bytes: int = 1 * MiB  # bodies from this size are decoded and encoded off the event loop, one at a time

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not finite_number(value) or value <= 0:
                raise OptionError(f"limit {field.name} must be a finite positive number, got {value!r}")
            largest = MAX_SECONDS if field.type == "float" else MAX_COUNT
            if value > largest:
                raise OptionError(f"limit {field.name} must be at most {largest:,}"
                                  f"{' seconds' if field.type == 'float' else ''}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Tls:
    """A certificate chain and its private key (PEM files) for HTTPS and gRPC over TLS."""

    cert: str  # --tls-cert
    key: str  # --tls-key

    def __post_init__(self) -> None:
        for what, path in (("certificate", self.cert), ("key", self.key)):
            if not Path(path).is_file():
                raise OptionError(f"TLS {what} file {path!r} does not exist")

    def server_context(self) -> ssl.SSLContext:
        """The HTTPS front's TLS context: Python's defaults for a server (TLS 1.2 and up), this chain and key."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        return context

    def cert_bytes(self) -> bytes:
        return Path(self.cert).read_bytes()

    def key_bytes(self) -> bytes:
        return Path(self.key).read_bytes()
