"""Reloading a model while it serves: a model repository's reload against restarting the server.

One model, ``weighted`` (x @ w + b, with ``--side`` x ``--side`` float32 weights from a file beside its
``model.py``), served by ``jitserve serve --model-repository DIR --model-control-mode explicit``, called
by 8 tritonclient callers throughout. Timed, each ``--repeat`` times:

- a weights-only reload: new weights file, ``load_model`` (model.py unchanged: nothing compiles);
- a full reload: model.py changed, ``load_model`` (a new server is warmed up beside the old one);
- the baseline, what a server without a repository offers: SIGTERM, start it again, until it answers.

Printed: the median seconds until the new model answers, the requests that failed meanwhile, and the
ratio of the restart's time to each reload's.

    python3 dev.py bench reload
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from jitserve.params import save_params

MODEL = """
from pathlib import Path

import jitserve as js

def affine(params, x):
    return x @ params["w"] + params["b"] + {offset}

serving = js.Serving(affine, params=str(Path(__file__).parent / "weights.safetensors"), batch_size=8,
                     batch_timeout=0.002, input_template=js.template(({side},), "float32"))
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Served:
    """A ``jitserve serve --model-repository`` process and its callers."""

    def __init__(self, repository: Path, side: int) -> None:
        self.repository, self.side = repository, side
        self.port = free_port()
        self.process = self.start()
        self.answers: list[float] = []
        self.failures = 0
        self.stop_calling = threading.Event()
        self.callers = [threading.Thread(target=self.call, daemon=True) for _ in range(8)]
        for caller in self.callers:
            caller.start()

    def start(self) -> subprocess.Popen[bytes]:
        process = subprocess.Popen([sys.executable, "-m", "jitserve", "serve", f"--model-repository={self.repository}",
                                    "--model-control-mode", "explicit", "--load-model", "weighted", "--no-grpc",
                                    "--port", str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.wait_answering()
        return process

    def infer(self, client: httpclient.InferenceServerClient) -> float:
        tensor = httpclient.InferInput("input", [1, self.side], "FP32")
        tensor.set_data_from_numpy(np.ones((1, self.side), np.float32))
        return float(client.infer("weighted", [tensor]).as_numpy("output")[0, 0])

    def wait_answering(self, value: float | None = None) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                answer = self.infer(httpclient.InferenceServerClient(f"127.0.0.1:{self.port}"))
                if value is None or answer == value:
                    return
            except Exception:  # not up yet
                time.sleep(0.05)
        raise TimeoutError("the server did not answer within 300 s")

    def call(self) -> None:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{self.port}")
        while not self.stop_calling.is_set():
            try:
                self.answers.append(self.infer(client))
            except Exception:  # what the bench counts
                self.failures += 1
                time.sleep(0.01)
                client = httpclient.InferenceServerClient(f"127.0.0.1:{self.port}")

    def load(self) -> None:
        httpclient.InferenceServerClient(f"127.0.0.1:{self.port}", network_timeout=600).load_model("weighted")

    def restart(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(120)
        self.process = self.start()

    def close(self) -> None:
        self.stop_calling.set()
        for caller in self.callers:
            caller.join(30)
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(120)


def weights(side: int, scale: float) -> dict[str, np.ndarray]:
    return {"w": np.eye(side, dtype=np.float32) * scale, "b": np.zeros(side, np.float32)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=2048, help="weights are side x side float32 (default 16 MB)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = Path(folder) / "weighted"
        model.mkdir()
        save_params(model / "weights.safetensors", weights(args.side, 1.0))
        (model / "model.py").write_text(MODEL.format(offset=0.0, side=args.side))
        served = Served(Path(folder), args.side)
        times: dict[str, list[float]] = {"weights-only reload": [], "full reload": [], "restart (baseline)": []}
        failed: dict[str, int] = dict.fromkeys(times, 0)
        scale, offset = 1.0, 0.0
        try:
            for round_ in range(1, args.repeat + 1):
                for kind in times:
                    before = served.failures
                    started = time.monotonic()
                    if kind == "weights-only reload":
                        scale = 1.0 + round_
                        save_params(model / "weights.safetensors", weights(args.side, scale))
                        served.load()
                    elif kind == "full reload":
                        offset = 100.0 * round_
                        (model / "model.py").write_text(MODEL.format(offset=offset, side=args.side))
                        served.load()
                    else:
                        served.restart()
                    served.wait_answering(scale + offset)
                    times[kind].append(time.monotonic() - started)
                    failed[kind] += served.failures - before
        finally:
            served.close()
    print(f"{os.cpu_count()} CPUs, {args.side}x{args.side} float32 weights ({args.side * args.side * 4 / 2**20:.0f} "
          f"MB), 8 callers throughout, median of {args.repeat}")
    baseline = statistics.median(times["restart (baseline)"])
    print("| change | seconds until the new model answers | failed requests | restart / this |")
    print("|---|---|---|---|")
    for kind, seconds in times.items():
        median = statistics.median(seconds)
        print(f"| {kind} | {median:.2f} | {failed[kind]} | {baseline / median:.1f}x |")
    print(f"answered {len(served.answers):,} requests in all")


if __name__ == "__main__":
    main()
