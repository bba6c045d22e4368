"""Models tests/protocol/test_workers.py serves with ``jitserve serve --http-workers N``:
``jitserve serve tests/protocol/worker_models.py:models``.

The gated models hold each batch while the file ``$JITSERVE_TEST_HOLD`` exists (so that a test knows which
requests wait in the engine, without timing), then write the batch's rows as one line of
``$JITSERVE_TEST_BATCHES-NAME`` (so that a test reads which rows ran together: the engine's own record of
its batches) and double them.
"""

import os
import time

import numpy as np

import jitserve as js

HOLD = os.environ.get("JITSERVE_TEST_HOLD", "")
BATCHES = os.environ.get("JITSERVE_TEST_BATCHES", "")


def gated(name):
    def run(x):
        while HOLD and os.path.exists(HOLD):
            time.sleep(0.002)
        if BATCHES:
            with open(f"{BATCHES}-{name}", "a") as log:
                log.write(" ".join(f"{value:g}" for value in x[:, 0]) + "\n")
        return x * 2
    return run


def picky(x):
    """A model's own failure for a negative row (500), its own answer for 422 (a ModelError)."""
    if (x == 422).any():
        raise js.ModelError("422 is not a row this model takes", status=422)
    if (x < 0).any():
        raise ValueError("negative rows")
    return x + 1


def lengths(texts):
    """preprocess: texts (BYTES) -> (their lengths, the texts as info)."""
    texts = list(np.asarray(texts, dtype=object).reshape(-1))
    return js.Batch.concatenate([np.array([[len(t)] for t in texts], np.float32)]), texts


def shout(result, info):
    """postprocess: text out (BYTES), numbers out."""
    outputs, _ = result
    return {"text": np.array([t.upper() + b"!" for t in info], dtype=object), "length": outputs}


def steps(x):
    for step in range(3):
        yield x + step


def row(size):
    return js.template((size,), "float32")


models = {
    "double": js.Serving(lambda x: x * 2.0, batch_size=16, batch_timeout=0.002, input_template=row(4)),
    "gated": js.Serving(gated("gated"), batch_size=8, batch_sizes=list(range(1, 9)), batch_timeout=0.001,
                        compiler="eager", input_template=row(1)),
    "gated1": js.Serving(gated("gated1"), batch_size=1, batch_timeout=0, compiler="eager", input_template=row(1)),
    "picky": js.Serving(picky, batch_size=4, batch_timeout=0.001, compiler="eager", input_template=row(1)),
    "steps": js.Serving(steps, batch_size=2, batch_timeout=0.001, streaming=True, input_template=row(1)),
    "text": js.Serving(lambda x: x, batch_size=4, batch_timeout=0.001, preprocess=lengths, postprocess=shout,
                       input_template=row(1)),
}
