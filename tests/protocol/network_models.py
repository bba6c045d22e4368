"""Models the network tests serve: ``jitserve serve tests/protocol/network_models.py:models``."""

import ctypes
import importlib.util
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from gates import gated

import jitserve as js

_spec = importlib.util.spec_from_file_location(
    "jitserve_example_mlp", Path(__file__).resolve().parents[2] / "examples" / "mlp.py")
example = importlib.util.module_from_spec(_spec)  # the bundled example (examples/ is not a package)
_spec.loader.exec_module(example)


def affine(entry):
    return {"y": entry["x"] * entry["scale"][:, None] + 1.0, "norm": jnp.sqrt(jnp.sum(entry["x"] ** 2, axis=-1))}


def fragile(x):
    if (x < 0).any():
        raise ValueError("negative input")
    return x


TABLE = np.arange(40, dtype=np.float32).reshape(10, 4)  # the embedding table "lookup" serves with IREE


def lookup(ids):
    return jnp.asarray(TABLE)[ids]


class CrashingCompiler(js.Compiler):
    """Runs functions as they are, except that a negative input crashes the process natively (SIGSEGV)."""

    name = "crashing"

    def compile(self, fn, templates, options):
        leaves, tree = js.compilers.base.flat_templates(templates)

        def run(x):
            if (np.asarray(x) < 0).any():
                ctypes.string_at(0)  # reads address 0: a segmentation fault
            return np.asarray(fn(x))

        return js.Executable(run, leaves, tree, None)

    def output_shapes(self, fn, templates):
        return js.compilers.get("eager").output_shapes(fn, templates)

    def devices(self):
        return []


js.register_compiler("crashing", CrashingCompiler(), replace=True)


CALLS = iter(range(10**9))  # the order in which "ordered" runs its batches


def ordered(x):
    gated("ordered")
    return np.concatenate([x, np.full_like(x, next(CALLS))], axis=1)


def chunked(x):
    gated("chunked")
    time.sleep(0.1)
    return x * 2


def steps(x):
    for step in range(3):
        yield x + step


def slow(x):
    gated("slow")
    return x + 1


def dispatch(x):
    """1 where XLA's CPU computations are dispatched to its own thread in the serving process, 0 where they run
    inline on the partition (what ``jitserve serve`` sets before loading this file), as JAX says at the trace."""
    return x * 0 + float(jax.config.values["jax_cpu_enable_async_dispatch"])


def letters(texts):
    """preprocess: texts (a BYTES tensor over the network, a list in process) -> (a batch of their lengths,
    the texts in capitals as info for postprocess)."""
    texts = [t if isinstance(t, bytes) else t.encode() for t in np.asarray(texts, dtype=object).reshape(-1)]
    if not texts:
        raise js.BatchError("send at least one text")
    return js.Batch.concatenate([np.array([[len(t)] for t in texts], np.float32)]), [t.upper() for t in texts]


def shout(result, info):
    """postprocess with info: ((outputs, batch reports), info) -> text out, numbers out."""
    outputs, reports = result
    return {"text": np.array([t + b"!" for t in info], dtype=object), "doubled": outputs,
            "batches": np.full(len(info), len(reports), np.int32)}


text_serving = js.Serving(lambda x: x * 2, batch_size=4, batch_timeout=0.001, preprocess=letters, postprocess=shout,
                          input_template=js.template((1,), "float32"))

models = {
    "mlp": example.serving,
    "affine": js.Serving(affine, batch_size=8, batch_timeout=0.002,
                         input_template={"x": js.template((4,), "float32"), "scale": js.template((), "float32")}),
    "ints": js.Serving(lambda x: x * 2, batch_size=4, batch_timeout=0.002, input_template=js.template((3,), "int32")),
    "fragile": js.Serving(fragile, batch_size=4, batch_timeout=0.001, compiler="eager",
                          input_template=js.template((2,), "float32")),
    "slow": js.Serving(slow, batch_size=1, batch_timeout=0, max_queue=1, compiler="eager",
                       input_template=js.template((1,), "float32")),
    "lookup": js.Serving(lookup, batch_size=4, batch_timeout=0.001, compiler="iree",
                         input_template=js.template((3,), "int32")),
    "crashing": js.Serving(lambda x: x * 2, batch_size=2, batch_timeout=0.001, compiler="crashing",
                           isolation="process", input_template=js.template((2,), "float32")),
    "ordered": js.Serving(ordered, batch_size=1, batch_timeout=0, compiler="eager", priority_levels=2,
                          input_template=js.template((1,), "float32")),
    "chunked": js.Serving(chunked, batch_size=2, batch_timeout=0.001, compiler="eager",
                          input_template=js.template((1,), "float32")),
    "steps": js.Serving(steps, batch_size=2, batch_timeout=0.001, streaming=True,
                        input_template=js.template((1,), "float32")),
    "wide": js.Serving(lambda x: x + 1, batch_size=2, batch_timeout=0.001, input_template=js.template((3,), "int64")),
    "versioned": {version: js.Serving(lambda x, step=float(version): x + step, batch_size=2, batch_timeout=0.001,
                                      input_template=js.template((1,), "float32")) for version in ("1", "2")},
    "reciprocal": js.Serving(lambda x: 1.0 / x, batch_size=2, batch_timeout=0.001,
                             input_template=js.template((2,), "float32")),
    "dispatch": js.Serving(dispatch, batch_size=2, batch_timeout=0.001, input_template=js.template((1,), "float32")),
    "text": text_serving,
}
