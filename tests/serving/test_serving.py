"""Serving and the in-process server: seeds 000 and 003, concurrency, faults, bounds, timeouts, async."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jitserve as js
from jitserve import compilers
from jitserve.compilers.xla import XlaCompiler
from waiting import HANG_S, until


def double(x):
    return x * 2


# Nx.Serving batch size ----------------------------------------------------------------------

def test_seed_000_batch_size_1():
    serving_1 = js.Serving(double, oversize="error")
    batch = js.Batch.stack([np.array([1])])
    assert repr(batch).startswith("#Batch<size: 1, pad: 0")
    assert serving_1.run(batch).tolist() == [[2]]
    with js.serve(serving_1, name="BatchSize1"):
        assert js.batched_run("BatchSize1", batch).tolist() == [[2]]
        two = js.Batch.stack([np.array([1]), np.array([2])])
        assert two.size == 2
        assert serving_1.run(two).tolist() == [[2], [4]], "run takes any size"
        with pytest.raises(js.BatchSizeError) as info:
            js.batched_run("BatchSize1", two)
        assert str(info.value) == "batch size (2) cannot exceed server batch size of 1"


def test_seed_000_batch_size_2():
    serving_2 = js.Serving(double, batch_size=2, oversize="error")
    two = js.Batch.stack([np.array([1]), np.array([2])])
    assert serving_2.run(two).tolist() == [[2], [4]]
    with js.serve(serving_2, name="BatchSize2"):
        assert js.batched_run("BatchSize2", two).tolist() == [[2], [4]]
        assert js.batched_run("BatchSize2", js.Batch.stack([np.array([1])])).tolist() == [[2]]
        three = js.Batch.stack([np.array([1]), np.array([2]), np.array([3])])
        with pytest.raises(js.BatchSizeError, match=r"^batch size \(3\) cannot exceed server batch size of 2$"):
            js.batched_run("BatchSize2", three)
    serving_3 = js.Serving(double, batch_size=3, oversize="error")
    with js.serve(serving_3, name="BatchSize3"):
        assert js.batched_run("BatchSize3", two).tolist() == [[2], [4]]


def test_oversize_split_is_the_default():
    with js.serve(js.Serving(double, batch_size=2), name="split") as server:
        rows = js.Batch.stack([np.array([k]) for k in range(5)])
        assert js.batched_run("split", rows).tolist() == [[0], [2], [4], [6], [8]]
        assert server.stats().rows == 5


# PopRT dynamic batch ------------------------------------------------------------------------

def test_seed_003_static_batch_4_serves_1_4_7_with_one_compile():
    def add(entry):
        return entry["X"] + entry["Y"]

    serving = js.Serving(add, batch_size=4, batch_sizes=[4], batch_timeout=0.0003)
    rng = np.random.default_rng(3)
    with js.serve(serving, name="poprt") as server:
        for batch_size in [1, 4, 7]:
            x = rng.uniform(0, 1, [batch_size, 2]).astype(np.float32)
            y = rng.uniform(0, 1, [batch_size, 2]).astype(np.float32)
            out = js.batched_run("poprt", js.Batch.concatenate([{"X": x, "Y": y}]))
            np.testing.assert_array_equal(out, x + y)
        stats = server.stats()
    assert stats.compiles == 1
    assert stats.padded_rows == 3 + 0 + 1
    assert stats.batch_sizes == {4: 4}
    assert stats.rows == 12


def test_seed_003_inline_run_pads_and_loops():
    serving = js.Serving(lambda e: e[0] + e[1], batch_size=4, batch_sizes=[4])
    x = np.arange(14, dtype=np.float32).reshape(7, 2)
    np.testing.assert_array_equal(serving.run(js.Batch.concatenate([(x, x)])), 2 * x)


# static shapes, warm-up, compilers -----------------------------------------------------------

def test_default_batch_sizes_are_powers_of_two_up_to_batch_size():
    assert js.Serving(double, batch_size=6).batch_sizes == [1, 2, 4, 6]
    assert js.Serving(double, batch_size=8).batch_sizes == [1, 2, 4, 8]
    assert js.Serving(double, batch_size=1).batch_sizes == [1]
    with pytest.raises(js.OptionError, match=r"batch_sizes must be positive and end at batch_size \(4\)"):
        js.Serving(double, batch_size=4, batch_sizes=[2])


BAD_OPTIONS = [
    ({"fn": 5}, "a Serving needs a function to serve, got int 5"),
    ({"batch_size": True}, "batch_size must be a positive integer, got True"),
    ({"batch_size": 4.0}, "batch_size must be a positive integer, got 4.0"),
    ({"batch_size": 4, "batch_sizes": [2, "4"]}, "each of batch_sizes [2, '4'] must be a positive integer, got '4'"),
    ({"batch_size": 4, "batch_sizes": [0, 4]}, "each of batch_sizes [0, 4] must be a positive integer, got 0"),
    ({"batch_timeout": float("nan")}, "batch_timeout must be a finite number of seconds >= 0, got nan"),
    ({"batch_timeout": float("inf")}, "batch_timeout must be a finite number of seconds >= 0, got inf"),
    ({"batch_timeout": -1}, "batch_timeout must be a finite number of seconds >= 0, got -1"),
    ({"batch_timeout": "0.1"}, "batch_timeout must be a finite number of seconds >= 0, got '0.1'"),
    ({"partitions": True}, "partitions must be a positive integer, got True"),
    ({"max_queue": 2.5}, "max_queue must be a positive integer or None, got 2.5"),
    ({"max_queue": 0}, "max_queue must be a positive integer or None, got 0"),
    ({"priority_levels": 0}, "priority_levels must be a positive integer, got 0"),
    ({"priority_aging": 0}, "priority_aging must be a finite number of seconds > 0, got 0"),
    ({"priority_aging": float("nan")}, "priority_aging must be a finite number of seconds > 0, got nan"),
    ({"priority_levels": 2, "priority_queues": {1: {"timeout": -5}}},
     "priority_queues[1]['timeout'] must be a finite number of seconds >= 0 or None, got -5"),
    ({"priority_levels": 2, "priority_queues": {2: {"max_queue": "8"}}},
     "priority_queues[2]['max_queue'] must be a positive integer or None, got '8'"),
]


@pytest.mark.parametrize(("options", "message"), BAD_OPTIONS)
def test_bad_serving_options_are_refused_by_name(options, message):
    options = {"fn": double, **options}
    with pytest.raises(js.OptionError) as info:
        js.Serving(options.pop("fn"), **options)
    assert str(info.value) == message


@pytest.mark.parametrize("timeout", [-1, -0.5, float("nan"), float("inf"), "1"])
def test_a_bad_timeout_is_refused_before_the_request_is_queued(timeout):
    serving = js.Serving(double, batch_size=4, batch_timeout=0.001)
    with js.serve(serving, name="timeouts") as server:
        with pytest.raises(js.OptionError, match=r"^timeout must be a finite number of seconds >= 0 or None, got "):
            js.batched_run("timeouts", js.Batch.concatenate([np.ones((1, 2), np.float32)]), timeout=timeout)
        with pytest.raises(js.OptionError, match=r"^timeout must be a finite number of seconds >= 0 or None, got "):
            server.stop(timeout=timeout)
        assert server.stats().requests == 0
        assert js.batched_run("timeouts", js.Batch.concatenate([np.ones((1, 2), np.float32)]), timeout=0.5
                              ).tolist() == [[2.0, 2.0]]


def test_rows_to_take_cuts_down_rather_than_pad_a_lot():
    serving = js.Serving(double, batch_size=64)
    assert [serving.policy.rows_to_take(n) for n in [1, 2, 3, 5, 33, 40, 47, 48, 60, 64, 100]] == \
        [1, 2, 3, 4, 32, 32, 32, 48, 60, 64, 64]
    poprt = js.Serving(double, batch_size=4, batch_sizes=[4])
    assert [poprt.policy.rows_to_take(n) for n in [1, 3, 4, 9]] == [1, 3, 4, 4], "no smaller size: pad"


def test_a_queue_of_33_rows_runs_as_32_and_1_without_padding():
    serving = js.Serving(double, batch_size=64, batch_timeout=0.001)
    with js.serve(serving, name="cut-down") as server:
        rows = np.arange(33).reshape(33, 1)
        assert js.batched_run("cut-down", js.Batch.concatenate([rows])).tolist() == (rows * 2).tolist()
        stats = server.stats()
    assert stats.batch_sizes == {32: 1, 1: 1} and stats.padded_rows == 0


def test_warm_up_compiles_every_size_then_no_request_compiles():
    serving = js.Serving(lambda x: jnp.tanh(x), batch_size=8, batch_timeout=0.001,
                         input_template=js.template((3,), "float32"))
    with js.serve(serving, name="warm") as server:
        assert server.stats().compiles == 4, "1, 2, 4 and 8 compiled before the first request"
        for rows in [1, 3, 5, 8, 13]:
            x = np.ones((rows, 3), np.float32)
            np.testing.assert_allclose(js.batched_run("warm", js.Batch.concatenate([x])), np.tanh(x), rtol=1e-6)
        assert server.stats().compiles == 4


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_warm_up_runs_every_size_once_where_a_first_run_costs_extra(monkeypatch, tmp_path, isolation):
    """A GPU loads a program's kernels on its first run: there warm-up runs each batch size once on zeros,
    with the serving's weights and under each batch key, outside the stats. On this CPU nothing runs (XLA
    says so); CI has no GPU, so the compiler's answer for one is stood in."""
    log = tmp_path / "runs"

    def model(params, key, x):
        def seen(rows, scaled):
            with open(log, "a") as file:  # the runs happen in a worker process under process isolation
                file.write(f"{key} {rows.shape[0]} {float(rows.sum())} {float(scaled.sum())}\n")
        jax.debug.callback(seen, x, x * params["scale"] + params["scale"])
        return x * params["scale"]

    serving = js.Serving(model, params={"scale": np.float32(3)}, batch_size=4, batch_keys=["a", "b"],
                         input_template=js.template((2,), "float32"), isolation=isolation)
    with js.serve(serving, name="warm-default"):
        assert log.exists() == compilers.get("xla").first_run_costs({})
    log.unlink(missing_ok=True)
    monkeypatch.setattr(XlaCompiler, "first_run_costs", lambda self, options: True)
    with js.serve(serving, name="warm-run") as server:
        ran = sorted(log.read_text().splitlines())
        stats = server.stats()
        assert stats.batches == 0 and stats.compiles == 6
        assert js.batched_run("warm-run", js.Batch.stack([np.ones(2, np.float32)]).key("b")).tolist() == [[3, 3]]
    assert ran == [f"{key} {size} 0.0 {6.0 * size}" for key in "ab" for size in (1, 2, 4)]  # the weights: 3


@pytest.mark.parametrize("compiler", ["xla", "evaluator", "eager"])
def test_compilers_by_name(compiler):
    fn = (lambda x: np.sqrt(x) + 1) if compiler == "eager" else (lambda x: jnp.sqrt(x) + 1)
    serving = js.Serving(fn, batch_size=4, batch_timeout=0.001, compiler=compiler)
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    with js.serve(serving, name=f"c-{compiler}") as server:
        np.testing.assert_allclose(js.batched_run(f"c-{compiler}", js.Batch.concatenate([x])), np.sqrt(x) + 1,
                                   rtol=1e-6)
        assert server.stats().compiles == (0 if compiler == "eager" else 1)


def test_tuple_and_dict_outputs_are_cut_per_caller():
    serving = js.Serving(lambda e: {"sum": e[0] + e[1], "both": (e[0], e[1] * 10)}, batch_size=8, batch_timeout=0.05)
    with js.serve(serving, name="pytree"):
        results = {}

        def call(k):
            results[k] = js.batched_run("pytree", js.Batch.stack([(np.float32(k), np.float32(1))]))

        threads = [threading.Thread(target=call, args=(k,)) for k in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for k, out in results.items():
        assert out["sum"].tolist() == [k + 1] and out["both"][0].tolist() == [k] and out["both"][1].tolist() == [10]


def test_outputs_that_are_views_of_the_reused_input_buffer_do_not_change_when_the_next_batch_runs():
    """A partition writes every batch of a compiled function into the same input buffer; the evaluator may
    return a view of its input, which is copied before it reaches the caller."""
    serving = js.Serving(lambda x: x[:, ::-1], batch_size=4, batch_sizes=[4], compiler="evaluator",
                         input_template=js.template((3,), "float32"))
    with js.serve(serving, name="views"):
        first = js.batched_run("views", js.Batch.stack([np.array([1, 2, 3], np.float32)]))
        second = js.batched_run("views", js.Batch.concatenate([np.full((4, 3), 7, np.float32)]))
    assert first.tolist() == [[3, 2, 1]], "the first caller's rows are its own, not the buffer's next contents"
    assert second.tolist() == [[7, 7, 7]] * 4


def test_an_eager_function_gets_new_input_arrays_for_every_batch_and_may_keep_them():
    kept = []

    def keep(x):
        kept.append(x)
        return x * 2

    serving = js.Serving(keep, batch_size=4, batch_sizes=[4], compiler="eager")
    with js.serve(serving, name="keeps-inputs"):
        js.batched_run("keeps-inputs", js.Batch.stack([np.array([1, 2, 3], np.float32)]))
        js.batched_run("keeps-inputs", js.Batch.concatenate([np.full((4, 3), 7, np.float32)]))
    assert kept[0][:1].tolist() == [[1, 2, 3]] and kept[1].tolist() == [[7, 7, 7]] * 4


# concurrency ---------------------------------------------------------------------------------

def test_many_threads_random_sizes_every_result_checked():
    serving = js.Serving(lambda x: x * 3 + 1, batch_size=16, batch_timeout=0.002, partitions=2)
    failures: list[str] = []
    done = []

    def caller(seed):
        rng = random.Random(seed)
        for _ in range(15):
            rows = rng.randint(1, 40)
            x = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) + seed * 1000
            out = js.batched_run("many", js.Batch.concatenate([x]))
            if not np.array_equal(out, x * 3 + 1):
                failures.append(f"caller {seed} got wrong rows")
        done.append(seed)

    with js.serve(serving, name="many") as server:
        threads = [threading.Thread(target=caller, args=(s,)) for s in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG_S)
        stats = server.stats()
    assert not failures and sorted(done) == list(range(12))
    assert stats.requests == 12 * 15
    assert stats.errors == 0 and stats.queue_depth == 0
    assert max(stats.batch_sizes) <= 16
    assert stats.rows == sum(stats.batch_sizes[s] * s for s in stats.batch_sizes) - stats.padded_rows


def held(gate: threading.Event, **options) -> js.Serving:
    """``double`` run as written, each batch waiting for ``gate``: the rows that come meanwhile queue up,
    however fast or slow the machine."""
    def double_when_open(x):
        assert gate.wait(60), "the gate stayed shut"
        return x * 2

    return js.Serving(double_when_open, compiler="eager", **options)


def test_concurrent_callers_share_batches():
    """Rows that queue while a batch runs go together in the next: whatever the first batch took, the
    other callers' rows make one more."""
    gate = threading.Event()
    with js.serve(held(gate, batch_size=8, batch_timeout=0.2), name="share") as server:
        def call(k):
            assert js.batched_run("share", js.Batch.stack([np.array([k])])).tolist() == [[2 * k]]

        threads = [threading.Thread(target=call, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        while server.stats().requests < 8:
            time.sleep(0.001)
        gate.set()
        for t in threads:
            t.join()
        stats = server.stats()
    assert stats.batches <= 2, "rows of concurrent callers were combined"


def test_different_row_shapes_and_keys_never_share_a_batch():
    seen = []

    def record(x):
        seen.append(x.shape)
        return x

    serving = js.Serving(record, batch_size=8, batch_timeout=0.05, compiler="eager")
    with js.serve(serving, name="keys"):
        threads = [
            threading.Thread(target=js.batched_run, args=("keys", js.Batch.stack([np.ones(2)]))),
            threading.Thread(target=js.batched_run, args=("keys", js.Batch.stack([np.ones(3)]))),
            threading.Thread(target=js.batched_run, args=("keys", js.Batch.stack([np.ones(2)]).key("other"))),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(seen) == [(1, 2), (1, 2), (1, 3)]


# faults, bounds, timeouts, stop --------------------------------------------------------------

def test_failing_batch_fails_only_its_callers_and_server_keeps_serving():
    def fragile(x):
        if np.any(x < 0):
            raise ValueError("negative input")
        return x + 1

    serving = js.Serving(fragile, batch_size=4, batch_timeout=0.001, compiler="eager")
    with js.serve(serving, name="fragile") as server:
        with pytest.raises(ValueError, match="negative input"):
            js.batched_run("fragile", js.Batch.stack([np.array([-1.0])]))
        assert js.batched_run("fragile", js.Batch.stack([np.array([1.0])])).tolist() == [[2.0]]
        assert server.stats().errors == 1


def test_queue_bound_rejects_at_once():
    gate = threading.Event()

    def slow(x):
        assert gate.wait(HANG_S), "the gate stayed shut"
        return x

    serving = js.Serving(slow, batch_size=2, batch_timeout=0, max_queue=3, compiler="eager")
    with js.serve(serving, name="bounded") as server:
        first = threading.Thread(target=js.batched_run, args=("bounded", js.Batch.stack([np.ones(1)] * 2)))
        first.start()
        until(lambda: server.stats().in_flight == 1, "the first batch to run")
        queued = threading.Thread(target=js.batched_run, args=("bounded", js.Batch.stack([np.ones(1)] * 3)))
        queued.start()
        until(lambda: server.stats().queue_depth == 3, "3 rows to be queued")
        with pytest.raises(js.QueueFullError) as info:
            js.batched_run("bounded", js.Batch.stack([np.ones(1)]))
        assert str(info.value) == ("server 'bounded' queue is full: 3 rows queued, max_queue is 3; "
                                   "a request of 1 rows was rejected")
        gate.set()
        first.join(HANG_S), queued.join(HANG_S)
        assert server.stats().rejected == 1


def test_timeout_before_start_means_rows_never_run():
    gate = threading.Event()
    ran = []

    def slow(x):
        ran.append(x.copy())
        assert gate.wait(HANG_S), "the gate stayed shut"
        return x

    serving = js.Serving(slow, batch_size=1, batch_timeout=0, compiler="eager")
    with js.serve(serving, name="slow") as server:
        blocker = threading.Thread(target=js.batched_run, args=("slow", js.Batch.stack([np.array([1.0])])))
        blocker.start()
        while server.stats().in_flight == 0:
            time.sleep(0.001)
        with pytest.raises(TimeoutError, match="timed out after 0.05s before its rows started"):
            js.batched_run("slow", js.Batch.stack([np.array([99.0])]), timeout=0.05)
        gate.set()
        blocker.join(HANG_S)
        assert js.batched_run("slow", js.Batch.stack([np.array([2.0])]), timeout=HANG_S).tolist() == [[2.0]]
        stats = server.stats()
    assert [r.tolist() for r in ran] == [[[1.0]], [[2.0]]], "the timed-out rows never ran"
    assert stats.timeouts == 1


def test_stop_drains_and_refuses_new_calls():
    serving = js.Serving(double, batch_size=4, batch_timeout=5.0)
    server = js.serve(serving, name="drain")
    results = []
    caller = threading.Thread(target=lambda: results.append(js.batched_run("drain", js.Batch.stack([np.array([3])]))))
    caller.start()
    while server.stats().queue_depth == 0:
        time.sleep(0.001)
    server.stop()
    caller.join(HANG_S)
    assert results[0].tolist() == [[6]], "queued work ran although its batch timeout had not passed"
    with pytest.raises(js.UnknownServerError, match="no server named 'drain' is running"):
        js.batched_run("drain", js.Batch.stack([np.array([1])]))
    with pytest.raises(js.ServerStoppedError, match="server 'drain' is stopped and takes no new requests"):
        server.submit(js.Batch.stack([np.array([1])]))


def _blocking_serving(gate, ran):
    def blocked(x):
        ran.append(x.copy())
        assert gate.wait(HANG_S), "the gate stayed shut"
        return x * 2

    return js.Serving(blocked, batch_size=1, batch_timeout=0, compiler="eager")


def _call_in_thread(name, value, outcomes):
    def call():
        try:
            outcomes[value] = js.batched_run(name, js.Batch.stack([np.array([value])])).tolist()
        except Exception as error:
            outcomes[value] = error

    thread = threading.Thread(target=call)
    thread.start()
    return thread


def test_stop_without_drain_answers_unstarted_requests_and_finishes_started_ones():
    gate, ran, outcomes = threading.Event(), [], {}
    server = js.serve(_blocking_serving(gate, ran), name="nodrain")
    threads = [_call_in_thread("nodrain", 1, outcomes)]
    while not ran:
        time.sleep(0.001)
    threads += [_call_in_thread("nodrain", v, outcomes) for v in (2, 3, 4)]
    while server.stats().queue_depth < 3:
        time.sleep(0.001)
    stopper = threading.Thread(target=server.stop, kwargs={"drain": False})
    stopper.start()
    while server.stats().queue_depth:
        time.sleep(0.001)
    gate.set()
    stopper.join(HANG_S)
    for thread in threads:
        thread.join(HANG_S)
    assert outcomes[1] == [[2]], "the started request finished"
    for value in (2, 3, 4):
        assert isinstance(outcomes[value], js.ServerStoppedError)
        assert str(outcomes[value]) == "server 'nodrain' stopped before this request started; nothing of it ran"
    assert [r.tolist() for r in ran] == [[[1]]], "nothing unstarted ran"
    assert server.stats().stopped == 3


def test_a_second_stop_waits_for_the_first_ones_drain():
    gate, ran, outcomes = threading.Event(), [], {}
    server = js.serve(_blocking_serving(gate, ran), name="twostops")
    caller = _call_in_thread("twostops", 7, outcomes)
    while not ran:
        time.sleep(0.001)
    first = threading.Thread(target=server.stop)
    first.start()
    while not server.stopping:
        time.sleep(0.001)
    second_returned = []
    second = threading.Thread(target=lambda: (server.stop(), second_returned.append(server.stats())))
    second.start()
    second.join(0.2)
    assert second.is_alive(), "the second stop() returned while the first was still draining"
    gate.set()
    for thread in (first, second, caller):
        thread.join(HANG_S)
    drained = second_returned[0]
    assert (drained.rows, drained.in_flight, drained.queue_depth) == (1, 0, 0), \
        "when the second stop() returned, the running request had finished and its rows been delivered"
    assert outcomes[7] == [[14]]


def test_names_are_unique_and_unknown_names_are_errors():
    with js.serve(js.Serving(double), name="unique"):
        with pytest.raises(js.ServerExistsError, match="a server named 'unique' is already running"):
            js.serve(js.Serving(double), name="unique")
    with pytest.raises(js.UnknownServerError, match="no server named 'nowhere' is running here"):
        js.batched_run("nowhere", js.Batch.stack([np.ones(1)]))


def test_bad_input_is_a_clear_error():
    with js.serve(js.Serving(double), name="bad"):
        with pytest.raises(js.BatchError, match="expected a jitserve.Batch .* got ndarray"):
            js.batched_run("bad", np.ones(3))


def test_preprocess_and_postprocess_run_for_the_caller():
    serving = js.Serving(double, batch_size=4, batch_timeout=0.001,
                         preprocess=lambda values: js.Batch.stack([np.array([v]) for v in values]),
                         postprocess=lambda out: out[:, 0].tolist())
    assert serving.run([1, 2, 3]) == [2, 4, 6]
    with js.serve(serving, name="prepost"):
        assert js.batched_run("prepost", [5, 6]) == [10, 12]


def test_batch_listener_sees_size_padding_and_times():
    reports = []
    serving = js.Serving(double, batch_size=4, batch_timeout=0.001)
    with js.serve(serving, name="listen") as server:
        server.add_batch_listener(reports.append)
        js.batched_run("listen", js.Batch.stack([np.array([1])] * 3))
    assert len(reports) == 1
    report = reports[0]
    assert (report.size, report.padded_size, report.server, report.error) == (3, 4, "listen", None)
    assert report.execution_s > 0 and report.queue_wait_s >= 0


# async ---------------------------------------------------------------------------------------

def test_async_callers():
    gate = threading.Event()

    async def main(server):
        calls = [asyncio.ensure_future(js.batched_run_async("async", js.Batch.stack([np.array([k])])))
                 for k in range(20)]
        while server.stats().requests < 20:
            await asyncio.sleep(0.001)
        gate.set()
        return await asyncio.gather(*calls)

    with js.serve(held(gate, batch_size=8, batch_timeout=0.01), name="async") as server:
        results = asyncio.run(main(server))
        assert server.stats().batches <= 1 + 3, "the first batch, then the other 12 to 19 rows in batches of 8"
    assert [r.tolist() for r in results] == [[[2 * k]] for k in range(20)]


def test_async_timeout_withdraws_the_request():
    gate = threading.Event()
    serving = js.Serving(lambda x: (gate.wait(HANG_S), x)[1], batch_size=1, batch_timeout=0, compiler="eager")

    async def main():
        first = asyncio.ensure_future(js.batched_run_async("async-slow", js.Batch.stack([np.array([1])])))
        await asyncio.sleep(0.05)
        with pytest.raises(TimeoutError, match="before its rows started"):
            await js.batched_run_async("async-slow", js.Batch.stack([np.array([2])]), timeout=0.05)
        gate.set()
        return await first

    with js.serve(serving, name="async-slow"):
        assert asyncio.run(main()).tolist() == [[1]]


def test_cancelled_async_caller_takes_its_rows_off_the_queue():
    gate = threading.Event()
    ran = []
    serving = js.Serving(lambda x: (ran.append(x.copy()), gate.wait(HANG_S), x)[2], batch_size=1, batch_timeout=0,
                         compiler="eager")

    async def main(server):
        first = asyncio.ensure_future(js.batched_run_async("cancel", js.Batch.stack([np.array([1])])))
        while server.stats().in_flight == 0:
            await asyncio.sleep(0.001)
        second = asyncio.ensure_future(js.batched_run_async("cancel", js.Batch.stack([np.array([2])])))
        await asyncio.sleep(0.02)
        second.cancel()
        await asyncio.sleep(0.02)
        gate.set()
        return await first

    with js.serve(serving, name="cancel") as server:
        assert asyncio.run(main(server)).tolist() == [[1]]
        stats = server.stats()
    assert [r.tolist() for r in ran] == [[[1]]], "the cancelled caller's rows never ran"
    assert stats.cancelled == 1 and stats.queue_depth == 0


def test_outputs_that_are_not_batch_major_are_a_clear_error():
    serving = js.Serving(lambda x: x.sum(), batch_size=2, batch_timeout=0.001)
    with pytest.raises(js.OutputShapeError, match=r"must return batch-major outputs .* got an output of float32\(\)"):
        serving.run(js.Batch.stack([np.ones(3, np.float32)]))
    with js.serve(serving, name="not-batch-major") as server:
        with pytest.raises(js.OutputShapeError, match="axis 0 = the 1 rows of the batch"):
            js.batched_run("not-batch-major", js.Batch.stack([np.ones(3, np.float32)]))
        assert server.stats().errors == 1


def test_a_function_that_returns_no_array_is_a_clear_error_run_or_served():
    serving = js.Serving(lambda x: None, batch_size=2, batch_timeout=0.001, compiler="eager")
    message = r"^the serving function must return batch-major outputs \(axis 0 = the 1 rows of the batch\); it " \
              r"returned no array \(None\)$"
    with pytest.raises(js.OutputShapeError, match=message):
        serving.run(js.Batch.stack([np.ones(3, np.float32)]))
    with js.serve(serving, name="returns-none"):
        with pytest.raises(js.OutputShapeError, match=message):  # it was an IndexError from inside the server
            js.batched_run("returns-none", js.Batch.stack([np.ones(3, np.float32)]))


def test_a_servings_options_are_a_frozen_record_that_replace_changes():
    serving = js.Serving(lambda x: x * 2, batch_size=8, batch_sizes=[2, 8], max_queue=64, cache_dir="/tmp/a")
    assert serving.options.batch_size == 8 and serving.options.compiler_options == {"cache_dir": "/tmp/a"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        serving.options.batch_size = 4  # type: ignore[misc]
    smaller = serving.replace(batch_size=4, cache_dir="/tmp/b")
    assert (smaller.batch_size, smaller.batch_sizes, smaller.max_queue) == (4, [1, 2, 4], 64)
    assert smaller.options.compiler_options == {"cache_dir": "/tmp/b"}
    assert serving.batch_sizes == [2, 8] and serving.options.compiler_options == {"cache_dir": "/tmp/a"}
