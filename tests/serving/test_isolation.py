"""isolation="process": a native crash in a worker process fails only its batch; the server keeps serving."""

from __future__ import annotations

import ctypes
import threading

import jax
import numpy as np
import pytest

import jitserve as js
from jitserve import compilers


class Crashing(js.Compiler):
    """Runs functions with numpy; a negative input crashes the process natively (SIGSEGV)."""

    name = "crashing-in-process-test"

    def compile(self, fn, templates, options):
        leaves, tree = compilers.base.flat_templates(templates)

        def run(x):
            if (np.asarray(x) < 0).any():
                ctypes.string_at(0)
            return np.asarray(fn(x))

        return js.Executable(run, leaves, tree, None)

    def devices(self):
        return []


@pytest.fixture(scope="module")
def crashing():
    js.register_compiler(Crashing.name, Crashing(), replace=True)
    yield Crashing.name
    compilers.COMPILERS.pop(Crashing.name, None)
    compilers._instances.pop(Crashing.name, None)


def row(value):
    return js.Batch.stack([np.full(2, value, np.float32)])


def test_a_crash_fails_only_its_batch_and_a_new_worker_takes_over(crashing):
    serving = js.Serving(lambda x: x + 1, batch_size=4, batch_timeout=0.05, compiler=crashing, isolation="process",
                         input_template=js.template((2,), "float32"))
    with js.serve(serving, name="isolated") as server:
        assert js.batched_run("isolated", row(1.0)).tolist() == [[2.0, 2.0]]
        results = {}

        def call(key, value):
            try:
                results[key] = js.batched_run("isolated", row(value)).tolist()
            except js.WorkerCrashedError as error:
                results[key] = error

        threads = [threading.Thread(target=call, args=(k, v)) for k, v in [("bad", -1.0), ("neighbour", 5.0)]]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # the two rows shared a batch (50 ms window): both failed with the crash, nothing hung
        assert isinstance(results["bad"], js.WorkerCrashedError)
        assert "the worker process of server 'isolated' partition 0 was killed by SIGSEGV while running a batch of" \
               in str(results["bad"])
        assert "only this batch failed" in str(results["bad"])
        assert js.batched_run("isolated", row(3.0)).tolist() == [[4.0, 4.0]]
        stats = server.stats()
        assert stats.errors >= 1 and stats.compiles == len(serving.batch_sizes), "a restart recompiles silently"
    assert serving.isolation == "process"


def test_isolation_defaults_to_the_compilers_choice_and_is_checked():
    assert js.Serving(lambda x: x, compiler="xla").isolation == "thread"
    with pytest.raises(js.OptionError, match="isolation must be one of thread, process, got 'fork'"):
        js.Serving(lambda x: x, isolation="fork")


def test_model_errors_in_the_worker_reach_the_caller_unchanged():
    def fragile(x):
        if (x < 0).any():
            raise ValueError("negative input")
        return x

    serving = js.Serving(fragile, batch_size=2, batch_timeout=0.001, compiler="eager", isolation="process",
                         input_template=js.template((2,), "float32"))
    with js.serve(serving, name="isolated-fragile"):
        with pytest.raises(ValueError, match="negative input"):
            js.batched_run("isolated-fragile", row(-1.0))
        assert js.batched_run("isolated-fragile", row(2.0)).tolist() == [[2.0, 2.0]]


def test_a_worker_process_runs_xla_cpu_computations_inline():
    def dispatch(x):  # 1 where JAX dispatches CPU computations to its own thread, 0 where they run inline
        return x * 0 + float(jax.config.values["jax_cpu_enable_async_dispatch"])

    serving = js.Serving(dispatch, batch_size=2, batch_timeout=0.001, isolation="process",
                         input_template=js.template((1,), "float32"))
    with js.serve(serving, name="isolated-dispatch"):
        assert js.batched_run("isolated-dispatch", js.Batch.stack([np.array([5.0], np.float32)])).tolist() == [[0.0]]
    assert jax.config.values["jax_cpu_enable_async_dispatch"], "the server's own process keeps JAX's default"
