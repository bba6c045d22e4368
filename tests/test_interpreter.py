"""Graph printing and the Interpreter: boxed calling convention, last-use freeing, hooks, errors."""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jitserve as js


def softmax(t):
    return jnp.exp(t) / jnp.sum(jnp.exp(t), axis=-1, keepdims=True)


def test_graph_prints_one_line_per_node():
    graph = js.trace(softmax, js.template((2, 3), "float32"))
    assert str(graph) == "\n".join([
        "graph softmax(%0: float32(2, 3)) {",
        "  %1 = exp %0 : float32(2, 3)",
        "  %2 = exp %0 : float32(2, 3)",
        "  %3 = reduce_sum[axes=(1,)] %2 : float32(2)",
        "  %4 = broadcast_in_dim[shape=(2, 1), broadcast_dimensions=(0,)] %3 : float32(2, 1)",
        "  %5 = div %1 %4 : float32(2, 3)",
        "  return %5",
        "}",
    ])
    assert graph.output_container == js.template((2, 3), "float32")


def test_graph_prints_literals_constants_and_subgraphs():
    table = np.arange(3, dtype=np.int32)
    graph = js.trace(lambda x: lax.cond(x[0] > 0, lambda y: y + table, lambda y: y, x), np.ones(3, np.int32))
    text = str(graph)
    assert "gt %" in text and "0:int32" in text
    assert "cond[branches=(<graph of 0 nodes>, <graph of 1 nodes>)]" in text


def test_run_with_pytrees():
    graph = js.trace(lambda p: {"s": p["a"] + p["b"], "d": p["a"] - p["b"]}, {"a": np.ones(2), "b": np.ones(2)})
    out = js.Interpreter(graph).run({"a": np.full(2, 3.0), "b": np.ones(2)})
    assert out["s"].tolist() == [4.0, 4.0] and out["d"].tolist() == [2.0, 2.0]


class RecordingInterpreter(js.Interpreter):
    """Records, per node, whether the watched input is still alive."""

    watched: weakref.ref | None = None
    alive: list[bool] = []
    primitives: list[str] = []

    def run_node(self, node, args):
        gc.collect()
        RecordingInterpreter.alive.append(RecordingInterpreter.watched() is not None)
        RecordingInterpreter.primitives.append(node.primitive)
        return super().run_node(node, args)


@pytest.fixture(autouse=True)
def _fresh_records():
    RecordingInterpreter.alive, RecordingInterpreter.primitives = [], []


def test_boxed_run_clears_list_and_frees_input_before_the_end():
    graph = js.trace(lambda x: jnp.tanh(jnp.sin(x) * 2) + 1, np.ones(1000, np.float32))
    interpreter = RecordingInterpreter(graph)
    x = np.ones(1000, np.float32)
    RecordingInterpreter.watched = weakref.ref(x)
    args = [x]
    del x
    out = interpreter.boxed_run(args)
    assert args == [], "boxed_run empties the caller's list"
    assert interpreter.alive[0] is True, "the input is alive for its one use"
    assert interpreter.alive[1:] == [False] * (len(interpreter.alive) - 1), "and freed right after it"
    np.testing.assert_allclose(out, np.tanh(np.sin(np.ones(1000)) * 2) + 1, rtol=1e-6)


def test_without_last_use_freeing_the_input_lives_on():
    graph = js.trace(lambda x: jnp.tanh(jnp.sin(x) * 2) + 1, np.ones(8, np.float32))
    interpreter = RecordingInterpreter(graph, free_after_last_use=False)
    x = np.ones(8, np.float32)
    RecordingInterpreter.watched = weakref.ref(x)
    args = [x]
    del x
    interpreter.boxed_run(args)
    assert all(interpreter.alive)


def test_x_plus_x_and_outputs_are_not_freed_early():
    graph = js.trace(lambda x: (x + x, x, jnp.exp(x)), np.ones(3, np.float32))
    doubled, same, exp = js.Interpreter(graph).run(np.full(3, 2.0, np.float32))
    assert doubled.tolist() == [4, 4, 4] and same.tolist() == [2, 2, 2]
    np.testing.assert_allclose(exp, np.exp(2.0), rtol=1e-6)


def test_run_node_hook_sees_subgraph_nodes_too():
    graph = js.trace(lambda x: lax.fori_loop(0, 3, lambda i, acc: jnp.sin(acc), x), np.ones(2, np.float32))
    interpreter = RecordingInterpreter(graph)
    RecordingInterpreter.watched = weakref.ref(interpreter)
    out = interpreter.run(np.ones(2, np.float32))
    np.testing.assert_allclose(out, np.sin(np.sin(np.sin(np.ones(2)))), rtol=1e-6)
    assert interpreter.primitives.count("sin") == 3, "the loop body runs through the same hook"


def test_generated_path_frees_the_input_early_and_names_failing_nodes():
    assert js.Interpreter(js.trace(lambda x: x + 1, np.ones(2)))._straight_line is not None
    assert RecordingInterpreter(js.trace(lambda x: x + 1, np.ones(2)))._straight_line is None, "hooks use the loop"
    seen = []

    def fn(v):
        y = jnp.sin(v) * 2
        jax.debug.callback(lambda _: seen.append(watched() is None), y)
        return y + 1

    x = np.ones(1000, np.float32)
    watched = weakref.ref(x)
    graph = js.trace(fn, x)
    args = [x]
    del x
    out = js.Interpreter(graph).boxed_run(args)
    assert args == [] and seen == [True], "the input was freed before the callback ran"
    np.testing.assert_allclose(out, np.sin(1.0) * 2 + 1, rtol=1e-6)

    def failing(_):
        raise FloatingPointError("bad value")

    graph = js.trace(lambda v: (jax.debug.callback(failing, v), v * 2)[1], np.ones(2, np.float32))
    with pytest.raises(js.EvaluationError, match=r"^While executing debug_callback\[.*FloatingPointError: bad value"):
        js.Interpreter(graph).run(np.ones(2, np.float32))


def test_error_names_the_node_and_chains_the_cause():
    class Failing(js.Interpreter):
        def run_node(self, node, args):
            if node.primitive == "exp":
                raise FloatingPointError("overflow")
            return super().run_node(node, args)

    graph = js.trace(lambda x: jnp.exp(x * 2), np.ones(2, np.float32))
    with pytest.raises(js.EvaluationError) as info:
        Failing(graph).run(np.ones(2, np.float32))
    assert str(info.value) == "While executing %2 = exp %1 : float32(2): FloatingPointError: overflow"
    assert isinstance(info.value.__cause__, FloatingPointError)


def test_unsupported_primitive_names_it_and_the_table():
    graph = js.trace(lambda x: lax.reduce_window(x, 1.0, lambda a, b: a * b + 1, (2,), (1,), "VALID"),
                     np.ones(3, np.float32))
    with pytest.raises(NotImplementedError) as info:
        js.Interpreter(graph)
    assert "primitive 'reduce_window'" in str(info.value)
    assert "PRIMITIVES in jitserve/compilers/evaluator/primitives.py" in str(info.value)


def test_wrong_number_of_inputs():
    graph = js.trace(lambda a, b: a + b, np.ones(2), np.ones(2))
    with pytest.raises(TypeError, match="takes 2 inputs, got 1"):
        js.Interpreter(graph).boxed_run([np.ones(2)])


def test_evaluator_wherever_a_compiler_name_is_accepted():
    x = np.random.default_rng(0).uniform(size=(4, 5)).astype(np.float32)
    expected = np.asarray(jax.jit(softmax)(x))
    fn = js.jit(softmax, compiler="evaluator")
    out = fn(x)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    fn(x + 1)
    assert fn.compiles == 1
    compiled = js.compile(softmax, [js.template((4, 5), "float32")], compiler="evaluator")
    np.testing.assert_allclose(compiled(x), expected, rtol=1e-6)
    with pytest.raises(js.TemplateMismatchError, match="argument 0: expected float32\\(4, 5\\), got float32\\(5\\)"):
        compiled(x[0])
    with js.options(compiler="evaluator"):
        out = js.defn(softmax)(x)
    assert isinstance(out, np.ndarray)
    assert any(d.compiler == "evaluator" for d in js.devices())


def test_evaluator_reports_defn_errors():
    with pytest.raises(js.DefnError, match="float\\(\\) on a traced value"):
        js.jit(lambda t: float(t), compiler="evaluator")(np.float32(1))


def test_a_parameter_the_implementation_does_not_handle_is_an_error_naming_it(monkeypatch):
    from jitserve.compilers.evaluator import primitives

    monkeypatch.setitem(primitives.PRIMITIVES, "integer_pow", lambda x: x)
    graph = js.trace(lambda x: lax.integer_pow(x, 3), np.ones(3, np.float32))
    with pytest.raises(NotImplementedError, match="primitive 'integer_pow' does not handle its parameter 'y' \\(= 3\\)"):
        js.Interpreter(graph)


@pytest.mark.parametrize("checks", [True, False])
def test_checks_name_the_node_whose_result_is_misshapen(monkeypatch, checks):
    from jitserve.compilers.evaluator import primitives

    monkeypatch.setitem(primitives.PRIMITIVES, "neg", lambda x: np.negative(x).ravel())
    graph = js.trace(lambda x: -x * 2, np.ones((2, 3), np.float32))
    interpreter = js.Interpreter(graph, checks=checks)
    if not checks:
        assert interpreter.run(np.ones((2, 3), np.float32)).shape == (6,)  # unchecked, the wrong shape goes through
        return
    with pytest.raises(js.EvaluationError, match=r"While executing %1 = neg %0 : float32\(2, 3\): ValueError: result 0 "
                                                 r"is float32\[6\], but JAX infers float32\[2, 3\]"):
        interpreter.run(np.ones((2, 3), np.float32))


def test_checks_follow_the_environment(monkeypatch):
    graph = js.trace(lambda x: x + 1, np.ones(2))
    monkeypatch.setenv("JITSERVE_CHECKS", "0")
    assert not js.Interpreter(graph).checks
    monkeypatch.setenv("JITSERVE_CHECKS", "1")
    assert js.Interpreter(graph).checks
