"""perf_analyzer, Triton's own benchmark (no one here wrote it), against ``jitserve serve``: over HTTP and
gRPC, synchronous and asynchronous calls, with its tensors in system shared memory, and gRPC's streaming
mode against a generation. Each run lasts a
few seconds (windows of a count of requests, a few tries), exits 0, and reads the server's statistics
(which it refuses unless they are counted as Triton counts them): what the server says each request spent
queued and computing lies within the latency perf_analyzer measured on its side. Loopback only.

perf_analyzer is the binary of tritonclient 2.51.0's wheel, which ``python3 dev.py test`` installs into
``.venv/perf-analyzer`` with the CUDA runtime it links (no GPU needed), and Debian's libb64-0d; without it
the tests fail, they do not skip."""

from __future__ import annotations

import csv
import re
import subprocess
from pathlib import Path

import pytest

from netutil import PERF_ANALYZER, ROOT, perf_analyzer_environment, start_server, stop

# a run: windows of at least 50 requests (at least half a second), stable once 3 windows agree within 10x
# (a shared machine's speed varies; what is checked is how the server's times add up, not how fast it is)
BOUNDED = ["--measurement-mode", "count_windows", "--measurement-request-count", "50", "-p", "500",
           "--max-trials", "6", "-s", "1000"]
SERVER_PHASES = ("Server Queue", "Server Compute Input", "Server Compute Infer", "Server Compute Output")


@pytest.fixture(scope="module")
def mlp():
    running = start_server(str(ROOT / "examples/mlp.py") + ":serving", "--allow-client-shm")
    yield running
    stop(running)


@pytest.fixture(scope="module")
def writer():
    """The smallest of the examples' generations: GPT-2's layout, two layers of 64 (text in, text out)."""
    running = start_server(str(ROOT / "examples/gpt2.py") + ":generation")
    yield running
    stop(running)


def perf_analyzer(tmp_path: Path, *arguments: str) -> tuple[str, dict[str, str]]:
    """Run perf_analyzer with ``arguments``: its output, once it exited 0, and its CSV report's row."""
    environment = perf_analyzer_environment()
    report = tmp_path / "report.csv"
    done = subprocess.run([str(PERF_ANALYZER / "bin" / "perf_analyzer"), *arguments, *BOUNDED, "-f", str(report),
                           "--verbose-csv"], capture_output=True, text=True, timeout=300, env=environment)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    rows = list(csv.DictReader(report.open()))
    assert len(rows) == 1, output
    return output, rows[0]


def assert_server_side_within_client_latency(output: str, row: dict[str, str]) -> None:
    """perf_analyzer read the server's statistics (it reports the server's requests and their phases only
    from them), and the server's queue and compute per request (microseconds) fit in the client's."""
    completed = re.search(r"Server: \n\s+Inference count: (\d+)\n\s+Execution count: (\d+)\n"
                          r"\s+Successful request count: (\d+)", output)
    assert completed and min(int(count) for count in completed.groups()) > 0, output
    assert "Avg request latency" in output, output
    server_side = sum(int(row[phase]) for phase in SERVER_PHASES)
    assert int(row["Server Compute Infer"]) > 0, row
    assert server_side <= int(row["Avg latency"]), (row, output)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_perf_analyzer_measures_a_serving(mlp, tmp_path, protocol, mode):
    port = mlp.grpc_port if protocol == "grpc" else mlp.port
    calls = ["--sync"] if mode == "sync" else ["--async", "--concurrency-range", "4"]
    output, row = perf_analyzer(tmp_path, "-m", "mlp", "-u", f"127.0.0.1:{port}", "-i", protocol, *calls)
    assert_server_side_within_client_latency(output, row)


@pytest.mark.parametrize(("protocol", "mode"), [("http", "sync"), ("grpc", "async")])
def test_perf_analyzer_measures_a_serving_through_system_shared_memory(mlp, tmp_path, protocol, mode):
    port = mlp.grpc_port if protocol == "grpc" else mlp.port
    calls = ["--sync"] if mode == "sync" else ["--async", "--concurrency-range", "4"]
    output, row = perf_analyzer(tmp_path, "-m", "mlp", "-u", f"127.0.0.1:{port}", "-i", protocol, *calls,
                                "--shared-memory", "system")
    assert_server_side_within_client_latency(output, row)


def test_perf_analyzer_streams_a_generation_over_grpc(writer, tmp_path):
    prompts = tmp_path / "prompts.json"  # not its synthetic data, which fills every optional input at random
    prompts.write_text('{"data": [{"text_input": ["Once upon a time"]}]}')
    output, row = perf_analyzer(tmp_path, "-m", "gpt2", "-u", f"127.0.0.1:{writer.grpc_port}", "-i", "grpc",
                                "--streaming", "--input-data", str(prompts), "--request-parameter", "max_tokens:8:int")
    assert "Detected decoupled model" in output, "it read the generation's config over gRPC"
    assert float(row["Response Throughput"]) > float(row["Inferences/Second"]), "several responses per request"
    assert_server_side_within_client_latency(output, row)
