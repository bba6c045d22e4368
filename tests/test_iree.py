"""jitserve.iree and compiler="iree": NxIREE's flows on the real IREE compiler and runtime."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jitserve as js

pytest.importorskip("iree.runtime")
from jitserve import iree

SEED_MLIR = (Path(__file__).resolve().parents[1] / "examples" / "cos_sin.mlir").read_text()  # NxIREE's example module
SEED_RESULT = [1.3817732, -1.2576177, -0.1485215, -1.4951146]
CPU_FLAGS = ["--iree-hal-target-backends=llvm-cpu", "--iree-input-type=stablehlo_xla",
             "--iree-execution-model=async-internal", "--iree-llvmcpu-target-cpu=host"]


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("JITSERVE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "jitserve-cache"))


def softmax(t):
    return jnp.exp(t) / jnp.sum(jnp.exp(t), axis=-1, keepdims=True)


def seed_inputs():
    return [np.array([1.0, 2.0, 3.0, 4.0], np.float32), np.array([1, -1, 1, -1], np.int32)]


def test_list_drivers_and_devices():
    drivers = iree.list_drivers()
    assert drivers["local-sync"] == "Local execution using a lightweight inline synchronous queue"
    assert drivers["local-task"] == "Local execution using the IREE multithreading task system"
    dev = iree.list_devices("local-task")[0]
    assert (dev.driver, dev.uri, dev.target_backend, dev.compiler) == ("local-task", "local-task://", "llvm-cpu", "iree")
    for gpu in ("cuda", "vulkan", "hip"):
        if gpu in drivers:
            assert isinstance(iree.list_devices(gpu), list), "a driver with no device gives [], never a crash"
    with pytest.raises(js.OptionError, match="unknown IREE driver 'metal-nope'"):
        iree.list_devices("metal-nope")


@pytest.mark.parametrize("driver", ["local-task", "local-sync"])
def test_seed_module_on_cpu_drivers(driver):
    module = iree.compile(SEED_MLIR, CPU_FLAGS, output_container=js.template((4,), "float32"))
    dev = iree.list_devices(driver)[0]
    out = iree.call(module, seed_inputs(), device=dev)
    np.testing.assert_allclose(np.asarray(out), SEED_RESULT, rtol=1e-6)
    assert module.input_templates() == [js.template((4,), "float32"), js.template((4,), "int32")]


def test_function_to_mlir_to_compile_to_call_softmax():
    x = np.arange(1000 * 1000 * 5, dtype=np.float32).reshape(1000, 1000, 5) / (1024 * 1024)
    lowered = js.to_mlir(softmax, [x])
    module = iree.compile(lowered.mlir_module, iree.default_flags("local-task"), output_container=lowered.output_container)
    out = iree.call(module, [x], device="local-task://")
    first = [0.1999996155500412, 0.19999980926513672, 0.20000000298023224, 0.20000018179416656, 0.20000037550926208]
    np.testing.assert_allclose(np.asarray(out)[0, 0], first, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(softmax)(x)), rtol=1e-5)


def test_iree_as_the_default_compiler_through_options():
    dev = iree.list_devices("local-task")[0]
    js.set_default_options(compiler="iree", iree_compiler_flags=iree.default_flags(dev),
                           iree_runtime_options={"device": dev})
    compiled_softmax = js.compile(softmax, [js.template((1000, 1000, 5), "float32")])
    x = np.arange(1000 * 1000 * 5, dtype=np.float32).reshape(1000, 1000, 5) / (1024 * 1024)
    out = compiled_softmax(x)
    assert type(out).__name__ == "DeviceArray", "results stay on the IREE device until asked for"
    np.testing.assert_allclose(np.asarray(out)[0, 0, 2], 0.2, rtol=1e-6)
    fn = js.defn(lambda a, unused, b: {"s": a + b, "p": a * b})
    result = fn(np.ones(3, np.float32), np.zeros(2), np.full(3, 2.0, np.float32))
    assert np.asarray(result["s"]).tolist() == [3, 3, 3] and np.asarray(result["p"]).tolist() == [2, 2, 2]
    assert fn.compiles == 1


def test_chained_calls_keep_results_on_the_device():
    module = iree.compile(SEED_MLIR, CPU_FLAGS, output_container=js.template((4,), "float32"))
    first = iree.call(module, seed_inputs())
    add_one = iree.compile(js.to_mlir(lambda t: t + 1, [js.template((4,), "float32")]).mlir_module,
                           output_container=js.template((4,), "float32"))
    second = iree.call(add_one, [first])
    np.testing.assert_allclose(np.asarray(second), np.array(SEED_RESULT) + 1, rtol=1e-6)


def test_compile_cache_hits_in_one_process():
    before = dict(iree.compile_cache.stats)
    text = js.to_mlir(lambda t: t * 3 - 2, [js.template((7,), "float32")]).mlir_module
    iree.compile(text, CPU_FLAGS)
    iree.compile(text, CPU_FLAGS)
    after = iree.compile_cache.stats
    assert after["compiles"] + after["disk_hits"] - before["compiles"] - before["disk_hits"] == 1
    assert after["memory_hits"] - before["memory_hits"] == 1


CROSS_PROCESS = """
import json, numpy as np, jax.numpy as jnp, jitserve as js
from jitserve import iree
c = js.compile(lambda t: jnp.tanh(t) * 5, [js.template((9,), "float32")], compiler="iree")
value = float(np.asarray(c(np.ones(9, np.float32)))[0])
print(json.dumps({"value": value, **iree.compile_cache.stats}))
"""


def test_compile_cache_across_processes(tmp_path):
    env = dict(os.environ, JITSERVE_CACHE_DIR=str(tmp_path / "shared-cache"))
    import json

    runs = [json.loads(subprocess.run([sys.executable, "-c", CROSS_PROCESS], env=env, capture_output=True,
                                      text=True, check=True).stdout.strip().splitlines()[-1]) for _ in range(2)]
    assert runs[0]["compiles"] == 1 and runs[0]["disk_hits"] == 0
    assert runs[1]["compiles"] == 0 and runs[1]["disk_hits"] == 1, "the second process compiles nothing"
    assert runs[0]["value"] == runs[1]["value"] == pytest.approx(np.tanh(1.0) * 5, rel=1e-6)
    assert len(list((tmp_path / "shared-cache" / "iree").glob("*.vmfb"))) == 1


def test_bad_mlir_is_a_compile_error_and_the_process_lives():
    with pytest.raises(js.CompileError) as info:
        iree.compile("module { bad }", CPU_FLAGS)
    assert "custom op 'bad' is unknown" in str(info.value)
    with pytest.raises(js.CompileError, match="IREE could not compile the module"):
        iree.compile(SEED_MLIR.replace("stablehlo.sine %1", "stablehlo.sine %9"), CPU_FLAGS)
    module = iree.compile(SEED_MLIR, CPU_FLAGS)
    np.testing.assert_allclose(np.asarray(iree.call(module, seed_inputs())), SEED_RESULT, rtol=1e-6)


def test_wrong_inputs_are_clear_errors_before_iree():
    module = iree.compile(SEED_MLIR, CPU_FLAGS)
    x, i = seed_inputs()
    with pytest.raises(js.TemplateMismatchError, match="^function 'main' takes 2 inputs, got 1$"):
        iree.call(module, [x])
    with pytest.raises(js.TemplateMismatchError, match=r"^argument 1: expected int32\(4\), got float32\(4\)$"):
        iree.call(module, [x, x])
    with pytest.raises(js.TemplateMismatchError, match=r"^argument 0: expected float32\(4\), got float32\(5\)$"):
        iree.call(module, [np.ones(5, np.float32), i])
    with pytest.raises(js.OptionError, match="the module has no function 'nope'"):
        iree.call(module, [x, i], function="nope")
    with pytest.raises(js.OptionError, match="cannot open IREE device 'nosuchdriver://'"):
        iree.call(module, [x, i], device="nosuchdriver://")


def test_serving_with_iree():
    serving = js.Serving(lambda x: jnp.tanh(x), batch_size=4, batch_timeout=0.001, compiler="iree",
                         input_template=js.template((3,), "float32"))
    with js.serve(serving, name="iree-serving") as server:
        x = np.linspace(-1, 1, 15, dtype=np.float32).reshape(5, 3)
        np.testing.assert_allclose(js.batched_run("iree-serving", js.Batch.concatenate([x])), np.tanh(x), rtol=1e-6)
        assert server.stats().compiles == 3


def test_devices_include_iree():
    uris = [d.uri for d in js.devices() if d.compiler == "iree"]
    assert "local-task://" in uris and "local-sync://" in uris


@pytest.mark.skipif(not any(True for _ in (iree.list_devices("cuda") if "cuda" in iree.list_drivers() else [])),
                    reason="no CUDA device here")
def test_cuda_driver_runs_the_seed_module():
    dev = iree.list_devices("cuda")[0]
    module = iree.compile(SEED_MLIR, ["--iree-hal-target-backends=cuda", "--iree-cuda-target=sm_80",
                                      "--iree-input-type=stablehlo"])
    np.testing.assert_allclose(np.asarray(iree.call(module, seed_inputs(), device=dev)), SEED_RESULT, rtol=1e-5)


# errors that say what IREE cannot do and what to use instead ---------------------------------------

def test_linear_algebra_names_the_jnp_functions_and_the_compilers_that_can():
    with pytest.raises(js.CompileError) as info:
        js.jit(jnp.linalg.pinv, compiler="iree")(np.eye(3, dtype=np.float32))
    assert str(info.value) == (
        "compiler 'iree' cannot compile a singular value decomposition (jnp.linalg.svd, pinv, matrix_rank, "
        "norm(ord=2), cond): IREE has no lowering for primitive 'svd'; jitserve rewrites LU, Cholesky and "
        "triangular solves for IREE, not this; use compiler='xla' or compiler='evaluator'")


SPD = (lambda m: m @ np.swapaxes(m, -1, -2) + 5 * np.eye(5, dtype=np.float32))(
    np.random.default_rng(2).normal(size=(3, 5, 5)).astype(np.float32))


@pytest.mark.parametrize("fn, args", [
    (jnp.linalg.solve, (SPD[0] - 6 * np.eye(5, dtype=np.float32), np.arange(5, dtype=np.float32))),
    (jnp.linalg.inv, (SPD - 3 * np.eye(5, dtype=np.float32),)), (jnp.linalg.slogdet, (SPD[1] - 8,)),
    (jax.lax.linalg.lu, (np.array([[1, 2, 3], [-1, 5, 6], [1, 0, 1], [2, 2, 2]], np.float32),)),
    (jnp.linalg.det, (np.array([[1, 2, 3], [2, 4, 6], [1, 0, 1]], np.float32),)),
    (jnp.linalg.cholesky, (SPD,)), (jnp.linalg.cholesky, (-SPD[0],)),
    (lambda a, b: jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(a), b), (SPD[2], SPD[0])),
    (lambda a, b: jax.lax.linalg.triangular_solve(a, b, left_side=False, lower=True, transpose_a=True,
                                                  conjugate_a=True, unit_diagonal=True),
     (SPD.astype(np.complex64) * (1 + 1j), SPD[::-1].astype(np.complex64)))])
def test_lu_cholesky_and_triangular_solves_compile_and_agree_with_xla(fn, args):
    """Rewritten as loops of plain operations (IREE has no lowering for them); singular and not positive
    definite matrices give XLA's infinities and NaNs."""
    got, want = js.jit(fn, compiler="iree")(*args), jax.jit(fn)(*args)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_raw_mlir_with_a_lapack_call_names_the_call():
    lowered = js.to_mlir(jnp.linalg.inv, [np.eye(3, dtype=np.float32)])
    with pytest.raises(js.CompileError) as info:
        iree.compile(lowered.mlir_module)
    first = str(info.value).splitlines()[0]
    assert first.startswith("IREE cannot compile a call into a host library (on CPU, LAPACK linear algebra")
    assert "(operation 'stablehlo.custom_call' @lapack_sgetrf_ffi has no lowering)" in first


@pytest.mark.parametrize("transform, x", [
    (jnp.fft.fft, np.arange(10, dtype=np.complex64)), (jnp.fft.rfft, np.arange(400, dtype=np.float32) % 7),
    (lambda z: jnp.fft.irfft(z, n=9), np.arange(5, dtype=np.complex64) * (1 - 1j)),
    (jnp.fft.fft2, np.ones((3, 8), np.complex64) * np.arange(8)), (jnp.fft.ifftn, np.arange(60).reshape(3, 4, 5) + 0j)])
def test_an_fft_of_any_length_and_axes_compiles_and_agrees_with_xla(transform, x):
    """IREE lowers one axis of a power-of-two length; the others go through Bluestein's algorithm, axis by axis."""
    x = x.astype(np.float32 if np.isrealobj(x) else np.complex64)
    np.testing.assert_allclose(np.asarray(js.jit(transform, compiler="iree")(x)), np.asarray(jax.jit(transform)(x)),
                               rtol=1e-5, atol=1e-5 * np.abs(x).max())


def test_an_fft_iree_cannot_lower_says_so():
    lowered = js.to_mlir(jnp.fft.fft, [np.ones(10, np.complex64)])
    with pytest.raises(js.CompileError, match=r"IREE cannot compile an FFT IREE cannot lower \(it lowers one axis "
                                              r"of a power-of-two length in single precision; js.jit"):
        iree.compile(lowered.mlir_module)
    with jax.enable_x64(True), pytest.raises(js.CompileError, match=r"compiler 'iree' cannot compile an FFT of "
                                                                    r"complex128: IREE lowers FFTs of float32 and "
                                                                    r"complex64 only"):
        js.jit(jnp.fft.fft, compiler="iree")(np.ones(8, np.complex128))


def test_float64_follows_x64_and_float64_library_functions_are_named():
    x = np.linspace(-1, 1, 5)
    with jax.enable_x64(True):
        doubled = js.jit(lambda a: a * 2 + 1e-12, compiler="iree")(x)
        assert np.asarray(doubled).dtype == np.float64
        np.testing.assert_array_equal(np.asarray(doubled), x * 2 + 1e-12)  # no silent demotion to float32
        with pytest.raises(js.CompileError, match="IREE's CPU target has no library function 'sin' \\(float64 math"):
            js.jit(jnp.sin, compiler="iree")(x)
        flags = iree.default_flags("local-task") + ["--iree-input-demote-f64-to-f32=true"]
        with pytest.raises(js.CompileError, match=r"IREE compiled input 0 as float32\(5\), but the definition takes "
                                                  r"float64\(5\): a flag changed the function's types"):
            js.jit(lambda a: a * 2, compiler="iree", iree_compiler_flags=flags)(x)


def test_a_module_for_another_target_says_so():
    lowered = js.to_mlir(lambda a: a * 2, [np.ones(4, np.float32)])
    module = iree.compile(lowered.mlir_module, ["--iree-hal-target-backends=cuda"], lowered.output_container)
    with pytest.raises(js.CompileError, match=r"the module was compiled for --iree-hal-target-backends=cuda and cannot "
                                              r"run on device 'local-task://'; compile it with "
                                              r"iree.default_flags\('local-task://'\)"):
        iree.call(module, [np.ones(4, np.float32)])


def test_runtime_failures_are_evaluation_errors():
    compiled = js.compile(lambda a: a * 2, [js.template((4,), "float32")], compiler="iree")
    with pytest.raises(js.EvaluationError, match="IREE failed running function 'main'"):
        compiled.executable.run(np.ones(5, np.float32))  # the unchecked call: IREE itself refuses the shape


def test_out_of_range_indices_never_touch_memory_outside_the_array():
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    ids = np.array([0, 5, 9, 100, -1, -20, 2**30, -(2**31)], np.int32)
    for fn in [lambda t, i: t[i], lambda t, i: jnp.take(t, i, axis=0, mode="clip"),
               lambda t, i: jnp.take(t, i, axis=0, mode="fill", fill_value=-1.0),
               lambda t, i: t.at[i].set(-7.0), lambda t, i: t.at[i].add(1.0), lambda t, i: t.at[i, 1].max(99.0)]:
        np.testing.assert_array_equal(np.asarray(js.jit(fn, compiler="iree")(table, ids)), np.asarray(jax.jit(fn)(table, ids)))


WRITES = {  # in-place writes into an input, directly or through a view (IREE wrote the caller's buffer)
    "update_slice": lambda w, i: jax.lax.dynamic_update_slice(w, jnp.ones((1, 4), jnp.float32), (i, 0)),
    "through_a_reshape": lambda w, i: jax.lax.dynamic_update_slice(w.reshape(32, 8), jnp.ones((1, 8)),
                                                                   (i, 0)).reshape(64, 4),
    "clipped_scatter": lambda w, i: w.at[i].set(1.0, mode="clip"),
    "vmapped_update_slice": lambda w, i: jax.vmap(lambda row, p: jax.lax.dynamic_update_slice(
        row, jnp.ones(1), (p,)))(w, jnp.full(64, i)),
}


@pytest.mark.parametrize("name", WRITES)
def test_an_input_on_the_device_is_never_written_unless_donated(name):
    """IREE writes a function's input in place when one in-place operation is all that uses it
    (iree-org/iree#16168): each call saw the writes of the calls before, and results already returned
    changed with it. jitserve gives such an operation a copy; a donated input is still written in place."""
    compiler, fn = js.compilers.get("iree"), WRITES[name]
    templates = [js.template((64, 4), "float32"), js.template((), "int32")]
    kept = compiler.compile(fn, templates, {})
    weights = compiler.place(np.zeros((64, 4), np.float32), {})
    first = kept.run(weights, np.int32(1))
    second = kept.run(weights, np.int32(2))
    for result, row in ((first, 1), (second, 2)):
        np.testing.assert_array_equal(np.asarray(result), np.asarray(jax.jit(fn)(np.zeros((64, 4), np.float32),
                                                                               np.int32(row))))
    np.testing.assert_array_equal(np.asarray(compiler.compile(lambda w: w + 0, templates[:1], {}).run(weights)), 0)
    donated = compiler.compile(fn, templates, {}, donate=(0,)).run(weights, np.int32(3))
    np.testing.assert_array_equal(np.asarray(compiler.compile(lambda w: w + 0, templates[:1], {}).run(weights)),
                                  np.asarray(donated), err_msg="a donated input is updated in place")


def test_stable_sorts_are_stable_and_constant_keys_work():
    keys = np.array([1, 0, 1, 0] * 8, np.int32)
    argsort = js.jit(lambda k: jnp.argsort(k, stable=True), compiler="iree")(keys)
    np.testing.assert_array_equal(np.asarray(argsort), np.argsort(keys, kind="stable"))
    uniform = js.jit(lambda x: jax.random.uniform(jax.random.PRNGKey(0), (3,)) + x, compiler="iree")(np.zeros(3, np.float32))
    np.testing.assert_array_equal(np.asarray(uniform), np.asarray(jax.random.uniform(jax.random.PRNGKey(0), (3,))))


def test_a_sort_leaves_its_operand_to_the_operations_that_read_it_too():
    """IREE sorted in the operand's own buffer, and an argmax of the same values beside the sort found them
    sorted (a sampler's greedy fallback beside its top-p sort: token 82 for 14)."""
    peaked = -np.abs(np.arange(97) - 14).astype(np.float32) / 4

    def both(x):
        return jnp.sort(x)[::-1][3], jnp.argmax(x), jnp.cumsum(jnp.sort(x))[2]

    got = js.jit(both, compiler="iree")(peaked)
    assert [np.asarray(value).item() for value in got] == [np.asarray(value).item() for value in jax.jit(both)(peaked)]


def test_top_k_over_a_batch_of_vocabulary_rows_compiles_and_ranks_as_xla():
    """XLA's order (NaN highest, ties lowest index first) made explicit without a sort or a gather: with either,
    IREE could not compile a top_k over 64 rows of 50,000 (its stack allocation limit)."""
    logits = np.random.default_rng(0).normal(size=(64, 50_000)).astype(np.float32)
    logits[3, 17], logits[5, :100], logits[6, 9] = np.nan, 9.0, -np.inf
    top = jax.lax.top_k
    values, indices = js.jit(lambda x: top(x, 5), compiler="iree")(logits)
    want_values, want_indices = jax.jit(lambda x: top(x, 5))(logits)
    np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
    assert np.isnan(np.asarray(values)[3, 0]) and np.asarray(indices)[5].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("window, strides, padding", [((3, 3), (2, 2), "SAME"), ((3, 3), (1, 1), "VALID"),
                                                      ((2, 3), (2, 2), "VALID")])
def test_the_gradient_of_a_pool_with_overlapping_or_padded_windows_compiles_and_agrees_with_xla(window, strides,
                                                                                                   padding):
    """IREE itself compiles ``select_and_scatter`` only for windows that neither overlap nor are padded; the
    rewrite chooses within each window as XLA does (first of equal values, NaN only where nothing follows)."""
    x = np.random.default_rng(1).normal(size=(2, 9, 9, 3)).astype(np.float32)
    x[0, 1, 1, 0], x[1, 4:6, 4:6, :] = np.nan, 2.0

    def pool_gradient(x):
        return jax.grad(lambda v: jnp.sum(jax.lax.reduce_window(v, -jnp.inf, jax.lax.max, (1, *window, 1),
                                                                (1, *strides, 1), padding) ** 2))(x)

    got = np.asarray(js.jit(pool_gradient, compiler="iree")(x))
    np.testing.assert_allclose(got, np.asarray(jax.jit(pool_gradient)(x)), rtol=1e-6)
