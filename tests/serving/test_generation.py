"""Generation: continuous batching of decode loops over slots (js.Generation, js.generate, js.generate_stream)."""

from __future__ import annotations

import asyncio
import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jitserve as js
from jitserve import compilers
from jitserve.compilers.xla import XlaCompiler
from jitserve.packed import PACKED_ELEMENTS, PackedLayout, transposed_reads
from jitserve.serving.generation import Prompt, delivery, programs
from jitserve.serving.generation import server as generation_server
from jitserve.serving.request import End
from jitserve.template import templates_of
from waiting import HANG_S, until

VOCAB = 97


def prefill(params, tokens, length):
    """A toy model whose state is (position, running sum) and whose output is the next id: deterministic,
    depending only on this sequence, so that outputs show any mix-up between slots."""
    total = jnp.sum(jnp.where(jnp.arange(tokens.shape[0]) < length, tokens, 0)) * params["scale"]
    state = {"position": length, "total": total}
    return state, (total % VOCAB).astype(jnp.int32)


def decode(params, state, last):
    total = state["total"] + last * params["scale"] + state["position"]
    return {"position": state["position"] + 1, "total": total}, (total % VOCAB).astype(jnp.int32)


def expected(prompt, steps, eos=None, max_length=64, scale=1):
    total = int(np.sum(prompt)) * scale
    position = len(prompt)
    out = [total % VOCAB]
    while len(out) < steps and len(prompt) + len(out) < max_length and (eos is None or out[-1] != eos):
        total = total + out[-1] * scale + position
        position += 1
        out.append(total % VOCAB)
    return out


PARAMS = {"scale": np.int32(1)}


def generation(**options):
    return js.Generation(prefill, decode, params=PARAMS, slots=options.pop("slots", 4),
                         max_length=options.pop("max_length", 64), prefill_lengths=options.pop("prefill_lengths", [8, 16]),
                         **options)


@pytest.mark.parametrize("compiler", ["xla", "iree", "evaluator"])
def test_generate_and_stream_agree_with_the_model_run_alone(compiler):
    prompt = np.array([3, 1, 4, 1, 5], np.int32)
    with js.serve(generation(compiler=compiler), name="gen") as server:
        compiles = server.stats().compiles
        assert compiles == 2 * 3 + 3 + 1  # prefill per (length, prompts), update per prompts, the step
        assert js.generate("gen", prompt, max_steps=10).tolist() == expected(prompt, 10)
        assert [int(o) for o in js.generate_stream("gen", prompt, max_steps=4)] == expected(prompt, 4)
        assert js.generate("gen", [7], max_steps=1).tolist() == expected([7], 1)
        assert server.stats().compiles == compiles, "nothing compiles after warm-up"


MANY_WEIGHTS = {  # vectors and scalars of three dtypes, matrices, a vector too long to pack, a Python scalar
    "layers": [{"bias": np.arange(i, i + 5, dtype=np.float32), "gain": np.full(3, i, np.int32),
                "half": np.arange(4).astype(np.float16), "one": np.int32(i), "w": np.full((2, 3), i, np.float32)}
               for i in range(4)],
    "long": np.arange(PACKED_ELEMENTS + 7, dtype=np.float32) % 3,
    "mix": 2.0,
}


def weights_checksum(params):
    """A whole number that changes if a leaf of MANY_WEIGHTS comes in another place, shape or order; below
    2**24, so float32 sums it exactly in any order."""
    total = jnp.float32(0)
    for i, leaf in enumerate(jax.tree_util.tree_leaves(params)):
        leaf = jnp.asarray(leaf)
        positions = jnp.arange(leaf.size, dtype=jnp.float32).reshape(leaf.shape) % 7
        total += (i + 1) * jnp.sum(leaf.astype(jnp.float32) * positions)
    return total


def test_packed_layout_passes_small_weights_in_one_array_per_dtype():
    layout = PackedLayout(templates_of(MANY_WEIGHTS))
    packed = layout.pack(MANY_WEIGHTS)
    assert [str(t) for t in layout.templates] == ["float32(20)", "int32(16)", "float16(16)",
                                                   *["float32(2, 3)"] * 4, "float32(65543)", "float32()"]
    assert [t.weak_type for t in layout.templates] == [False] * 8 + [True]
    assert packed[3] is MANY_WEIGHTS["layers"][0]["w"] and packed[7] is MANY_WEIGHTS["long"], "as given"
    unpacked = layout.unpack(packed)
    assert jax.tree_util.tree_structure(unpacked) == jax.tree_util.tree_structure(MANY_WEIGHTS)
    for got, given in zip(jax.tree_util.tree_leaves(unpacked), jax.tree_util.tree_leaves(MANY_WEIGHTS)):
        assert np.asarray(got).dtype == np.asarray(given).dtype and np.array_equal(got, given)
    traced = jax.jit(lambda arrays: weights_checksum(layout.unpack(arrays)))(packed)
    assert float(traced) == float(weights_checksum(MANY_WEIGHTS))


def test_a_matrix_read_only_transposed_travels_transposed_and_unpacks_as_given():
    """issue 57: ``x @ w.T`` on a stored (out, in) matrix made XLA's CPU matrix-vector product copy the whole
    matrix into the other layout at every decode step; such a matrix now travels transposed."""
    weights = {"linear": np.arange(6, dtype=np.float32).reshape(2, 3), "table": np.ones((4, 3), np.float32),
               "both": np.ones((3, 3), np.float32), "bias": np.ones(2, np.float32)}
    x = js.Template((1, 3), np.float32)

    def forward(params, x):
        rows = params["table"][jnp.array([0, 1])]  # a gather: kept as stored
        both = x @ params["both"] + x @ params["both"].T  # read both ways: kept as stored
        return x @ params["linear"].T + params["bias"] + rows.sum() + both.sum()

    template = templates_of(weights)
    transposed = transposed_reads(forward, template, x)
    order = sorted(weights)  # the flattening order of a dict: its sorted keys
    assert [order[i] for i in transposed] == ["linear"]
    layout = PackedLayout(template, transposed)
    assert str(layout.templates[order.index("linear")]) == "float32(3, 2)", "it travels as (in, out)"
    packed = layout.pack(weights)
    for got, given in zip(jax.tree_util.tree_leaves(layout.unpack(packed)), jax.tree_util.tree_leaves(weights)):
        assert np.array_equal(got, given)
    value = np.array([[1.0, 2.0, 3.0]], np.float32)
    assert np.array_equal(jax.jit(lambda arrays, x: forward(layout.unpack(arrays), x))(packed, value),
                          forward(weights, value))


def written_prefill(params, tokens, length):
    """Starts each sequence's state from a zero row kept in the weights, its first token written at its
    last position: its first output is that token, unless another request's write is still there."""
    row = jax.lax.dynamic_update_slice(params["empty"], tokens[:1].astype(jnp.float32), (length - 1,))
    return {"row": row}, row.sum().astype(jnp.int32)


def written_decode(params, state, last):
    return state, (state["row"].sum(axis=1).astype(jnp.int32) + last) % VOCAB


@pytest.mark.parametrize("compiler", ["xla", "iree"])
def test_a_prefill_that_writes_into_a_copy_of_a_weight_leaves_the_weight_as_it_is(compiler):
    """The weights travel packed, so ``params["empty"]`` is a slice of one array: on IREE the write once
    reached the resident weights (iree-org/iree#16168), and each prompt's first output carried the first
    tokens of the prompts before it."""
    generation = js.Generation(written_prefill, written_decode, params={"empty": np.zeros(16, np.float32)},
                               slots=2, max_length=16, prefill_lengths=[8], compiler=compiler)
    with js.serve(generation, name=f"gen-written-{compiler}"):
        firsts = [js.generate(f"gen-written-{compiler}", [token] + [1] * extra, max_steps=2).tolist()
                  for token, extra in ((5, 0), (7, 1), (9, 2), (11, 3))]
    assert firsts == [[5, 10], [7, 14], [9, 18], [11, 22]]


@pytest.mark.parametrize("compiler", ["xla", "iree", "evaluator"])
def test_weights_of_many_leaves_reach_prefill_and_decode_as_given(compiler):
    """The programs take the weights packed into few arrays; prefill and decode get them back as given."""
    checksum = int(weights_checksum(MANY_WEIGHTS))

    def weighed_prefill(params, tokens, length):
        state, first = prefill(PARAMS, tokens, length)
        return state, (first + weights_checksum(params).astype(jnp.int32)) % VOCAB

    def weighed_decode(params, state, last):
        state, outputs = decode(PARAMS, state, last)
        return state, (outputs + weights_checksum(params).astype(jnp.int32)) % VOCAB

    weighed = js.Generation(weighed_prefill, weighed_decode, params=MANY_WEIGHTS, slots=2, max_length=32,
                            prefill_lengths=[8], compiler=compiler)
    prompt = np.array([3, 1, 4], np.int32)
    total, position = int(np.sum(prompt)), prompt.size
    wanted = [(total % VOCAB + checksum) % VOCAB]
    for _ in range(4):
        total, position = total + wanted[-1] + position, position + 1
        wanted.append((total % VOCAB + checksum) % VOCAB)
    with js.serve(weighed, name="gen-weighed"):
        assert js.generate("gen-weighed", prompt, max_steps=5).tolist() == wanted


def test_warm_up_runs_every_program_once_where_a_first_run_costs_extra(monkeypatch):
    """A GPU loads a program's kernels and builds its command buffers on its first run: there warm-up runs
    each prefill, update and step once, on idle slots, so that no request pays for it, and outputs are
    unchanged. A CPU has no such cost (XLA says so, and nothing runs); CI has no GPU, so the compiler's
    answer for one is stood in."""
    ran = []

    def seen_prefill(params, tokens, length):
        jax.debug.callback(lambda t: ran.append(("prefill", t.shape[0])), tokens)
        return prefill(params, tokens, length)

    def seen_decode(params, state, last):
        jax.debug.callback(lambda: ran.append(("decode", None)))
        return decode(params, state, last)

    seen = js.Generation(seen_prefill, seen_decode, params=PARAMS, slots=4, max_length=64, prefill_lengths=[8, 16])
    with js.serve(seen, name="gen-warm-default"):  # on this CPU nothing runs; on a GPU every program does
        assert bool(ran) == compilers.get("xla").first_run_costs({})
    ran.clear()
    monkeypatch.setattr(XlaCompiler, "first_run_costs", lambda self, options: True)
    with js.serve(seen, name="gen-warm"):
        assert set(ran) == {("prefill", 8), ("prefill", 16), ("decode", None)}
        prompt = np.array([2, 7, 1], np.int32)
        assert js.generate("gen-warm", prompt, max_steps=5).tolist() == expected(prompt, 5)


def test_warm_up_logs_each_compiled_program_naming_the_generation_as_a_servings_does(caplog):
    caplog.set_level(logging.INFO)
    with js.serve(generation(), name="gen-shown") as shown, js.serve(
            js.Serving(lambda x: x + 1, batch_size=2, input_template=js.template((3,), "float32")), name="plus"):
        compiles = shown.stats().compiles
    lines = [record.getMessage() for record in caplog.records]
    compiled = [line for line in lines if line.startswith("generation server gen-shown: compiled ")]
    assert len(compiled) == compiles == 2 * 3 + 3 + 1, lines
    assert any(line.startswith("generation server gen-shown: compiled the prefill of 2 prompts of 16 tokens in ")
               for line in compiled)
    assert any(line.startswith("generation server gen-shown: compiled a decode step of 4 slots in ")
               for line in compiled)
    assert [line.split(" in ")[0] for line in lines if line.startswith("server plus: ")] == [
        "server plus: compiled batch size 1 on partition 0", "server plus: compiled batch size 2 on partition 0"]
    paged = js.Generation(forward=paged_forward, cache=js.PagedCache(layers=1, kv_heads=1, head_dim=2,
                                                                     dtype="float32", block_size=4),
                          params=PARAMS, slots=2, max_length=16, prefill_lengths=[8], logits=True)
    caplog.clear()
    with js.serve(paged, name="gen-paged") as server:
        compiles = server.stats().compiles
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("generation server gen-paged: ")]
    assert len(compiled) == compiles and all(any(
        f" compiled the decode launch of {rows}, sampled in " in line for line in compiled)
        for rows in ("1 sequence", "2 sequences")), compiled


def paged_forward(params, cache, tokens, positions, tables, last):
    """A paged forward that keeps nothing: each row's next token is its last position's, plus one."""
    picked = jnp.take_along_axis(positions, last[:, None], axis=1)[:, 0] + 1
    return cache, -jnp.abs(jnp.arange(VOCAB)[None, :] - picked[:, None] % VOCAB).astype(jnp.float32)


def pieces(server, prompt, max_steps):
    """The typed pieces a door reads of one request: each piece's item and outputs so far, then the reason."""
    async def main():
        items = server.pieces_async(Prompt(prompt, max_steps), prompt)
        return [(int(piece.item), piece.outputs) if piece.item is not None else piece.finish_reason
                async for piece in items]
    return asyncio.run(main())


def test_eos_max_steps_and_max_length_stop_exactly():
    """Each end, and the reason the engine gives for it: ``stop`` at an end token, ``length`` at the last output
    needed (``max_steps``, or what fits ``max_length``)."""
    prompt = np.array([2, 7], np.int32)
    free_run = expected(prompt, 30)
    eos = free_run[5]
    with js.serve(generation(eos=eos), name="gen-eos") as server:
        got = js.generate("gen-eos", prompt, max_steps=30).tolist()
        assert pieces(server, prompt, 30) == [*((token, i + 1) for i, token in enumerate(got)), "stop"]
        assert pieces(server, prompt, 3)[-1] == "length"
    assert got == free_run[:free_run.index(eos) + 1] and got[-1] == eos, "the eos output is the last one returned"
    stops = [free_run[9], free_run[4]]  # several end tokens: the first of any ends it
    with js.serve(generation(eos=stops), name="gen-eos-list"):
        got = js.generate("gen-eos-list", prompt, max_steps=30).tolist()
    assert got == free_run[:min(free_run.index(stop) for stop in stops) + 1] and got[-1] in stops
    with js.serve(generation(max_length=12, prefill_lengths=[12]), name="gen-max") as server:
        assert len(js.generate("gen-max", np.arange(10, dtype=np.int32), max_steps=50)) == 2  # 10 + 2 = 12
        assert pieces(server, np.arange(10, dtype=np.int32), 50)[-1] == "length"
        assert len(js.generate("gen-max", [1], max_steps=3)) == 3


def random_requests(seed: int, count: int, most_steps: int) -> tuple[list[np.ndarray], list[int]]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 50, int(rng.integers(1, 16))).astype(np.int32) for _ in range(count)]
    return prompts, [int(rng.integers(1, most_steps)) for _ in prompts]


def generate_concurrently(name: str, prompts: list[np.ndarray], steps: list[int]) -> dict[int, list[int]]:
    """Every prompt's outputs, each request on its own thread, all at once."""
    results: dict[int, list[int]] = {}

    def call(i):
        results[i] = js.generate(name, prompts[i], max_steps=steps[i]).tolist()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def test_outputs_do_not_depend_on_the_requests_sharing_the_steps():
    prompts, steps = random_requests(0, 31, 40)
    with js.serve(generation(slots=8), name="gen-mix") as server:
        alone = [js.generate("gen-mix", prompts[0], max_steps=steps[0]).tolist()]
        results = generate_concurrently("gen-mix", prompts, steps)
        stats = server.stats()
    assert results[0] == alone[0]
    for i, prompt in enumerate(prompts):
        assert results[i] == expected(prompt, steps[i]), i
    assert stats.max_slots_busy <= 8
    assert stats.max_slots_busy > 1, "requests shared steps"


def test_slots_freed_by_eos_and_max_steps_take_new_requests_with_no_mix_up():
    """The loop queues a step before it delivers the previous one: a slot whose last step is queued takes
    the next prompt at once, one whose request ended at eos is seen a step late (that output dropped)."""
    prompts, steps = random_requests(1, 24, 30)
    eos = 33  # ends 6 of them early
    with js.serve(generation(slots=3, eos=eos), name="gen-reuse") as server:
        results = generate_concurrently("gen-reuse", prompts, steps)
        stats = server.stats()
    assert sum(result[-1] == eos and len(result) < steps[i] for i, result in results.items()) == 6
    for i, prompt in enumerate(prompts):
        assert results[i] == expected(prompt, steps[i], eos=eos), i
    assert stats.outputs == sum(len(result) for result in results.values()), "dropped outputs are not counted"
    assert stats.slots_busy == 0 and stats.max_slots_busy <= 3


@pytest.mark.parametrize("compiler", ["xla", "iree", "eager"])
def test_several_steps_per_launch_give_each_request_the_outputs_of_one_step_at_a_time(compiler):
    """Launches of 3 steps: requests end mid-launch at eos or max_steps (what was computed for them after is
    dropped), slots take new prompts between launches, and nothing else changes, compiles included."""
    prompts, steps = random_requests(2, 24, 30)
    eos = 33
    with js.serve(generation(slots=3, eos=eos, steps_per_launch=3, compiler=compiler), name="gen-launch") as server:
        compiles = server.stats().compiles
        assert compiles == (0 if compiler == "eager" else 2 * 3 + 3 + 1)
        results = generate_concurrently("gen-launch", prompts, steps)
        assert [int(o) for o in js.generate_stream("gen-launch", prompts[0], max_steps=4)] == expected(prompts[0], 4)
        stats = server.stats()
    for i, prompt in enumerate(prompts):
        assert results[i] == expected(prompt, steps[i], eos=eos), i
    assert sum(result[-1] == eos and len(result) < steps[i] for i, result in results.items()) == 4
    assert stats.steps % 3 == 0 and stats.compiles == compiles and stats.slots_busy == 0
    assert stats.outputs == sum(len(result) for result in results.values()) + 4


HOLD_AT = 300  # a step of the two failing streams (of 400) that waits until they are told to fail


def fail_two_streams(name, failing, released, error, match):
    """Two streams of generation server ``name`` past their first outputs; then ``failing`` is set until
    each has ended with ``error``. ``released`` is set with it, for good: the server's steps from HOLD_AT on
    wait for it, so that neither stream ends on its own first, however slowly this thread runs."""
    streams = [js.generate_stream(name, [1, 2], max_steps=400) for _ in range(2)]
    for stream in streams:
        next(stream)
    failing.set()
    released.set()
    for stream in streams:
        with pytest.raises(error, match=match):
            for _ in stream:
                pass
    failing.clear()


def test_a_failing_step_fails_the_requests_it_ran_and_the_server_goes_on():
    failing, released = threading.Event(), threading.Event()

    def fragile_decode(params, state, last):
        if np.max(state["position"]) >= HOLD_AT:
            released.wait(HANG_S)
        if failing.is_set():
            raise ValueError("decode failed on purpose")
        return {"position": state["position"] + 1, "total": state["total"] + 1}, np.asarray(last) + 1

    fragile = js.Generation(prefill, fragile_decode, params=PARAMS, slots=2, max_length=512, prefill_lengths=[8],
                            compiler="eager")
    with js.serve(fragile, name="gen-fragile") as server:
        fail_two_streams("gen-fragile", failing, released, ValueError, "decode failed on purpose")
        assert js.generate("gen-fragile", [5], max_steps=3).tolist() == [5, 6, 7]
        stats = server.stats()
    assert stats.errors == 1 and stats.slots_busy == 0


def test_a_step_that_fails_on_the_device_fails_its_requests_and_the_server_goes_on(monkeypatch):
    """A computation that fails after its launch (a GPU's asynchronous error) surfaces when the loop reads
    its outputs, a step later. XLA runs a CPU's computations at launch, so here the read is made to fail."""
    failing, released, reads = threading.Event(), threading.Event(), [0]
    read = generation_server.owned_host_array

    def fragile_read(outputs):
        reads[0] += 1  # one a step (or a prefill)
        if reads[0] >= HOLD_AT:
            released.wait(HANG_S)
        if failing.is_set():
            raise RuntimeError("device failed on purpose")
        return read(outputs)

    monkeypatch.setattr(generation_server, "owned_host_array", fragile_read)
    with js.serve(generation(slots=2, max_length=512), name="gen-device-fail") as server:
        fail_two_streams("gen-device-fail", failing, released, RuntimeError, "device failed on purpose")
        assert js.generate("gen-device-fail", [5], max_steps=3).tolist() == expected([5], 3), "the server goes on"
        stats = server.stats()
    assert stats.errors >= 1 and stats.slots_busy == 0


def paced(permits: threading.Semaphore, slots: int, **options) -> js.Generation:
    """A generation run as written (eager) whose decode steps once per permit: a test decides how many steps
    run before what it checks, whatever the machine's speed. Each output repeats the prompt's sum."""
    def paced_decode(params, state, last):
        assert permits.acquire(timeout=60), "no permit for a step"
        return {"position": state["position"] + 1, "total": state["total"] + 1}, np.asarray(last) + 0

    return js.Generation(prefill, paced_decode, params=PARAMS, slots=slots, max_length=512, prefill_lengths=[8],
                         compiler="eager", **options)


def test_a_short_request_that_arrives_later_finishes_before_the_long_ones():
    """Three long requests are decoding when a short one arrives: it takes a free slot at the next step and
    ends while they go on. The steps it needs are allowed, far fewer than the long ones need."""
    permits = threading.Semaphore(3)  # the long ones' first outputs, whether admitted together or not
    with js.serve(paced(permits, slots=4), name="gen-slow") as server:
        long_ones = [server.outputs(server.submit(np.array([1, 2], np.int32), 60), None) for _ in range(3)]
        assert [int(next(stream)) for stream in long_ones] == [3] * 3, "the long ones are decoding"
        short = server.outputs(server.submit(np.array([4], np.int32), 3), None)
        permits.release(10)  # the step running now, the short one's 2 steps, and the one queued before delivery
        *outputs, end = short
        assert [int(output) for output in outputs] == [4] * 3 and end == End("length")
        assert server.stats().slots_busy == 3, "the long ones go on"
        permits.release(1000)
        assert [len(list(stream)) for stream in long_ones] == [59 + 1] * 3, "59 outputs more, then the end"
        assert server.stats().compiles == 0


def test_a_closed_stream_frees_its_slot_at_the_next_step():
    """Two steps give the stream its first two outputs (a step is queued before the one before it is
    delivered); closed then, its request runs at most the step queued meanwhile (the third, which waits for
    a permit until the stream is closed), and the next prompt takes the slot."""
    permits = threading.Semaphore(2)
    with js.serve(paced(permits, slots=1), name="gen-cancel") as server:
        stream = js.generate_stream("gen-cancel", [1], max_steps=400)
        assert [int(next(stream)) for _ in range(2)] == [1, 1]
        stream.close()
        permits.release(1000)
        assert js.generate("gen-cancel", [5], max_steps=2).tolist() == [5, 5], "the one slot was free again"
    stats = server.stats()
    assert stats.cancelled == 1 and stats.steps in (2 + 1, 3 + 1), "2 or 3 of the closed request, 1 next"


def test_a_closed_stream_frees_its_slot_at_the_next_launch_of_several_steps():
    """Launches of 4 steps: 6 outputs are delivered once 3 launches are queued; closed then, the request
    runs at most the launch queued meanwhile, and the next prompt takes the slot."""
    permits = threading.Semaphore(3 * 4)
    with js.serve(paced(permits, slots=1, steps_per_launch=4), name="gen-cancel-launch") as server:
        stream = js.generate_stream("gen-cancel-launch", [1], max_steps=400)
        assert [int(next(stream)) for _ in range(6)] == [1] * 6
        stream.close()
        permits.release(1000)
        assert js.generate("gen-cancel-launch", [5], max_steps=6).tolist() == [5] * 6
    stats = server.stats()
    assert stats.cancelled == 1 and stats.steps in (3 * 4 + 2 * 4, 4 * 4 + 2 * 4), "3 or 4 launches, 2 next"


def test_update_params_swaps_the_weights_between_requests_under_load_without_a_compile():
    """Every request is generated entirely by one set of weights; each update returns once its set is live.
    Each update waits until a caller was answered by the weights before it, however fast the machine."""
    prompts, steps = random_requests(3, 8, 40)
    answers, failures, stop_load = [], [], threading.Event()

    def caller(i):
        while not stop_load.is_set():
            try:
                answers.append((i, js.generate("gen-swap", prompts[i], max_steps=steps[i]).tolist()))
            except Exception as error:
                failures.append(error)
                return

    def answered_by(scale, since):
        """Whether a caller was answered by ``scale`` in the answers from ``since`` on (or one failed)."""
        return failures or any(got == expected(prompts[i], steps[i], scale=scale) for i, got in answers[since:])

    with js.serve(generation(slots=3), name="gen-swap") as server:
        compiles = server.stats().compiles
        threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        try:
            since = 0
            for before, scale in zip([1, 2, 1, 3, 2, 1], [2, 1, 3, 2, 1, 3]):
                until(lambda: answered_by(before, since), f"a caller answered by scale {before}")
                since = len(answers)
                server.update_params({"scale": np.int32(scale)})
                assert js.generate("gen-swap", prompts[0], max_steps=9).tolist() == expected(prompts[0], 9, scale=scale)
            until(lambda: answered_by(3, since), "a caller answered by scale 3")
        finally:
            stop_load.set()
            for thread in threads:
                thread.join(HANG_S)
        with pytest.raises(js.TemplateMismatchError) as info:
            server.update_params({"scale": np.float32(2)})
        assert str(info.value) == "params['scale']: expected int32(), got float32()"
        with pytest.raises(js.OptionError) as info:
            server.reload_params()
        assert str(info.value) == ("server 'gen-swap' was given its weights as arrays, not as a file "
                                   "(params=PATH), so there is no file to reload them from")
        assert js.generate("gen-swap", prompts[0], max_steps=9).tolist() == expected(prompts[0], 9, scale=3)
        assert server.stats().compiles == compiles
    assert not failures
    by_scale = {scale: {i for i, got in answers if got == expected(prompts[i], steps[i], scale=scale)}
                for scale in (1, 2, 3)}
    assert all(got in [expected(prompts[i], steps[i], scale=scale) for scale in (1, 2, 3)] for i, got in answers)
    assert all(by_scale.values()), "requests ran with every set of weights"


def test_an_update_waits_for_the_requests_in_slots_and_new_prompts_wait_for_it():
    """Each output repeats the first, the prompt's sum times the scale. The running request steps only as
    the test allows: it is in its slot, whatever the machine's speed, while the update and a new prompt wait;
    the loop steps on with that prompt queued and a slot free, and does not admit it."""
    permits = threading.Semaphore(2)  # two steps give the first two outputs (one is queued before delivery)
    with js.serve(paced(permits, slots=2), name="gen-swap-wait") as server:
        stream = js.generate_stream("gen-swap-wait", [1, 2], max_steps=25)
        assert int(next(stream)) == 3
        updated = threading.Thread(target=server.update_params, args=({"scale": np.int32(5)},))
        updated.start()
        until(lambda: server._new_params is not None, "the update to wait for the slots to run empty")
        later: list[list[int]] = []
        queued = threading.Thread(target=lambda: later.append(js.generate("gen-swap-wait", [1, 2],
                                                                          max_steps=2).tolist()))
        queued.start()
        until(lambda: server.stats().queue_depth == 1, "the new prompt to be queued")
        permits.release(2)
        assert [int(next(stream)) for _ in range(3)] == [3] * 3  # the last after a turn planned with it queued
        assert updated.is_alive(), "the update waits for the request in its slot"
        assert server.stats().queue_depth == 1, "a free slot takes no prompt while new weights wait"
        permits.release(1000)
        assert [int(o) for o in stream] == [3] * 21, "a running request keeps its weights to its end"
        updated.join(HANG_S)
        queued.join(HANG_S)
        assert later == [[15, 15]], "a prompt queued meanwhile runs with the new weights"
    with pytest.raises(js.ServerStoppedError):
        server.update_params({"scale": np.int32(2)})


def test_text_in_and_out_through_preprocess_and_postprocess():
    def encode(text):  # a byte-level tokenizer, run by the caller
        return np.frombuffer(text.encode(), np.uint8).astype(np.int32)

    def piece(token):  # a token's text, run by the caller per output
        return bytes([32 + int(token) % 95])

    want = [piece(token) for token in expected(encode("héllo"), 6)]
    with js.serve(generation(preprocess=encode, postprocess=piece), name="gen-text"):
        whole = js.generate("gen-text", "héllo", max_steps=6)
        assert whole.dtype == object and whole.tolist() == want
        assert list(js.generate_stream("gen-text", "héllo", max_steps=6)) == want
        assert asyncio.run(js.generate_async("gen-text", "héllo", max_steps=6)).tolist() == want
        text = b"".join(piece(token) for token in expected(encode("héllo"), 30))
        stop = text[7:9]  # across two pieces
        cut = text[:text.index(stop)]
        assert b"".join(js.generate("gen-text", "héllo", max_steps=30, stop=stop.decode())) == cut
        assert b"".join(js.generate_stream("gen-text", "héllo", max_steps=30, stop=[b"\x00", stop])) == cut
        assert b"".join(asyncio.run(js.generate_async("gen-text", "héllo", max_steps=30, stop=stop))) == cut
        # a stop sequence that never comes: what was held back (the last piece, its first byte) goes out at the end
        assert b"".join(js.generate("gen-text", "héllo", max_steps=30, stop=text[-1:] + b"\x00")) == text
        assert js.generate("gen-text", "héllo", max_steps=30, stop=text[:1]).tolist() == []
        for stop, message in [("", "stop must be a non-empty string or a list of them, got ''"),
                              (7, "stop must be a non-empty string or a list of them, got 7")]:
            with pytest.raises(js.OptionError) as info:
                js.generate("gen-text", "héllo", max_steps=3, stop=stop)
            assert str(info.value) == message
    with js.serve(generation(), name="gen-no-text"):
        with pytest.raises(js.OptionError) as info:
            js.generate("gen-no-text", [1, 2], max_steps=3, stop="x")
        assert str(info.value) == ("stop needs a generation whose postprocess gives text; this one gives its "
                                   "outputs as they are")
    with pytest.raises(js.OptionError) as info:
        generation(postprocess="detokenize")
    assert str(info.value) == "postprocess must be a function or None, got str"


def test_a_closed_async_stream_frees_its_slot_at_the_next_step():
    permits = threading.Semaphore(2)  # as test_a_closed_stream_frees_its_slot_at_the_next_step

    async def main():
        stream = js.generate_stream_async("gen-cancel-async", [1], max_steps=400)
        assert [int(await anext(stream)) for _ in range(2)] == [1, 1]
        await stream.aclose()
        permits.release(1000)
        return await js.generate_async("gen-cancel-async", [5], max_steps=2)

    with js.serve(paced(permits, slots=1), name="gen-cancel-async") as server:
        assert asyncio.run(main()).tolist() == [5, 5], "the one slot was free again"
    stats = server.stats()
    assert stats.cancelled == 1 and stats.steps in (2 + 1, 3 + 1)


def test_async_forms():
    async def main():
        first = await js.generate_async("gen-async", np.array([4, 4], np.int32), max_steps=5)
        streamed = [int(o) async for o in js.generate_stream_async("gen-async", np.array([4, 4], np.int32),
                                                                   max_steps=5)]
        return first.tolist(), streamed

    with js.serve(generation(), name="gen-async"):
        first, streamed = asyncio.run(main())
    assert first == streamed == expected([4, 4], 5)


def test_the_asyncio_streams_of_one_loop_get_each_step_in_one_wake_up(monkeypatch):
    """A network front's event loop holds every caller's stream: each hand-over of a launch's outputs reaches
    all the streams of one loop in one ``call_soon_threadsafe`` (each is a write to the loop's wake-up pipe),
    not one per stream. Counted per hand-over, on the server's side: how the steps and the callers interleave
    does not matter. Decode waits until the four requests are in, so that later steps carry all four."""
    everyone_in = threading.Event()
    hand_overs = []  # per hand-over: the streams it feeds, the items, the loop's wake-ups it made
    wake_ups = [0]
    put_all = delivery.put_all

    def counted_put_all(deliveries):
        before = wake_ups[0]
        put_all(deliveries)
        hand_overs.append((len({id(stream) for stream, _ in deliveries}), len(deliveries), wake_ups[0] - before))

    def waiting_decode(params, state, last):
        assert everyone_in.wait(60)
        return decode(params, state, last)

    async def main(server):
        loop = asyncio.get_running_loop()
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            wake_ups[0] += 1
            return call_soon_threadsafe(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted
        calls = [asyncio.ensure_future(js.generate_async("gen-wake", [i + 1], max_steps=20)) for i in range(4)]
        while server.stats().requests < 4:
            await asyncio.sleep(0.001)
        everyone_in.set()
        return await asyncio.gather(*calls)

    monkeypatch.setattr(delivery, "put_all", counted_put_all)
    waiting = js.Generation(prefill, waiting_decode, params=PARAMS, slots=4, max_length=64, prefill_lengths=[8],
                            compiler="eager")
    with js.serve(waiting, name="gen-wake") as server:
        outputs = asyncio.run(main(server))
    assert [o.tolist() for o in outputs] == [expected([i + 1], 20) for i in range(4)]
    assert sum(items for _, items, _ in hand_overs) == 4 * 21  # 20 outputs and the end of each stream
    assert all(calls == (1 if items else 0) for _, items, calls in hand_overs), hand_overs
    assert max(streams for streams, _, _ in hand_overs) == 4, "a step's hand-over carries all four streams"


def test_bad_input_is_a_clear_error_and_the_server_keeps_generating():
    with js.serve(generation(), name="gen-bad"):
        with pytest.raises(js.BatchError) as info:
            js.generate("gen-bad", np.array([], np.int32), max_steps=3)
        assert str(info.value) == "the prompt is empty; send at least one token"
        with pytest.raises(js.PromptTooLongError) as info:
            js.generate("gen-bad", np.zeros(17, np.int32), max_steps=3)
        assert str(info.value) == ("the prompt has 17 tokens, more than the longest prefill length (16; "
                                   "max_length is 64)")
        with pytest.raises(js.BatchError) as info:
            js.generate("gen-bad", np.array([1.5, 2.0]), max_steps=3)
        assert str(info.value) == "a prompt must be a 1-D array of integer token ids; got float64(2)"
        with pytest.raises(js.OptionError) as info:
            js.generate("gen-bad", [1], max_steps=0)
        assert str(info.value) == "max_steps must be a positive integer, got 0"
        assert js.generate("gen-bad", [1], max_steps=2).tolist() == expected([1], 2)
    with js.serve(js.Serving(lambda x: x), name="not-gen"), pytest.raises(js.OptionError) as info:
        js.generate("not-gen", [1], max_steps=2)
    assert str(info.value) == "server 'not-gen' serves a js.Serving, not a js.Generation: call js.batched_run"


def test_options_are_checked():
    with pytest.raises(js.OptionError) as info:
        generation(prefill_lengths=[8, 128])
    assert str(info.value) == "prefill_lengths must be positive and at most max_length (64), got [8, 128]"
    with pytest.raises(js.OptionError) as info:
        generation(slots=0)
    assert str(info.value) == "slots must be a positive integer, got 0"
    with pytest.raises(js.OptionError) as info:
        generation(steps_per_launch=0)
    assert str(info.value) == "steps_per_launch must be a positive integer, got 0"
    for eos, got in [([[33, 34]], "int64(1, 2)"), (1.5, "float64()"), ([], "float64(0)"), ([33, 2**40], "int64(2)")]:
        with pytest.raises(js.OptionError) as info:
            js.serve(generation(eos=eos), name="gen-bad-eos")
        assert str(info.value) == (f"eos must be one output of this generation, int32(), or a list of them; "
                                   f"got {eos!r} ({got})")
    with js.serve(generation(eos=np.int64(33)), name="gen-int64-eos"):
        prompt = np.array([1, 2], np.int32)
        assert js.generate("gen-int64-eos", prompt, max_steps=40).tolist() == expected(prompt, 40, eos=33)


# sampling -----------------------------------------------------------------------------------------------

def logits_prefill(params, tokens, length):
    """The toy model's next id as peaked logits: the greedy token is the int model's output."""
    state, token = prefill(params, tokens, length)
    return state, peaked(token)


def logits_decode(params, state, last):
    state, token = decode(params, state, last)
    return state, jax.vmap(peaked)(token)


def peaked(token):
    return -jnp.abs(jnp.arange(VOCAB) - token).astype(jnp.float32) / 4.0


def sampled(compiler="xla", **options):
    return js.Generation(logits_prefill, logits_decode, params=PARAMS, slots=options.pop("slots", 4),
                         max_length=64, prefill_lengths=[8, 16], logits=True, compiler=compiler, **options)


@pytest.mark.parametrize("compiler", ["xla", "eager"])
def test_a_logits_generation_is_greedy_by_default_and_samples_per_request_on_request(compiler):
    prompt = np.array([3, 1, 4, 1, 5], np.int32)
    with js.serve(sampled(compiler), name="sampled") as server:
        compiles = server.stats().compiles
        # prefill per (length, prompts); a greedy, a sampling and a scoring update per prompts and step; the
        # penalties' start
        assert compiles == (0 if compiler == "eager" else 2 * 3 + 3 * 3 + 3 + 1)
        assert js.generate("sampled", prompt, max_steps=10).tolist() == expected(prompt, 10)
        assert js.generate("sampled", prompt, max_steps=10, temperature=5.0, top_k=1).tolist() == \
            expected(prompt, 10), "top_k=1 is greedy at any temperature"
        first = js.generate("sampled", prompt, max_steps=20, temperature=2.0, seed=7).tolist()
        assert js.generate("sampled", prompt, max_steps=20, temperature=2.0, seed=7).tolist() == first
        assert js.generate("sampled", prompt, max_steps=20, temperature=2.0, seed=8).tolist() != first
        assert first != expected(prompt, 20)
        assert server.stats().compiles == compiles, "greedy and sampled steps compiled at warm-up"


def test_only_steps_with_a_sampled_request_run_the_sampling_program(monkeypatch):
    """The host picks greedy or sampling per step (a lax.cond on the device would stall a GPU's pipeline):
    greedy requests alone never reach the sampler; eager runs it as a jitted function, traced on first use."""
    traced = []

    def sample_tokens(*arguments):
        traced.append(arguments[0].shape)
        return real(*arguments)

    real = programs.sample_tokens
    monkeypatch.setattr(programs, "sample_tokens", sample_tokens)
    prompt = np.array([3, 1, 4], np.int32)
    with js.serve(sampled("eager", slots=2), name="host-picks"):
        assert js.generate("host-picks", prompt, max_steps=6).tolist() == expected(prompt, 6)
        assert traced == [], "a greedy request ran the sampler"
        js.generate("host-picks", prompt, max_steps=3, temperature=1.0, seed=3)
        assert traced, "a sampled request did not run the sampler"


def test_stop_token_ids_end_a_request_and_min_tokens_holds_them_and_eos_back():
    prompt = np.array([3, 1, 4, 1, 5], np.int32)
    plain = expected(prompt, 12)
    stop = plain[3]
    with js.serve(sampled(eos=plain[1]), name="held") as server:
        compiles = server.stats().compiles
        assert js.generate("held", prompt, max_steps=12).tolist() == plain[:2], "eos is its second output"
        at_stop = js.generate("held", prompt, max_steps=12, stop_token_ids=[stop]).tolist()
        assert at_stop == plain[:2], "eos still ends it first"
        held = js.generate("held", prompt, max_steps=12, min_tokens=6, stop_token_ids=[stop, 96]).tolist()
        assert len(held) >= 6 and not {plain[1], stop, 96} & set(held[:6]), held
        assert held[0] == plain[0] and held[1] != plain[1], "the runner-up where eos would have come"
        assert js.generate("held", prompt, max_steps=12, min_tokens=6, temperature=0.7, seed=1,
                           stop_token_ids=[stop]).tolist()[:6].count(plain[1]) == 0
        assert js.generate("held", prompt, max_steps=12, ignore_eos=True).tolist() == plain, \
            "eos picked and kept, and the request goes on to max_steps"
        assert js.generate("held", prompt, max_steps=12, ignore_eos=True, stop_token_ids=[stop]).tolist() == \
            plain[:4], "its stop ids still end it"
        assert server.stats().compiles == compiles, "held ids are options of the sampling programs"
    with js.serve(sampled(), name="stops") as server:
        assert js.generate("stops", prompt, max_steps=12, stop_token_ids=[stop]).tolist() == plain[:4], \
            "a stop id is its last output"
    for bad in ([-1], list(range(17)), [True], "7"):
        with pytest.raises(js.OptionError, match="stop_token_ids must be a list of at most 16 token ids"):
            js.Sampling(stop_token_ids=bad)
    with pytest.raises(js.OptionError, match=r"min_tokens must be an integer in \[0, 2147483648\)"):
        js.Sampling(min_tokens=-1)
    with pytest.raises(js.OptionError, match="ignore_eos must be True or False, got 'yes'"):
        js.Sampling(ignore_eos="yes")
    with js.serve(generation(eos=plain[1]), name="no-logits"):
        with pytest.raises(js.OptionError, match="cannot sample, hold back, bias or stop at token ids, give log-probabilities or penalize"):
            js.generate("no-logits", prompt, max_steps=4, min_tokens=2)
        assert js.generate("no-logits", prompt, max_steps=12, ignore_eos=True).tolist() == plain, \
            "the host ends a request at eos: ignoring it needs no logits"


def test_top_k_and_top_p_keep_to_the_most_likely_tokens():
    prompt = np.array([2, 7], np.int32)
    with js.serve(sampled(), name="kept"):
        for seed in range(5):
            tokens = js.generate_stream("kept", prompt, max_steps=1, temperature=3.0, top_k=3, seed=seed)
            assert abs(int(next(tokens)) - expected(prompt, 1)[0]) <= 1  # the 3 most likely: the peak and its 2
            # at temperature 0.5 the peak holds 24% of the probability, each neighbour 15%: top_p 0.2 keeps
            # the peak alone, 0.5 the peak and its neighbours
            assert js.generate("kept", prompt, max_steps=8, temperature=0.5, top_p=0.2, seed=seed).tolist() == \
                expected(prompt, 8)
            within = js.generate("kept", prompt, max_steps=1, temperature=0.5, top_p=0.5, seed=seed)
            assert abs(int(within[0]) - expected(prompt, 1)[0]) <= 1


def test_a_sampled_request_gives_the_same_tokens_alone_and_among_30_others():
    prompts = [np.array([5, index + 1, 3], np.int32) for index in range(31)]
    with js.serve(sampled(slots=8), name="shared"):
        alone = js.generate("shared", prompts[0], max_steps=24, temperature=1.5, top_p=0.9, seed=11).tolist()

        def options(index):  # the first as alone; then greedy and sampled neighbours of every kind
            if index == 0:
                return {"temperature": 1.5, "top_p": 0.9, "seed": 11}
            return {"temperature": 1.5 if index % 2 else 0.0, "top_k": index % 5, "top_p": 0.9, "seed": index}

        async def crowd():
            return await asyncio.gather(*(js.generate_async("shared", prompt, max_steps=24, **options(index))
                                          for index, prompt in enumerate(prompts)))

        together = asyncio.run(crowd())
        assert together[0].tolist() == alone
        for index in range(2, 31, 2):
            assert together[index].tolist() == expected(prompts[index], 24), "a greedy neighbour stays greedy"


def test_a_seeded_request_gives_the_same_tokens_in_launches_of_several_steps():
    prompts = [np.array([5, index + 1, 3], np.int32) for index in range(6)]
    options = {"temperature": 1.5, "top_p": 0.9, "seed": 11}
    tokens = {}
    for steps_per_launch in (1, 3):
        name = f"sampled-{steps_per_launch}"
        with js.serve(sampled(slots=4, steps_per_launch=steps_per_launch), name=name):
            async def crowd():
                return await asyncio.gather(*(js.generate_async(name, prompt, max_steps=20 + index, **options)
                                              for index, prompt in enumerate(prompts)))

            tokens[steps_per_launch] = [result.tolist() for result in asyncio.run(crowd())]
    assert tokens[3] == tokens[1]
    assert tokens[1][0] != expected(prompts[0], 20), "it sampled"


def scored_expected(prompt, steps, repetition=1.0, presence=0.0, frequency=0.0):
    """The toy model's greedy outputs under the penalties' rules, in NumPy (HF's repetition penalty over the
    prompt and the outputs, OpenAI's presence and frequency penalties over the outputs), each with the
    log-probabilities of the model's own logits: (token, log-probabilities) per output."""
    total, position, outputs, scored = int(np.sum(prompt)), len(prompt), [], []
    while len(outputs) < steps:
        logits = -np.abs(np.arange(VOCAB) - total % VOCAB).astype(np.float32) / np.float32(4.0)
        logprobs = logits - np.log(np.sum(np.exp(logits.astype(np.float64)))).astype(np.float32)
        seen = np.isin(np.arange(VOCAB), [*prompt, *outputs])
        counts = np.bincount(np.array(outputs, np.int64), minlength=VOCAB).astype(np.float32)
        penalized = np.where(seen, np.where(logits < 0, logits * np.float32(repetition),
                                            logits / np.float32(repetition)), logits)
        penalized = penalized - np.float32(presence) * (counts > 0) - np.float32(frequency) * counts
        token = int(np.argmax(penalized))
        scored.append((token, logprobs))
        outputs.append(token)
        total, position = total + token + position, position + 1
    return scored


@pytest.mark.parametrize("compiler", ["xla", "eager", "evaluator", "iree"])
def test_logprobs_and_penalties_follow_their_rules_on_every_compiler(compiler):
    prompt = np.array([3, 1, 4, 1, 5], np.int32)
    penalties = {"repetition_penalty": 2.0, "presence_penalty": 0.5, "frequency_penalty": 0.25}
    with js.serve(sampled(compiler), name=f"scored-{compiler}"):
        tokens, scores = js.generate(f"scored-{compiler}", prompt, max_steps=24, logprobs=3)
        assert tokens.tolist() == expected(prompt, 24), "log-probabilities change no token"
        penalized, penalized_scores = js.generate(f"scored-{compiler}", prompt, max_steps=24, logprobs=2,
                                                  **penalties)
        streamed = list(js.generate_stream(f"scored-{compiler}", prompt, max_steps=3, logprobs=1))
    for got, top, want in [(scores, 3, scored_expected(prompt, 24)),
                           (penalized_scores, 2, scored_expected(prompt, 24, 2.0, 0.5, 0.25))]:
        assert [score.token for score in got] == [token for token, _ in want]
        for score, (token, logprobs) in zip(got, want):
            assert score.logprob == pytest.approx(float(logprobs[token]), abs=1e-5)
            assert [lp for _, lp in score.top] == pytest.approx(np.sort(logprobs)[::-1][:top].tolist(), abs=1e-5)
            assert [lp for _, lp in score.top] == pytest.approx([float(logprobs[t]) for t, _ in score.top], abs=1e-5)
    assert penalized.tolist() != expected(prompt, 24), "the penalties changed the tokens"
    assert [len(scores) for _, scores in streamed] == [1, 1, 1], "each output with its own log-probabilities"
    assert [int(item) for item, _ in streamed] == expected(prompt, 3)


def test_sampling_options_are_checked():
    with js.serve(generation(), name="ids"):
        with pytest.raises(js.OptionError, match="cannot sample, hold back, bias or stop at token ids, give log-probabilities "
                                                 "or penalize tokens: its decode returns outputs, not logits"):
            js.generate("ids", [1, 2], max_steps=2, temperature=1.0)
        assert js.generate("ids", [1, 2], max_steps=2, temperature=0.0).tolist() == expected([1, 2], 2)
    for options, message in [({"temperature": -1.0}, "temperature must be a finite number >= 0"),
                             ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
                             ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\]"),
                             ({"top_k": -2}, r"top_k \(0: no limit\) must be an integer in \[0, 2147483648\)"),
                             ({"seed": 2**32}, r"seed must be an integer in \[0, 4294967296\)"),
                             ({"logprobs": -1}, r"logprobs \(the most likely tokens to give with each output, at "
                                                r"most 20; None: no log-probabilities\) must be an integer in "
                                                r"\[0, 21\), got -1"),
                             ({"logprobs": 21}, r"logprobs .* must be an integer in \[0, 21\), got 21"),
                             ({"repetition_penalty": 0.0}, r"repetition_penalty must be a finite number > 0 "
                                                           r"\(1: none\), got 0.0"),
                             ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number"),
                             ({"presence_penalty": 2.5}, r"presence_penalty must be a number from -2 to 2 "
                                                         r"\(0: none\), got 2.5"),
                             ({"frequency_penalty": -3}, r"frequency_penalty must be a number from -2 to 2 "
                                                         r"\(0: none\), got -3")]:
        with pytest.raises(js.OptionError, match=message):
            js.Sampling(**options)
    with pytest.raises(js.OptionError, match="must return a vector of float logits per prompt"):
        js.serve(js.Generation(prefill, decode, params=PARAMS, slots=2, max_length=64, prefill_lengths=[8],
                               logits=True), name="not-logits")
