"""The autoscaling decision as a pure function: readings in, replicas wanted and why out; no Ray cluster,
no clock."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")
from jitserve.cluster.ray.autoscaling import Autoscaling, Decision, Reading, decide
from jitserve.serving.stats import ServerStats

POLICY = Autoscaling(min_replicas=1, max_replicas=4, upscale_delay_s=1.0, downscale_delay_s=10.0)
TARGET = 8.0  # rows waiting per replica (a serving's batch_size when target_queue is not given)


def _run(readings, policy=POLICY):
    """The decisions for a sequence of readings, each carrying on from the one before."""
    decisions, last = [], None
    for reading in readings:
        last = decide(policy, TARGET, reading, last)
        decisions.append(last)
    return decisions


def test_high_load_goes_up_only_once_it_has_held_for_the_upscale_delay():
    decisions = _run([Reading(at, 1, depth=20.0, wait_s=0.05, busy=1.0) for at in (0.0, 0.5, 1.0)])
    assert [d.replicas for d in decisions] == [1, 1, 3]  # straight to what brings 20 waiting to 8 per replica
    assert decisions[0].high_since == 0.0 and decisions[1].high_since == 0.0
    assert decisions[2].why == "20.0 rows waiting per replica, 50 ms waits"


def test_a_change_starts_afresh_and_a_dip_resets_the_delay():
    up = decide(POLICY, TARGET, Reading(5.0, 1, 20.0, 0.0, 1.0), Decision(1, high_since=0.0))
    assert up.replicas == 3 and up.high_since is None and up.low_since is None
    decisions = _run([Reading(0.0, 2, 10.0, 0.0, 1.0), Reading(0.6, 2, 6.0, 0.0, 1.0),
                      Reading(1.2, 2, 10.0, 0.0, 1.0), Reading(2.2, 2, 10.0, 0.0, 1.0)])
    assert [d.replicas for d in decisions] == [2, 2, 2, 3]  # the dip at 0.6 s restarted the delay at 1.2 s


def test_up_is_at_least_one_more_and_at_most_max_replicas():
    assert decide(POLICY, TARGET, Reading(0.0, 2, 8.0, 0.0, 1.0), Decision(2, high_since=-1.0)).replicas == 3
    assert decide(POLICY, TARGET, Reading(0.0, 3, 80.0, 0.0, 1.0), Decision(3, high_since=-1.0)).replicas == 4
    at_max = decide(POLICY, TARGET, Reading(0.0, 4, 80.0, 0.0, 1.0), Decision(4, high_since=-9.0))
    assert at_max.replicas == 4 and at_max.high_since == -9.0


def test_long_waits_alone_go_up_when_target_wait_s_is_set():
    policy = Autoscaling(min_replicas=1, max_replicas=4, target_wait_s=0.1, upscale_delay_s=0.0)
    assert decide(policy, TARGET, Reading(0.0, 2, 1.0, 0.5, 1.0)).replicas == 3
    assert decide(POLICY, TARGET, Reading(0.0, 2, 1.0, 0.5, 1.0)).replicas == 2


def test_idle_goes_down_after_the_downscale_delay_to_as_few_as_stay_under_busy_after_down():
    decisions = _run([Reading(at, 4, depth=0.0, wait_s=0.0, busy=0.3) for at in (0.0, 5.0, 10.0)])
    assert [d.replicas for d in decisions] == [4, 4, 2]  # 4 x 30 % busy is 1.2 replicas' work: 2 stay under 70 %
    assert decisions[2].why == "idle: 0.0 rows waiting, 30% busy"
    assert decide(POLICY, TARGET, Reading(0.0, 4, 0.0, 0.0, 0.0), Decision(4, low_since=-10.0)).replicas == 1


def test_the_hysteresis_keeps_a_busy_or_half_full_serving_where_it_is():
    busy = _run([Reading(at, 2, depth=0.0, wait_s=0.0, busy=0.5) for at in (0.0, 20.0)])
    assert [d.replicas for d in busy] == [2, 2]  # one replica would be 100 % busy
    assert busy[-1].low_since is None
    half_full = _run([Reading(at, 2, depth=5.0, wait_s=0.0, busy=0.0) for at in (0.0, 20.0)])
    assert [d.replicas for d in half_full] == [2, 2]  # 5 waiting is more than half the target
    at_min = _run([Reading(at, 1, 0.0, 0.0, 0.0) for at in (0.0, 20.0)])
    assert [d.replicas for d in at_min] == [1, 1]


def test_a_reading_comes_from_the_summed_counters_at_both_ends_of_a_period():
    before = ServerStats(rows=100, queue_wait_s=1.0, execution_s=2.0, queue_depth=0)
    after = ServerStats(rows=140, queue_wait_s=3.0, execution_s=3.0, queue_depth=12)
    reading = Reading.between(10.0, before, 10.5, after, 2)
    assert reading == Reading(at=10.5, replicas=2, depth=6.0, wait_s=0.05, busy=1.0)
    assert Reading.between(0.0, before, 1.0, before, 2).wait_s == 0.0  # no rows run: no waits to average
