"""What Nx.Serving, Triton and Ray Serve users reach for: shutdown deadlines, pre/post-processing with
state, declared batch keys, priorities and the adaptive batching window."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import jitserve as js
from jitserve.serving.queue import BatchPolicy, Queues
from jitserve.serving.request import Request
from waiting import HANG_S, until


def rows(*values, dtype=np.float32):
    return js.Batch.stack([np.array([v], dtype) for v in values])


def blocking_serving(gate: threading.Event, seen: list, **options):
    def fn(x):
        seen.extend(np.asarray(x)[:, 0].tolist())
        assert gate.wait(HANG_S), "the gate stayed shut"
        return x * 2

    return js.Serving(fn, compiler="eager", input_template=js.template((1,), "float32"), **options)


# shutdown with a deadline --------------------------------------------------------------------

def test_stop_with_a_timeout_drains_for_at_most_that_long_then_answers_the_rest():
    gate, seen = threading.Event(), []
    server = js.serve(blocking_serving(gate, seen, batch_size=1, batch_timeout=0), name="deadline")
    outcomes: dict[float, object] = {}

    def call(value):
        try:
            outcomes[value] = js.batched_run("deadline", rows(value)).tolist()
        except js.ServerStoppedError as error:
            outcomes[value] = error

    threads = [threading.Thread(target=call, args=(v,)) for v in (1.0, 2.0, 3.0)]
    threads[0].start()
    until(lambda: seen == [1.0], "1.0 to run (blocked on the gate)")
    for thread in threads[1:]:
        thread.start()
    until(lambda: server.stats().queue_depth == 2, "2.0 and 3.0 to wait")
    stopper = threading.Thread(target=server.stop, kwargs={"timeout": 0.2})
    stopper.start()
    # past the deadline the waiting requests are answered, while the running one goes on (its gate is shut)
    until(lambda: 2.0 in outcomes and 3.0 in outcomes, "the waiting requests to be answered")
    assert 1.0 not in outcomes
    assert isinstance(outcomes.get(2.0), js.ServerStoppedError) and isinstance(outcomes.get(3.0), js.ServerStoppedError)
    assert str(outcomes[2.0]) == ("server 'deadline' stopped (its drain timeout of 0.2s ran out) before all of this "
                                  "request ran; nothing of it ran")
    gate.set()
    stopper.join(HANG_S)
    for thread in threads:
        thread.join(HANG_S)
    assert outcomes[1.0] == [[2.0]] and seen == [1.0], "what started finished; what did not never ran"
    assert server.stats().stopped == 2


# client pre/post-processing with state -------------------------------------------------------

def test_preprocess_info_and_batch_metadata_reach_postprocess_in_the_caller():
    caller = threading.get_ident()
    calls = []

    def preprocess(texts):
        return js.Batch.stack([np.array([len(t)], np.float32) for t in texts]), {"texts": texts}

    def postprocess(output_and_metadata, info):
        outputs, metadata = output_and_metadata
        calls.append(threading.get_ident())
        return {text: float(row[0]) for text, row in zip(info["texts"], outputs)}, metadata

    serving = js.Serving(lambda x: x * 10, batch_size=2, batch_timeout=0.001, preprocess=preprocess,
                         postprocess=postprocess, input_template=js.template((1,), "float32"))
    with js.serve(serving, name="stateful"):
        result, metadata = js.batched_run("stateful", ["ab", "cde", "f"])
    assert result == {"ab": 20.0, "cde": 30.0, "f": 10.0}
    assert calls == [caller], "postprocess runs once, in the caller"
    assert [m.size for m in metadata] == [2, 1] and [m.padded_size for m in metadata] == [2, 1]
    assert all(m.server == "stateful" and m.partition == 0 and m.execution_s >= 0 and m.queue_wait_s >= 0
               for m in metadata)
    inline, inline_metadata = serving.run(["xyz"])
    assert inline == {"xyz": 30.0} and inline_metadata == ()


def test_a_bare_batch_from_preprocess_keeps_the_one_argument_postprocess():
    serving = js.Serving(lambda x: x + 1, batch_size=2, preprocess=lambda v: rows(*v), postprocess=lambda o: o.tolist())
    assert serving.run([1.0, 2.0]) == [[2.0], [3.0]]


# declared batch keys --------------------------------------------------------------------------

def test_declared_batch_keys_compile_per_key_at_warm_up_and_pass_the_key():
    def fn(key, x):
        return x * (10 if key == "long" else 1)

    serving = js.Serving(fn, batch_size=2, batch_timeout=0.001, batch_keys=["short", "long"],
                         input_template=js.template((1,), "float32"))
    with js.serve(serving, name="keyed") as server:
        assert server.stats().compiles == 4, "2 batch sizes x 2 keys, before any request"
        assert js.batched_run("keyed", rows(1.0).key("long")).tolist() == [[10.0]]
        assert js.batched_run("keyed", rows(1.0).key("short")).tolist() == [[1.0]]
        with pytest.raises(js.BatchError, match=r"unknown batch key: 'medium' \(expected one of 'short', 'long'\)"):
            js.batched_run("keyed", rows(1.0).key("medium"))
        with pytest.raises(js.BatchError, match=r"unknown batch key: None \(expected one of 'short', 'long'\)"):
            js.batched_run("keyed", rows(1.0))
        assert server.stats().compiles == 4
    assert serving.run(rows(2.0).key("long")).tolist() == [[20.0]]
    with pytest.raises(js.OptionError, match="batch_keys must name at least one key"):
        js.Serving(fn, batch_keys=[])


# priorities ------------------------------------------------------------------------------------

def test_higher_priority_rows_run_first_though_lower_ones_were_queued_first():
    gate, seen = threading.Event(), []
    serving = blocking_serving(gate, seen, batch_size=2, batch_timeout=0.001, priority_levels=3)
    with js.serve(serving, name="prio") as server:
        threads = [threading.Thread(target=js.batched_run, args=("prio", rows(0.0)))]
        threads[0].start()
        until(lambda: seen == [0.0], "the partition to be busy with 0.0")
        for queued, (value, priority) in enumerate([(1.0, 3), (2.0, 3), (3.0, None), (10.0, 1), (11.0, 1),
                                                    (20.0, 2)], 1):
            threads.append(threading.Thread(target=js.batched_run, args=("prio", rows(value)),
                                            kwargs={"priority": priority}))
            threads[-1].start()
            until(lambda: server.stats().queue_depth == queued, f"{value} to be queued")
        gate.set()
        for thread in threads:
            thread.join(HANG_S)
    assert seen == [0.0, 10.0, 11.0, 20.0, 1.0, 2.0, 3.0], "by level, then arrival (None is the default, 3)"


def test_low_priority_rows_still_finish_under_sustained_high_priority_load():
    serving = js.Serving(lambda x: (time.sleep(0.002), x)[1], batch_size=1, batch_timeout=0, compiler="eager",
                         priority_levels=2, priority_aging=0.05, input_template=js.template((1,), "float32"))
    stop = threading.Event()
    with js.serve(serving, name="aging") as server:
        def flood():
            while not stop.is_set():
                js.batched_run("aging", rows(1.0), priority=1)

        flooders = [threading.Thread(target=flood) for _ in range(4)]
        for thread in flooders:
            thread.start()
        until(lambda: server.stats().requests > 8, "the flood to be under way")
        try:
            result = js.batched_run("aging", rows(7.0), priority=2, timeout=HANG_S)  # promoted after 0.05 s
        finally:
            stop.set()
            for thread in flooders:
                thread.join(HANG_S)
    assert result.tolist() == [[7.0]]


def test_priority_levels_have_their_own_queue_bounds_and_default_timeouts():
    gate, seen = threading.Event(), []
    serving = blocking_serving(gate, seen, batch_size=1, batch_timeout=0, priority_levels=2,
                               priority_queues={2: {"max_queue": 1, "timeout": 0.1}})
    with js.serve(serving, name="levels") as server:
        busy = threading.Thread(target=js.batched_run, args=("levels", rows(0.0)), kwargs={"priority": 1})
        busy.start()
        until(lambda: seen == [0.0], "the partition to be busy with 0.0")
        with pytest.raises(TimeoutError, match="timed out after 0.1s before its rows started"):
            js.batched_run("levels", rows(1.0), priority=2)  # the level's default timeout
        outcome = []  # a request that waits however long the test takes to fill the level's queue
        waiting = threading.Thread(target=lambda: outcome.append(
            js.batched_run("levels", rows(2.0), priority=2, timeout=HANG_S)))
        waiting.start()
        until(lambda: server.stats().queue_depth == 1, "2.0 to be queued")
        with pytest.raises(js.QueueFullError, match="queue for priority level 2 is full: 1 rows queued, its "
                                                    "max_queue is 1"):
            js.batched_run("levels", rows(3.0), priority=2)
        gate.set()
        busy.join(HANG_S)
        waiting.join(HANG_S)
        assert outcome[0].tolist() == [[4.0]]
        assert server.stats().rejected == 1
    with pytest.raises(js.BatchError, match=r"priority must be 0 \(the default level\) or 1..2 \(1 is the most "
                                            r"urgent\), got 5"):
        serving.priority_level(5)
    with pytest.raises(js.OptionError, match=r"priority_queues\[2\] has unknown key 'size'"):
        js.Serving(lambda x: x, priority_levels=2, priority_queues={2: {"size": 3}})


def test_take_runs_the_most_urgent_rows_first_splits_the_last_piece_and_keeps_the_counts():
    queues = Queues(BatchPolicy(batch_size=8, batch_sizes=(1, 2, 4, 8), batch_timeout=0.002, priority_levels=2))
    low, high, big = Request(3, None, level=2), Request(1, None, level=1), Request(6, None, level=1)
    queues.add(low, [rows(1.0, 2.0, 3.0)], ("s",), 0.0)
    queues.add(high, [rows(4.0)], ("s",), 0.001)
    queues.add(big, [rows(*range(10, 16))], ("s",), 0.002)
    pieces, batch = queues.take(("s",), 0.003)
    assert [(piece.request, piece.offset, piece.batch.size) for piece in pieces] == \
        [(high, 0, 1), (big, 0, 6), (low, 0, 1)], "level 1 in arrival order, then the first row of level 2"
    assert batch.materialize()[:, 0].tolist() == [4.0, *range(10, 16), 1.0]
    assert (queues.depth, queues.level_depth) == (2, {1: 0, 2: 2})
    assert high.started and big.started and low.started
    pieces, batch = queues.take(("s",), 0.004)
    assert [(piece.request, piece.offset, piece.batch.size) for piece in pieces] == [(low, 1, 2)]
    assert batch.materialize()[:, 0].tolist() == [2.0, 3.0]
    assert (queues.depth, queues.level_depth, bool(queues)) == (0, {1: 0, 2: 0}, False)


# the adaptive batching window -------------------------------------------------------------------

def _queues(adaptive: bool) -> Queues:
    return Queues(BatchPolicy(batch_size=8, batch_sizes=(1, 2, 4, 8), batch_timeout=0.002, adaptive=adaptive))


def _arrive(queues: Queues, now: float) -> None:
    queues.add(Request(1, None), [rows(1.0)], ("signature",), now)


def test_adaptive_window_runs_at_once_when_arrivals_are_sparse_and_waits_when_dense():
    sparse = _queues(adaptive=True)
    _arrive(sparse, 0.0)
    assert sparse.ready(0.0, draining=False)[0] is None, "no arrival rate known yet: wait as a fixed window does"
    sparse.finished(sparse.take(("signature",), 0.002)[1].size)
    for step in range(1, 4):  # one caller: a row every 10 ms, each run at once
        _arrive(sparse, step * 0.01)
        signature, _ = sparse.ready(step * 0.01, draining=False)
        assert signature == ("signature",), "a batch that will not fill in 2 ms runs now"
        sparse.finished(sparse.take(signature, step * 0.01)[1].size)
    dense = _queues(adaptive=True)
    for step in range(3):  # rows 10 us apart: 8 will be there well within the window
        _arrive(dense, step * 1e-5)
    signature, wait = dense.ready(3e-5, draining=False)
    assert signature is None and 0 < wait <= 0.002
    fixed = _queues(adaptive=False)
    for step in range(4):  # the same sparse arrivals
        _arrive(fixed, step * 0.01)
        assert fixed.ready(step * 0.01, draining=False)[0] is None, "adaptive=False waits for the window"
        assert fixed.ready(step * 0.01 + 0.002, draining=False)[0] == ("signature",)
        fixed.take(("signature",), step * 0.01 + 0.002)


def _rounds_of_lone_rows(queues: Queues, callers: int, rounds: int = 2) -> list[list[int]]:
    """A caller's rows 10 ms apart (the rate the queues know), then ``rounds`` rounds in which ``callers``
    rows reach the queue one at a time, 0.1 ms apart, as a gRPC client's streams do when the server's front
    hands them over one by one; each round ends once all of its batches were answered. The sizes of the
    batches of each round (a worker takes a batch as soon as one is ready; its batches run until the end of
    the round)."""
    for now in (0.0, 0.01):
        _arrive(queues, now)
        queues.finished(queues.take(("signature",), now + 0.002)[1].size)
    sizes: list[list[int]] = []
    now = 0.02
    for _ in range(rounds):
        sizes.append([])
        for _ in range(callers):
            now += 1e-4
            _arrive(queues, now)
            while (signature := queues.ready(now, draining=False)[0]) is not None:
                sizes[-1].append(queues.take(signature, now)[1].size)
        while queues:  # the last rows: they run when due
            now += 1e-4
            if (signature := queues.ready(now, draining=False)[0]) is not None:
                sizes[-1].append(queues.take(signature, now)[1].size)
        queues.finished(queues.running)
    return sizes


def test_adaptive_window_forms_batches_of_the_rows_many_callers_keep_in_flight():
    policy = BatchPolicy(batch_size=16, batch_sizes=(1, 2, 4, 8, 16), batch_timeout=0.002)
    many = _rounds_of_lone_rows(Queues(policy), callers=16)
    assert many[0] == [1] * 16 and min(many[1]) >= 4 and sum(many[1]) == 16, \
        f"once 16 rows were in flight at once, the next round's batches wait for a quarter of a batch (4 rows) " \
        f"each; got batches {many}"
    few = _rounds_of_lone_rows(Queues(policy), callers=3)
    assert few == [[1] * 3, [1] * 3], f"3 callers keep too few rows in flight to wait for; got batches {few}"
    later = Queues(policy)
    _rounds_of_lone_rows(later, callers=16, rounds=1)
    _arrive(later, 0.06)  # 40 ms after the 16 were in flight, their peak has halved five times
    assert later.ready(0.06, draining=False)[0] == ("signature",), "a lone caller's row runs at once again"


# streaming ---------------------------------------------------------------------------------------

def test_a_split_request_streams_its_first_rows_while_later_ones_still_run():
    gates = [threading.Event() for _ in range(3)]
    calls = iter(range(3))

    def fn(x):
        assert gates[next(calls)].wait(HANG_S), "the gate stayed shut"
        return x * 2

    serving = js.Serving(fn, batch_size=2, batch_timeout=0.001, compiler="eager",
                         input_template=js.template((1,), "float32"))
    with js.serve(serving, name="streamed"):
        stream = js.batched_stream("streamed", rows(1.0, 2.0, 3.0, 4.0, 5.0))
        gates[0].set()
        assert next(stream).tolist() == [[2.0], [4.0]], "the first batch's rows arrive while the second waits"
        gates[1].set()
        gates[2].set()
        assert [part.tolist() for part in stream] == [[[6.0], [8.0]], [[10.0]]]


def test_a_serving_that_yields_steps_streams_each_step_to_each_caller():
    def generate(x):
        for step in range(3):
            yield x * 10 + step

    serving = js.Serving(generate, batch_size=4, batch_timeout=0.01, streaming=True,
                         input_template=js.template((1,), "float32"))
    with js.serve(serving, name="steps"):
        results = {}

        def read(value):
            results[value] = [step.tolist() for step in js.batched_stream("steps", rows(value))]

        threads = [threading.Thread(target=read, args=(v,)) for v in (1.0, 2.0)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(HANG_S)
        assert results == {1.0: [[[10.0]], [[11.0]], [[12.0]]], 2.0: [[[20.0]], [[21.0]], [[22.0]]]}
        assert [s.tolist() for s in js.batched_run("steps", rows(3.0))] == [[[30.0]], [[31.0]], [[32.0]]]
        with pytest.raises(js.BatchSizeError, match=r"batch size \(5\) cannot exceed server batch size of 4 \(a "
                                                    r"streaming serving runs each request in one batch\)"):
            js.batched_run("steps", rows(*range(5)))
    with pytest.raises(js.OptionError, match="a streaming serving runs its generator as written"):
        js.Serving(generate, streaming=True, compiler="xla")


def test_a_request_of_a_serving_that_yields_steps_is_never_split_across_batches():
    """With more rows queued than a batch holds, a request that does not fit waits whole for the next batch:
    split, its caller would get every step twice, once per batch."""
    gate = threading.Event()

    def generate(x):
        assert gate.wait(HANG_S), "the gate stayed shut"
        for step in range(3):
            yield x + step

    serving = js.Serving(generate, batch_size=4, batch_timeout=0.05, streaming=True,
                         input_template=js.template((1,), "float32"))
    with js.serve(serving, name="whole") as server:
        results = {}

        def read(value, count):
            results[value] = [step.tolist() for step in js.batched_stream("whole", rows(*[value] * count))]

        threads = [threading.Thread(target=read, args=(float(v), 1 + v % 3)) for v in range(6)]  # 12 rows
        for thread in threads:
            thread.start()
        until(lambda: server.stats().requests == 6, "every request to be queued or running")
        gate.set()
        for thread in threads:
            thread.join(HANG_S)
        assert results == {float(v): [[[float(v + step)]] * (1 + v % 3) for step in range(3)] for v in range(6)}
        assert server.stats().rows == 12


def test_a_streaming_batch_stops_at_its_next_step_once_nobody_reads_it():
    """Each step takes a permit, so the test decides how far the generator can run before the stream closes:
    its first step, then the one it is in when the stream closes, and no more."""
    steps_run = []
    closed = threading.Event()
    permits = threading.Semaphore(1)

    def generate(x):
        try:
            for step in range(40):
                assert permits.acquire(timeout=60), "no permit for a step"
                steps_run.append(step)
                yield x + step
        finally:
            closed.set()

    serving = js.Serving(generate, batch_size=2, batch_timeout=0, streaming=True,
                         input_template=js.template((1,), "float32"))
    with js.serve(serving, name="left") as server:
        stream = js.batched_stream("left", rows(1.0))
        assert next(stream).tolist() == [[1.0]]
        stream.close()
        permits.release(100)
        assert closed.wait(60), "the generator was not closed once its only reader left"
        assert steps_run == [0, 1], f"{len(steps_run)} of 40 steps ran"
        assert [step.tolist() for step in js.batched_run("left", rows(5.0))][:2] == [[[5.0]], [[6.0]]]
        assert server.stats().cancelled == 1


def test_asyncio_streams_and_a_caller_that_stops_early_frees_its_queued_rows():
    import asyncio

    ran = []
    permits = threading.Semaphore(3)  # the two rows of the first stream, the first of the second

    def fn(x):
        assert permits.acquire(timeout=60), "no permit for a batch"
        ran.extend(np.asarray(x)[:, 0].tolist())
        return x + 1

    serving = js.Serving(fn, batch_size=1, batch_timeout=0, compiler="eager", input_template=js.template((1,), "float32"))
    with js.serve(serving, name="async-stream") as server:
        async def main():
            parts = [part.tolist() async for part in js.batched_stream_async("async-stream", rows(1.0, 2.0))]
            assert parts == [[[2.0]], [[3.0]]]
            stream = js.batched_stream_async("async-stream", rows(*[float(v) for v in range(10, 20)]))
            first = await stream.__anext__()
            await stream.aclose()
            return first

        assert asyncio.run(main()).tolist() == [[11.0]]
        permits.release(100)
        js.batched_run("async-stream", rows(100.0))  # runs after the batches started before it, on one partition
        assert [v for v in ran if 10 <= v < 100] in ([10.0], [10.0, 11.0]), \
            "rows of a stream nobody reads any more do not run, but the one started when it closed"
        assert server.stats().cancelled == 1


# a failing batch fails only the requests whose own rows fail -------------------------------------

def _fragile(x):
    if (np.asarray(x) < 0).any():
        raise ValueError("negative input")
    return x * 2


def test_bisecting_a_failed_batch_fails_only_the_bad_requests():
    # the batch goes when full (16 rows), not at a deadline a busy machine might reach first
    serving = js.Serving(_fragile, batch_size=16, batch_timeout=60, adaptive=False, compiler="eager",
                         input_template=js.template((1,), "float32"))
    values = [float(v) for v in range(1, 17)]
    values[5] = -1.0  # one bad request among 16 that share a batch
    outcomes: dict[int, object] = {}
    with js.serve(serving, name="bisect") as server:
        def call(position):
            try:
                outcomes[position] = js.batched_run("bisect", rows(values[position])).item()
            except ValueError as error:
                outcomes[position] = error

        threads = [threading.Thread(target=call, args=(p,)) for p in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(HANG_S)
        stats = server.stats()
    assert isinstance(outcomes[5], ValueError) and str(outcomes[5]) == "negative input"
    assert all(outcomes[p] == values[p] * 2 for p in range(16) if p != 5), "good requests get their rows"
    assert stats.batches == 1 and 0 < stats.bisect_runs <= 2 * 4 + 2, "at most a logarithmic number of re-runs"


def test_a_function_that_always_fails_is_not_retried_endlessly_and_bisecting_can_be_turned_off():
    def broken(x):
        raise RuntimeError("broken")

    for isolate, most in [(True, 2), (False, 0)]:
        serving = js.Serving(broken, batch_size=8, batch_timeout=0.05, compiler="eager", isolate_failures=isolate,
                             input_template=js.template((1,), "float32"))
        errors = []
        with js.serve(serving, name=f"broken-{isolate}") as server:
            threads = [threading.Thread(target=lambda: errors.append(
                pytest.raises(RuntimeError, js.batched_run, f"broken-{isolate}", rows(1.0)))) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(HANG_S)
            assert len(errors) == 8 and server.stats().bisect_runs <= most
