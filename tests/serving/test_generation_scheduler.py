"""The generation scheduler on plain data: slots, queue and plans, with no device, no compile and no thread."""

from __future__ import annotations

import numpy as np

from jitserve.serving.generation import GREEDY, Sampling
from jitserve.serving.generation.scheduler import Scheduler, SlotRequest


def scheduler(slots=4, steps_per_launch=1, max_queue=None) -> Scheduler[SlotRequest]:
    return Scheduler(slots, prefill_lengths=[8, 16], prefill_batches=[1, 2, 4][:slots.bit_length()],
                     steps_per_launch=steps_per_launch, max_queue=max_queue)


def request(tokens=3, max_steps=10, sampling=GREEDY, max_length=64) -> SlotRequest:
    return SlotRequest(np.ones(tokens, np.int32), max_steps, sampling, max_length)


def submitted(plan_of: Scheduler[SlotRequest], *requests: SlotRequest) -> list[SlotRequest]:
    for each in requests:
        plan_of.submit(each)
    return list(requests)


def test_waiting_prompts_take_the_lowest_free_slots_grouped_by_compiled_length_and_padded():
    s = scheduler()
    short, long, short_too = submitted(s, request(3), request(12), request(8))
    plan = s.plan()
    assert [(r.slot, r.dispatched) for r in (short, long, short_too)] == [(0, 2), (1, 2), (2, 2)]
    assert [(p.length, p.requests, p.padded) for p in plan.prefills] == [
        (8, [short, short_too], [short, short_too]), (16, [long], [long])]
    assert plan.busy == 3 and s.free == [3] and not s.waiting
    assert plan.step is not None and plan.step.requests == [short, long, short_too] and plan.step.slots == [0, 1, 2]
    assert plan.step.samplings is None and plan.step.positions is None, "every request is greedy"
    assert plan.requests == [short, short_too, long, short, long, short_too]
    four = submitted(s, *[request(2) for _ in range(4)])
    s.release([short, long])
    plan = s.plan()
    assert [r.slot for r in four[:3]] == [0, 1, 3] and s.free == [] and list(s.waiting) == four[3:]
    assert [(p.length, p.requests, p.padded) for p in plan.prefills] == [(8, four[:3], four[:3] + four[:1])]


HOT = Sampling(temperature=1.0, seed=5)


def test_a_request_whose_last_output_is_in_the_plan_gives_up_its_slot_at_once():
    s = scheduler(slots=1)
    one, two = submitted(s, request(max_steps=1), request(max_steps=3, sampling=HOT))
    plan = s.plan()
    assert plan.busy == 1 and plan.step is None, "its only output is the prefill's: it is not stepped"
    assert s.free == [0] and not s.running and one.dispatched == 1
    plan = s.plan()
    assert two.slot == 0 and plan.step is not None and plan.step.requests == [two]
    assert s.free == [] and two.dispatched == 2
    plan = s.plan()
    assert plan.step is not None and plan.step.positions == [2] and s.free == [0], "its last step is dispatched"
    assert s.plan() == ([], None, 0, []), "nothing runs, nothing waits: nothing to launch"


def test_a_launch_of_several_steps_counts_them_all_and_can_overshoot_what_a_request_needs():
    s = scheduler(slots=2, steps_per_launch=4)
    short, long = submitted(s, request(max_steps=3), request(max_steps=20, sampling=HOT))
    s.plan()
    assert (short.dispatched, long.dispatched) == (5, 5) and s.free == [0] and list(s.running) == [1]
    plan = s.plan()
    assert plan.step is not None and plan.step.positions == [0, 5] and long.dispatched == 9


def test_a_launch_samples_while_a_running_request_samples_each_slot_with_its_own_options():
    s = scheduler(slots=4)
    greedy, _ = submitted(s, request(max_steps=50), request(max_steps=2, sampling=HOT))
    plan = s.plan()
    assert plan.step is not None and plan.step.slots == [0, 1]
    assert plan.step.samplings == [GREEDY, HOT, GREEDY, GREEDY], "idle slots are greedy"
    assert plan.step.positions == [1, 1, 0, 0], "each admitted prompt's first output is dispatched before it"
    plan = s.plan()
    assert plan.step is not None and plan.step.requests == [greedy] and plan.step.samplings is None, \
        "the sampled request's last output was dispatched: a greedy launch"
    s.submit(request(sampling=HOT))
    s.plan()
    assert s.take_running() and s.plan().step is None
    s.submit(request())
    assert s.plan().step.samplings is None, "nothing that samples runs any more"


def test_new_weights_waiting_hold_the_queue_while_the_running_requests_go_on():
    s = scheduler(slots=2)
    first, = submitted(s, request())
    s.plan()
    second, = submitted(s, request())
    plan = s.plan(admit=False)
    assert plan.prefills == [] and plan.step is not None and plan.step.requests == [first]
    assert list(s.waiting) == [second] and second.slot == -1 and s.free == [1]


def test_cancelled_requests_leave_the_queue_at_once_and_their_slots_at_the_next_plan():
    s = scheduler(slots=1)
    running, waiting = submitted(s, request(max_steps=50), request())
    s.plan()
    assert s.cancel(waiting) is True and not s.waiting and waiting.cancelled
    assert s.cancel(waiting) is False, "cancelled already"
    assert s.cancel(running) is False and running.cancelled and s.running == {0: running}
    assert s.release_cancelled() == 1 and s.free == [0] and not s.running
    assert s.release_cancelled() == 0
    ended = request()
    ended.ended = True
    assert s.cancel(ended) is False and not ended.cancelled


def test_a_request_that_waited_too_long_expires_unless_it_has_a_slot():
    s = scheduler(slots=1)
    admitted, late = submitted(s, request(), request())
    s.plan()
    assert s.expire(admitted) is False and not admitted.cancelled
    assert s.expire(late) is True and late.cancelled and not s.waiting
    assert s.expire(late) is False


def test_delivery_frees_the_slots_of_ended_requests_only_while_they_hold_them():
    s = scheduler(slots=2)
    first, second = submitted(s, request(max_steps=50), request(max_steps=50))
    s.plan()
    s.release([first])
    assert s.free == [0] and s.running == {1: second}
    third, = submitted(s, request(max_steps=50))
    s.plan()
    assert third.slot == 0
    s.release([first])
    assert s.running == {0: third, 1: second}, "slot 0 is third's now"


def test_the_update_decides_every_end_and_its_reason_and_frees_the_slots_of_those_that_end():
    """One launch of 3 steps over five requests: an eos, a stop id, the last output needed, an eos ignored, and
    a request cancelled before: each takes its outputs up to its end, which says why."""
    s = scheduler(slots=5, steps_per_launch=3)
    at_eos, at_stop, at_length, ignoring, cancelled = submitted(
        s, request(), request(sampling=Sampling(stop_token_ids=[7])), request(max_steps=2),
        request(sampling=Sampling(ignore_eos=True)), request(12))
    s.plan()
    s.cancel(cancelled)
    outputs = np.array([[5, 5, 5, 2, 5], [2, 7, 5, 2, 2], [5, 5, 5, 5, 5]], np.int32)  # (steps, rows)
    requests = [at_eos, at_stop, at_length, ignoring, cancelled]
    taken, finished = s.update(requests, [0, 1, 2, 3, 4], outputs, np.array([2], np.int32))
    assert taken == [2, 2, 2, 3, 0]
    assert finished == [at_eos, at_stop, at_length]
    assert [r.finish_reason for r in requests] == ["stop", "stop", "length", None, None]
    assert [r.produced for r in requests] == [2, 2, 2, 3, 0]
    assert sorted(s.running) == [3, 4] and s.free == [0, 1, 2], "the cancelled one frees its slot at the next plan"
    taken, finished = s.update([at_eos, ignoring], [0, 1], outputs[:1, :2], np.array([2], np.int32))
    assert taken == [0, 1] and finished == [], "an ended request takes nothing more"


def test_the_queue_is_full_at_max_queue_and_everything_can_be_taken_off():
    s = scheduler(slots=1, max_queue=3)
    running, *waiting = submitted(s, request(max_steps=50), request(), request())
    assert s.full
    s.plan()
    assert not s.full
    assert s.take_waiting() == waiting and not s.waiting
    assert s.take_running() == [running] and not s.running and s.free == [0]
    assert not scheduler().full, "no max_queue: never full"
