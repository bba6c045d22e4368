"""What ``isolation="process"`` costs: a served batch through a worker process against the same batch in
the server's process, on the MLP of bench/serving.py (256 -> 1024 -> 256), one caller, 1 and 64 rows.

Process isolation keeps a native crash from taking the server down (only that batch fails); it adds
a round trip through a socket pair and a pickle of the batch each way. Prints p50 per request and the
ratio; it is the figure behind the default (``thread`` for every compiler).

    python3 dev.py bench isolation
"""

from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np

import jitserve as js


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--compilers", nargs="+", default=["xla", "iree"])
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((256, 1024)).astype(np.float32) * 0.05
    w2 = rng.standard_normal((1024, 256)).astype(np.float32) * 0.05

    def mlp(x):
        return jnp.tanh(x @ w1) @ w2

    print("| compiler | rows | thread p50 (us) | process p50 (us) | process / thread |")
    print("|---|---|---|---|---|")
    for compiler in args.compilers:
        p50 = {}
        for isolation in ("thread", "process"):
            serving = js.Serving(mlp, batch_size=64, batch_timeout=0.0, compiler=compiler, isolation=isolation,
                                 input_template=js.template((256,), "float32"))
            with js.serve(serving, name="isolation"):
                for rows in (1, 64):
                    batch = js.Batch.concatenate([rng.standard_normal((rows, 256)).astype(np.float32)])
                    for _ in range(20):
                        js.batched_run("isolation", batch)
                    times = []
                    for _ in range(args.requests):
                        started = time.perf_counter()
                        js.batched_run("isolation", batch)
                        times.append(time.perf_counter() - started)
                    p50[(isolation, rows)] = float(np.median(times)) * 1e6
        for rows in (1, 64):
            thread, process = p50[("thread", rows)], p50[("process", rows)]
            print(f"| {compiler} | {rows} | {thread:.0f} | {process:.0f} | {process / thread:.2f}x |")


if __name__ == "__main__":
    main()
