"""Several HTTP front processes over one engine (``jitserve serve --http-workers N``) against one process.

In one run, ``jitserve serve examples/mlp.py:serving --no-grpc`` (the MLP of 16 -> 64 -> 4, batches of up
to 32 rows) serves as one process, then with ``--http-workers N`` for each N of ``--fronts``, each under the
same load: closed-loop keep-alive connections (``--connections``, default 1 and 64) posting the same JSON
body, one row of 16 floats, for ``--seconds``, after a warm-up of a second. For each it prints requests/s,
latency p50 and p99, answers that were not 200, the server's CPU per request (its whole process tree, from
/proc) and requests/s over one process's at the same connections. Every server's answer to the body is
checked first against one process's, byte for byte.

The load: ``wrk`` (a C client; ``--threads`` of it) when it is on PATH or given as ``--wrk``, else (or
with ``--load python``) a client of this script's own: ``--load-processes`` processes, each one asyncio
loop with its share of the connections, each connection writing the prepared request and reading its
answer (its status checked). Either prints which one ran.

With 2 cores, as on the machine the figures in bench/README.md come from, no gain is expected: the fronts,
the engine, XLA and the load generator share them. The design is for many cores, where one event loop
bounds one process.

    python3 dev.py bench workers [--fronts 1 2 4] [--connections 1 64] [--seconds 6]
    PYTHONPATH=src python3 bench/workers.py --fronts 1 4 8 --threads 4     # a 16-core machine

It needs what ``jitserve serve`` needs (jax, numpy, uvicorn, httptools, orjson, pysimdjson,
prometheus-client, grpcio, ml-dtypes; uvloop if installed) and nothing more; wrk is optional.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROW = [round(0.1 * (index - 8), 1) for index in range(16)]
BODY = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16], "data": ROW}]},
                  separators=(",", ":")).encode()
PATH = "/v2/models/mlp/infer"
WRK_SCRIPT = 'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\nwrk.body = [[%s]]\n'


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Server:
    """``jitserve serve`` of the MLP, one process or ``fronts`` front processes over one engine."""

    def __init__(self, fronts: int | None, log: Path) -> None:
        self.fronts = fronts
        self.port = free_port()
        self.log = log.open("w")
        command = [sys.executable, "-m", "jitserve", "serve", "examples/mlp.py:serving", "--port", str(self.port),
                   "--no-grpc", *(["--http-workers", str(fronts)] if fronts else [])]
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                                                os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=environment)
        try:
            self.answer = self._started(log)
        except BaseException:
            self.process.kill()  # with its fronts: their socket to it closes
            raise

    def _started(self, log: Path) -> bytes:
        """The server's answer to the body, once it has started (its fronts too)."""
        started = "front processes share the port" if self.fronts else "HTTP: http://"
        deadline = time.monotonic() + 600
        while True:  # the line is logged as the port opens: then it answers
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start:\n{log.read_text()}")
            if started in log.read_text():
                try:
                    return self.post()
                except OSError:
                    pass
            time.sleep(0.2)

    @property
    def name(self) -> str:
        return "one process" if not self.fronts else f"{self.fronts} front{'s' if self.fronts > 1 else ''}"

    def post(self) -> bytes:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{PATH}", BODY,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return bytes(response.read())

    def cpu_seconds(self) -> float:
        """CPU time of the server and its front processes so far."""
        pids, total = [self.process.pid], 0
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == self.process.pid:
                        pids.append(int(entry))
                except (OSError, IndexError, ValueError):
                    continue
        for pid in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=120)
        self.log.close()


# ---- the load: wrk, or this script's own client --------------------------------------------------------------

def wrk_load(binary: str, port: int, connections: int, threads: int, seconds: float) -> dict[str, float]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(WRK_SCRIPT % BODY.decode())
        script.flush()
        output = subprocess.run([binary, "-t", str(min(threads, connections)), "-c", str(connections),
                                 "-d", f"{seconds:g}s", "--latency", "-s", script.name,
                                 f"http://127.0.0.1:{port}{PATH}"], capture_output=True, text=True, check=True).stdout
    def latency(percent: str) -> float:
        value, unit = re.search(rf"^\s+{percent}%\s+([\d.]+)(us|ms|s)\s*$", output, re.M).groups()  # type: ignore[union-attr]
        return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]

    requests = int(re.search(r"(\d+) requests in", output).group(1))  # type: ignore[union-attr]
    failed = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output)
    return {"requests": requests, "rate": float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1)),  # type: ignore[union-attr]
            "p50": latency("50"), "p99": latency("99"),
            "failed": (int(failed.group(1)) if failed else 0) + (sum(map(int, errors.groups())) if errors else 0)}


async def _connection(port: int, request: bytes, deadline: float, latencies: list[float], failures: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length:\s*(\d+)", head).group(1))  # type: ignore[union-attr]
            await reader.readexactly(length)
            latencies.append(time.perf_counter() - started)
            if not head.startswith(b"HTTP/1.1 200"):
                failures.append(1)
    finally:
        writer.close()


def _load_process(port: int, connections: int, seconds: float, results: multiprocessing.Queue) -> None:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    request = (f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(BODY)}\r\n\r\n").encode() + BODY
    latencies: list[float] = []
    failures: list[int] = []

    async def drive() -> float:
        started = time.perf_counter()
        await asyncio.gather(*(_connection(port, request, started + seconds, latencies, failures)
                               for _ in range(connections)))
        return time.perf_counter() - started

    elapsed = asyncio.run(drive())
    results.put((latencies, len(failures), elapsed))


def python_load(port: int, connections: int, processes: int, seconds: float) -> dict[str, float]:
    processes = min(processes, connections)
    shares = [connections // processes + (index < connections % processes) for index in range(processes)]
    results: multiprocessing.Queue = multiprocessing.Queue()
    workers = [multiprocessing.Process(target=_load_process, args=(port, share, seconds, results)) for share in shares]
    for worker in workers:
        worker.start()
    gathered = [results.get(timeout=seconds + 120) for _ in workers]
    for worker in workers:
        worker.join()
    latencies = sorted(latency for part, _, _ in gathered for latency in part)
    return {"requests": len(latencies), "rate": sum(len(part) / elapsed for part, _, elapsed in gathered),
            "p50": 1e3 * latencies[len(latencies) // 2], "p99": 1e3 * latencies[int(len(latencies) * 0.99)],
            "failed": sum(failed for _, failed, _ in gathered)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fronts", type=int, nargs="+", default=[1, 2, 4], help="front processes per run")
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 64], help="keep-alive connections")
    parser.add_argument("--seconds", type=float, default=6.0, help="seconds of load per cell")
    parser.add_argument("--load", choices=("wrk", "python"), help="the load generator (default: wrk if found)")
    parser.add_argument("--wrk", default=shutil.which("wrk"), help="the wrk binary (default: the one on PATH)")
    parser.add_argument("--threads", type=int, default=1, help="wrk's threads")
    parser.add_argument("--load-processes", type=int, default=max(1, (os.cpu_count() or 2) // 4),
                        help="the python load's processes")
    args = parser.parse_args()
    use_wrk = (args.load or ("wrk" if args.wrk else "python")) == "wrk"
    if use_wrk and not args.wrk:
        raise SystemExit("wrk is not on PATH: install it (apt-get install wrk), give --wrk PATH, or use --load python")

    def load(port: int, connections: int, seconds: float) -> dict[str, float]:
        if use_wrk:
            return wrk_load(args.wrk, port, connections, args.threads, seconds)
        return python_load(port, connections, args.load_processes, seconds)

    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start; load: "
          f"{f'wrk ({args.threads} threads)' if use_wrk else f'python ({args.load_processes} processes)'}, "
          f"{args.seconds:g} s per cell, one JSON row of 16 floats to examples/mlp.py:serving", flush=True)
    rows: list[list[str]] = []
    baseline: dict[int, float] = {}
    reference: bytes | None = None
    logs = Path(tempfile.mkdtemp(prefix="jitserve-bench-workers-"))
    for fronts in [None, *args.fronts]:
        server = Server(fronts, logs / f"server-{fronts or 0}.log")
        try:
            reference = reference or server.answer
            assert server.answer == reference, f"{server.name} answered {server.answer!r}, one process {reference!r}"
            for connections in args.connections:
                load(server.port, connections, 1.0)  # warm-up
                cpu = server.cpu_seconds()
                measured = load(server.port, connections, args.seconds)
                per_request = (server.cpu_seconds() - cpu) / max(measured["requests"], 1)
                baseline.setdefault(connections, measured["rate"])
                rows.append([server.name, str(connections), f"{measured['rate']:,.0f}", f"{measured['p50']:.2f}",
                             f"{measured['p99']:.2f}", str(int(measured["failed"])), f"{per_request * 1e6:,.0f}",
                             f"{measured['rate'] / baseline[connections]:.2f}x"])
                print(f"  {server.name}, {connections} connections: {measured['rate']:,.0f} requests/s", flush=True)
        finally:
            server.stop()
    header = ["server", "connections", "requests/s", "p50 ms", "p99 ms", "not 200", "server CPU us/request",
              "vs one process"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
