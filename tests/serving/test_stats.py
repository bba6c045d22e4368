"""Statistics counted as Triton counts them (its statistics extension): per request that completed, its wait
for its first execution and its share of each execution that ran it; per execution, the phases by the size
it ran at; for a Serving and a Generation. No assertion on how long anything took: only on how the
measured times add up."""

from __future__ import annotations

import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

import jitserve as js
from jitserve.serving.stats import NO_TIME, GenerationStats, Phases, ServerStats
from netutil import ROOT


def refuses_negatives(x):
    """Doubles its rows; a batch holding a negative number fails (the eager compiler runs it as written)."""
    if (x < 0).any():
        raise ValueError("negative input")
    return x * 2


def timed(call):
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def test_a_serving_counts_each_completed_request_once_with_the_batches_that_ran_it():
    reports = []
    serving = js.Serving(refuses_negatives, batch_size=4, batch_timeout=30, compiler="eager")
    with js.serve(serving, name="counted") as server:
        server.add_batch_listener(reports.append)
        latencies = []
        threads = [threading.Thread(target=lambda k=k: latencies.append(timed(
            lambda: js.batched_run("counted", js.Batch.stack([np.array([float(k)])]))))) for k in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        rows = js.Batch.stack([np.array([float(k)]) for k in range(8)])
        latencies.append(timed(lambda: js.batched_run("counted", rows)))  # split into two full batches
        with pytest.raises(ValueError, match="negative input"):
            js.batched_run("counted", js.Batch.stack([np.array([-1.0])] * 4))
        stats = server.stats()
    assert len(reports) == 4 and all(report.padded_size == 4 for report in reports)
    together = next(report for report in reports if len(report.queue_waits_s) == 4)
    split = [report for report in reports if len(report.queue_waits_s) == 1 and report.error is None]
    assert len(split) == 2
    assert (stats.completed, stats.completed_rows, stats.inferences, stats.errors) == (5, 12, 12, 1)
    # each request of a batch counts the whole batch's phases; the split request both of its batches'
    expected = sum([together.phases] * 4 + [report.phases for report in split], NO_TIME)
    assert stats.completed_phases.input_s == pytest.approx(expected.input_s)
    assert stats.completed_phases.infer_s == pytest.approx(expected.infer_s)
    assert stats.completed_phases.output_s == pytest.approx(expected.output_s)
    assert stats.completed_queue_s == pytest.approx(sum(together.queue_waits_s) + split[0].queue_waits_s[0]), \
        "the split request waited once: until its first batch"
    count, phases = stats.executions()[4]
    assert count == 4 == stats.batches
    assert phases.total_s == pytest.approx(sum(report.phases.total_s for report in reports))
    assert min(together.phases.input_s, together.phases.infer_s, together.phases.output_s) > 0
    assert stats.completed_queue_s + stats.completed_phases.total_s <= sum(latencies), \
        "what a request spent queued and computing lies within the time its caller waited"


def prefill(params, tokens, length):
    total = jnp.sum(jnp.where(jnp.arange(tokens.shape[0]) < length, tokens, 0))
    return {"total": total}, (total % 97).astype(jnp.int32)


def decode(params, state, last):
    total = state["total"] + last
    return {"total": total}, (total % 97).astype(jnp.int32)


def test_a_generation_counts_each_completed_request_and_each_launch_of_its_slots():
    generation = js.Generation(prefill, decode, params={}, slots=2, max_length=32, prefill_lengths=[8])
    prompt = np.array([3, 1, 4], np.int32)
    with js.serve(generation, name="counted-generation") as server:
        latencies = [timed(lambda: js.generate("counted-generation", prompt, max_steps=5)) for _ in range(3)]
        stats = server.stats()
    assert isinstance(stats, GenerationStats)
    assert (stats.completed, stats.inferences) == (3, 3)
    assert stats.launches == stats.steps >= 3 * 4, "one step per launch; each request's 4 outputs after the first"
    assert stats.executions() == {2: (stats.launches, stats.launch_phases)}, "a launch steps every slot"
    completed = stats.completed_phases
    assert completed.infer_s > 0 and completed.output_s > 0
    assert stats.completed_queue_s + completed.total_s <= sum(latencies), \
        "what a request spent queued and computing lies within the time its caller waited"


def test_stats_add_up_phases_and_sizes():
    one = ServerStats(completed=1, completed_phases=Phases(1.0, 2.0, 3.0), batch_sizes={4: 1},
                      batch_phases={4: Phases(1.0, 2.0, 3.0)})
    two = ServerStats(completed=2, completed_phases=Phases(0.5, 0.5, 0.5), batch_sizes={4: 1, 8: 2},
                      batch_phases={4: Phases(1.0, 1.0, 1.0), 8: Phases(2.0, 2.0, 2.0)})
    summed = one + two
    assert summed.completed == 3 and summed.completed_phases == Phases(1.5, 2.5, 3.5)
    assert summed.executions() == {4: (2, Phases(2.0, 3.0, 4.0)), 8: (2, Phases(2.0, 2.0, 2.0))}
    assert ServerStats.total([]).executions() == {} and GenerationStats().executions() == {}
    assert NO_TIME.total_s == 0.0 and Phases(1.0, 2.0, 3.0).total_s == 6.0


def test_a_checkpoint_generation_with_a_paged_cache_counts_alike():
    """from_pretrained's default: a paged KV cache, its prompts prefilled in chunks (examples/gpt2.py's
    checkpoint, text in and out)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from make_checkpoint import gpt2
    finally:
        sys.path.remove(str(ROOT / "examples"))
    generation = js.from_pretrained(gpt2(), max_length=64, slots=2)
    with js.serve(generation, name="counted-paged") as server:
        latencies = [timed(lambda: js.generate("counted-paged", "Once upon a time", max_steps=6)) for _ in range(3)]
        stats = server.stats()
    assert stats.kv_blocks > 0, "the paged cache"
    assert (stats.completed, stats.inferences) == (3, 3)
    assert stats.executions() == {2: (stats.launches, stats.launch_phases)} and stats.launches > 0
    assert stats.completed_phases.infer_s > 0
    assert stats.completed_queue_s + stats.completed_phases.total_s <= sum(latencies)
