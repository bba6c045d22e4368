"""A second driver process: connects to the cluster, runs CALLERS threads of random 1-4 row requests on
NAME for SECONDS, checks every answer, prints one JSON line of counts."""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np
import ray

import jitserve as js


def main(address: str, name: str, callers: int, seconds: float) -> None:
    ray.init(address=address, log_to_driver=False)
    counts = {"requests": 0, "rows": 0, "wrong": 0, "errors": []}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def caller(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while time.monotonic() < deadline:
            x = rng.uniform(size=(int(rng.integers(1, 5)), 4)).astype(np.float32)
            try:
                out = js.batched_run(name, js.Batch.concatenate([x]), timeout=30)
            except Exception as error:
                with lock:
                    counts["errors"].append(f"{type(error).__name__}: {error}")
                continue
            with lock:
                counts["requests"] += 1
                counts["rows"] += len(x)
                counts["wrong"] += not np.array_equal(out, x * 2 + 1)

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
