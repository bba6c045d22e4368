"""The HTTP connection's transport (``protocol/connection.py``'s ``OneSend``): writes within one turn of the
event loop leave as one, and nothing written is lost, reordered or sent after the connection closed."""

from __future__ import annotations

import asyncio
import http.client

import pytest

pytest.importorskip("uvicorn")

from jitserve.protocol.connection import OneSend
from netutil import serving


class RecordingTransport:
    """What OneSend hands on: each write, and the calls that end the stream, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.calls.append(("write", data))

    def write_eof(self) -> None:
        self.calls.append(("write_eof", b""))

    def close(self) -> None:
        self.calls.append(("close", b""))
        self.closing = True

    def abort(self) -> None:
        self.calls.append(("abort", b""))
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return 7

    def get_extra_info(self, name: str) -> str:
        return f"extra {name}"


async def _turn() -> None:
    """Let the event loop finish its current turn (the flush OneSend scheduled with call_soon runs)."""
    await asyncio.sleep(0)


def test_writes_within_one_turn_leave_as_one_and_later_ones_on_their_own():
    async def scenario() -> list[tuple[str, bytes]]:
        transport = RecordingTransport()
        one = OneSend(transport, asyncio.get_running_loop())  # type: ignore[arg-type]
        one.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        one.write(b"{}")
        assert transport.calls == [], "held until the turn ends"
        assert one.get_write_buffer_size() == 7 + 38 + 2
        await _turn()
        one.write(b"data: 1\n\n")  # a stream's next event, a turn later
        await _turn()
        assert one.get_extra_info("peername") == "extra peername"  # the rest is the transport's
        return transport.calls

    assert asyncio.run(scenario()) == [("write", b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"),
                                       ("write", b"data: 1\n\n")]


def test_closing_or_ending_sends_what_is_held_first_and_aborting_drops_it():
    async def scenario() -> list[list[tuple[str, bytes]]]:
        loop = asyncio.get_running_loop()
        seen = []
        for end in ("close", "write_eof", "abort"):
            transport = RecordingTransport()
            one = OneSend(transport, loop)  # type: ignore[arg-type]
            one.write(b"head")
            one.write(b"body")
            getattr(one, end)()
            await _turn()  # the scheduled flush finds nothing held, or a closed transport: it writes nothing
            seen.append(transport.calls)
        return seen

    assert asyncio.run(scenario()) == [[("write", b"headbody"), ("close", b"")],
                                       [("write", b"headbody"), ("write_eof", b"")],
                                       [("abort", b"")]]


def test_a_transport_closed_under_a_held_write_is_not_written_to():
    async def scenario() -> list[tuple[str, bytes]]:
        transport = RecordingTransport()
        one = OneSend(transport, asyncio.get_running_loop())  # type: ignore[arg-type]
        one.write(b"answer")
        transport.closing = True  # the client went away within the turn
        await _turn()
        return transport.calls

    assert asyncio.run(scenario()) == []


def test_a_served_answer_and_a_refusal_arrive_whole_over_keep_alive():
    with serving("examples/mlp.py:serving", "--no-grpc") as running:
        connection = http.client.HTTPConnection("127.0.0.1", running.port, timeout=30)
        body = b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16], "data": [' \
               + b",".join([b"0.5"] * 16) + b"]}]}"
        for _ in range(3):  # one connection: each answer's head and body, and nothing of the next
            connection.request("POST", "/v2/models/mlp/infer", body, {"content-type": "application/json"})
            answer = connection.getresponse()
            assert answer.status == 200 and b'"shape":[1,4]' in answer.read()
        connection.request("POST", "/v2/models/mlp/infer", b"{", {"content-type": "application/json"})
        refused = connection.getresponse()
        assert refused.status == 400 and b"not valid JSON" in refused.read()
        connection.close()
