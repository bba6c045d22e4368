"""The paged engine's blocks and scheduler on plain data: the pool, the prefix cache, admission by blocks,
chunked prompts beside decodes, and preemption, with no device, no compile and no thread."""

from __future__ import annotations

import numpy as np
import pytest

import jitserve as js
from jitserve.serving.generation import GREEDY
from jitserve.serving.generation.blocks import BlockPool, block_keys
from jitserve.serving.generation.paged_scheduler import PagedScheduler
from jitserve.serving.generation.scheduler import SlotRequest

MAX_LENGTH = 128


def generation(slots=4, tokens=256, chunk_lengths=(16, 32), block_size=16, steps_per_launch=1):
    cache = js.PagedCache(layers=1, kv_heads=1, head_dim=2, block_size=block_size, tokens=tokens)
    return js.Generation(forward=lambda *args: None, cache=cache, params={"w": np.zeros(1, np.float32)},
                         slots=slots, max_length=MAX_LENGTH, prefill_lengths=list(chunk_lengths), logits=True,
                         steps_per_launch=steps_per_launch)


def request(tokens=20, max_steps=50, start=1) -> SlotRequest:
    return SlotRequest(np.arange(start, start + tokens, dtype=np.int32), max_steps, GREEDY, MAX_LENGTH)


def delivered(r: SlotRequest) -> None:
    """What the loop's delivery does for a request: its outputs in flight arrive (token 7 each)."""
    r.history = [*(r.history or []), *[7] * (r.dispatched - r.produced)]
    r.produced = r.dispatched


def test_the_pool_hands_out_blocks_but_the_reserved_one_and_takes_them_back():
    pool = BlockPool(5, 16)
    assert (pool.usable, pool.available, pool.used) == (4, 4, 0)
    first = pool.take(3)
    assert 0 not in first and pool.available == 1 and pool.blocks_for(33) == 3
    pool.release(first)
    assert pool.available == 4 and sorted(pool.take(4)) == [1, 2, 3, 4]


def test_a_cached_block_is_shared_counted_and_evicted_least_recently_used_when_none_is_free():
    pool = BlockPool(4, 2)
    keys = block_keys(np.array([1, 2, 3, 4, 5], np.int32), 2)
    assert len(keys) == 2, "only full blocks have keys"
    assert block_keys(np.array([9, 2, 3, 4], np.int32), 2)[1] != keys[1], "a key names the whole prefix"
    blocks = pool.take(3)
    for block, key in zip(blocks, keys):
        pool.register(block, key)
    pool.release(blocks)
    assert pool.available == 3 and pool.used == 0, "cached blocks held by none are evictable"
    assert pool.share(keys) == blocks[:2] and pool.references[blocks[0]] == 1
    pool.release(blocks[:2])
    other = pool.take(2)
    assert other[0] == blocks[2], "the free block first"
    assert other[1] == blocks[1] and pool.evictions == 1, "then the cached one released last, the prefix's tail"
    assert pool.share(keys) == [blocks[0]], "the evicted block's key is gone; the prefix before it stays"


def test_a_sequence_holds_the_blocks_of_what_it_has_written_not_its_max_length():
    s = PagedScheduler(generation())
    r = request(tokens=20)
    s.submit(r)
    plan = s.plan()
    assert plan.admitted == [r] and [c.requests for c in plan.prefills] == [[r]]
    assert len(r.blocks) == 2 and s.pool.used == 2, "20 prompt positions and the first decode's, in blocks of 16"
    assert plan.step is not None and plan.step.requests == [r] and plan.step.cache_positions[0] == 20
    assert plan.step.tables.shape == (1, 8) and list(plan.step.tables[0]) == [*r.blocks, *[0] * 6], \
        "one row for one sequence, over the whole table (attention reads only the blocks the row holds)"
    assert list(plan.step.rows) == [r.slot] and plan.step.output_rows == [0]
    delivered(r)
    for _ in range(12):
        s.plan()
    assert len(r.blocks) == 3 and r.dispatched == 14, "a block more once position 32 is written"


def test_a_decode_launch_runs_the_fewest_compiled_rows_that_hold_its_sequences():
    """Rows are powers of two below the slots, then the slots: 1, 2, 4, 8, 16 for 16 slots (issue 57: one sequence
    alone no longer pays for every slot); padding rows name no slot (the slot count) and write block 0."""
    s = PagedScheduler(generation(slots=16, tokens=1024))
    assert s.row_counts == [1, 2, 4, 8, 16]
    shapes = []
    for count in (1, 2, 5, 16):
        while sum(1 for r in s.running.values()) < count:
            s.submit(request(tokens=3, start=len(s.running) + 1))
            s.plan()
        plan = s.plan()
        assert plan.step is not None and len(plan.step.requests) == count
        shapes.append(plan.step.tables.shape)
        rows = list(plan.step.rows)
        assert rows[:count] == plan.step.slots and rows[count:] == [16] * (len(rows) - count)
        assert not plan.step.tables[count:].any() and not plan.step.cache_positions[count:].any()
        for r in plan.step.requests:
            delivered(r)
    assert shapes == [(1, 8), (2, 8), (8, 8), (16, 8)], "5 sequences run in 8 rows, each table whole"


def test_a_long_prompt_is_prefilled_a_chunk_per_turn_beside_the_running_decodes():
    s = PagedScheduler(generation(chunk_lengths=(16, 32)))
    running, long = request(tokens=5), request(tokens=100, start=50)
    s.submit(running)
    s.plan()
    s.submit(long)
    chunks = []
    for _ in range(4):
        plan = s.plan()
        assert plan.step is not None and running in plan.step.requests, "the running stream steps every turn"
        chunks += [(c.tokens.shape[1], int(c.starts[0]), int(c.counts[0])) for c in plan.prefills]
    assert chunks == [(32, 0, 32), (32, 32, 32), (32, 64, 32), (16, 96, 4)]
    assert plan.step is not None and long in plan.step.requests and long.dispatched == 2
    assert np.array_equal(plan.prefills[0].tokens[0, :4], long.prompt[96:]) and plan.prefills[0].requests == [long]


def test_prompts_wait_for_blocks_not_for_slots_and_are_admitted_first_come_first_served():
    s = PagedScheduler(generation(slots=8, tokens=64))  # 4 blocks
    first, second, third = request(tokens=40), request(tokens=40), request(tokens=5)
    for r in (first, second, third):
        s.submit(r)
    plan = s.plan()
    assert plan.admitted == [first] and list(s.waiting) == [second, third], "the second's 3 blocks are not free"
    assert s.free == list(range(1, 8))


def test_the_newest_sequence_is_preempted_for_a_block_and_resumes_from_its_prompt_and_outputs():
    s = PagedScheduler(generation(tokens=64, chunk_lengths=(16, 32)))  # 4 blocks of 16
    old, new = request(tokens=16, start=1), request(tokens=16, start=100)
    s.submit(old)
    s.submit(new)
    assert s.plan().admitted == [old, new]
    assert (len(old.blocks), len(new.blocks)) == (2, 2) and s.pool.available == 0
    for _ in range(15):
        delivered(old), delivered(new)
        s.plan()
    assert old.dispatched == 17 and len(old.blocks) == 2, "position 31 is the last of its second block"
    delivered(old)
    plan = s.plan()  # old needs a third block for position 32: new (the newest) gives its blocks back
    assert s.preemptions == 1 and new.slot == -1 and not new.blocks and list(s.waiting) == [new]
    assert len(old.blocks) == 3 and plan.step is not None and plan.step.requests == [old]
    assert s.plan().admitted == [], "new waits until its outputs in flight have arrived"
    delivered(new)
    assert s.plan().admitted == [], "and for blocks: 16 prompt positions and 17 outputs need 3"
    old.ended = True
    s.release([old])
    plan = s.plan()
    assert plan.admitted == [new] and new.computed == 33 and s.pool.hits == 1, "its prompt's block was cached"
    assert [(int(c.starts[0]), int(c.counts[0])) for c in plan.prefills] == [(16, 17)]
    assert np.array_equal(plan.prefills[0].tokens[0, :17], [7] * 17), "the outputs it had, prefilled again"
    assert plan.prefills[0].steps[0] == 17, "its next output is its 18th, sampled as it would have been"


def test_a_prompt_reuses_the_cached_blocks_of_its_longest_prefix_and_prefills_the_rest():
    s = PagedScheduler(generation(chunk_lengths=(16, 64)))
    first, second = request(tokens=40), request(tokens=40)
    second.prompt[-1] = 99
    s.submit(first)
    s.plan()
    s.submit(second)
    plan = s.plan()
    assert second.blocks[:2] == first.blocks[:2] and second.blocks[2] != first.blocks[2]
    assert [(int(c.starts[0]), int(c.counts[0])) for c in plan.prefills] == [(32, 8)]
    assert (s.pool.lookups, s.pool.hits) == (4, 2), "the first found none of its 2, the second both"
    whole = request(tokens=32)
    s.submit(whole)
    plan = s.plan()
    assert [(int(c.starts[0]), int(c.counts[0])) for c in plan.prefills] == [(16, 16)], \
        "a prompt cached whole computes its last block again, for its first output's logits"


def test_a_twin_prompt_waits_a_plan_for_the_blocks_its_first_computes_then_shares_them():
    s = PagedScheduler(generation(chunk_lengths=(16, 64)))
    short, first, twin, other = request(tokens=5, start=200), request(tokens=40), request(tokens=40), request(3)
    for r in (short, first, twin, other):
        s.submit(r)
    plan = s.plan()
    assert plan.admitted == [short, first] and list(s.waiting) == [twin, other], \
        "sharing now could read blocks before the program writing them ran; computing them again wastes them"
    assert [c.tokens.shape[1] for c in plan.prefills] == [16, 64]
    plan = s.plan()
    assert plan.admitted == [twin, other] and twin.blocks[:2] == first.blocks[:2]
    assert [(int(c.starts[0]), int(c.counts[0])) for c in plan.prefills if twin in c.requests] == [(32, 8)]


def test_after_a_failed_step_the_pool_is_empty_and_its_counters_count_on():
    s = PagedScheduler(generation(chunk_lengths=(16, 64)))
    first = request(tokens=40)
    s.submit(first)
    s.plan()
    s.submit(request(tokens=40))
    s.plan()
    assert (s.pool.lookups, s.pool.hits) == (4, 2) and s.pool.used > 0
    assert len(s.take_running()) == 2
    assert s.pool.used == 0 and not s.pool.cached and (s.pool.lookups, s.pool.hits) == (4, 2), \
        "Prometheus counters never go backwards"


@pytest.mark.parametrize("tokens, max_steps, needs", [(100, 200, 127), (10, 300, 127), (60, 20, 79)])
def test_a_request_that_could_never_fit_the_pool_is_refused_naming_the_sizes(tokens, max_steps, needs):
    small = generation(tokens=64)
    with pytest.raises(js.PromptTooLongError) as error:
        small.check_request("tiny", np.ones(tokens, np.int32), max_steps, None)
    assert str(error.value) == (
        f"the prompt ({tokens} tokens) and its outputs (max_steps {max_steps}) need {needs} positions of KV cache; "
        f"the whole cache of generation server 'tiny' holds 64 (4 blocks of 16)")
    assert small.check_request("tiny", np.ones(10, np.int32), 50, None).size == 10
