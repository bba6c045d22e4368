"""defn / jit / compile / to_mlir: caching, pytrees, template checks, DefnError."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jitserve as js


def softmax(t):
    return jnp.exp(t) / jnp.sum(jnp.exp(t), axis=-1, keepdims=True)


def reference_softmax(t):
    return np.exp(t) / np.sum(np.exp(t), axis=-1, keepdims=True)


def test_defn_computes_and_caches_per_signature():
    fn = js.defn(softmax)
    x = np.random.default_rng(0).uniform(size=(3, 4)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(fn(x)), reference_softmax(x), rtol=1e-6)
    assert fn.compiles == 1
    fn(x + 1)
    fn(jnp.asarray(x))
    assert fn.compiles == 1, "same shape and dtype must not recompile"
    fn(x[:2])
    assert fn.compiles == 2
    fn(x.astype(np.float64).astype(np.float16))
    assert fn.compiles == 3


def test_defn_decorator_with_options():
    @js.defn(compiler="xla")
    def double(x):
        return x * 2

    assert np.asarray(double(np.arange(3))).tolist() == [0, 2, 4]
    assert double.__name__ == "double"


def test_pytree_inputs_and_outputs():
    @js.defn
    def f(pair, params):
        a, b = pair
        return {"sum": a + b, "scaled": (params["w"] * a, params["w"] - 1.0)}

    out = f((np.ones(2, np.float32), np.full(2, 2, np.float32)), {"w": 3.0})
    assert set(out) == {"sum", "scaled"}
    np.testing.assert_array_equal(np.asarray(out["sum"]), [3, 3])
    np.testing.assert_array_equal(np.asarray(out["scaled"][0]), [3, 3])
    np.testing.assert_array_equal(np.asarray(out["scaled"][1]), 2.0)
    assert f.compiles == 1
    f((np.ones(2, np.float32), np.ones(2, np.float32)), {"w": 5.0})
    assert f.compiles == 1, "a Python scalar is a traced input, not a constant"


def test_python_scalar_inputs_and_lists():
    f = js.jit(lambda xs, s: [x * s for x in xs])
    out = f([np.ones(2), np.zeros(2)], 2)
    assert isinstance(out, list) and len(out) == 2
    np.testing.assert_array_equal(np.asarray(out[0]), [2, 2])


def test_compile_checks_templates_by_position():
    compiled = js.compile(softmax, [js.template((1000, 1000, 5), "float32")])
    with pytest.raises(js.TemplateMismatchError) as info:
        compiled(np.ones((3, 2)))
    assert str(info.value) == "argument 0: expected float32(1000, 1000, 5), got float64(3, 2)"
    x = np.random.default_rng(1).uniform(size=(1000, 1000, 5)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(compiled(x)), reference_softmax(x), rtol=1e-5)
    assert compiled.output_container == js.template((1000, 1000, 5), "float32")


def test_compile_names_nested_argument_and_dtype():
    compiled = js.compile(lambda a, b: a["x"] + b, [{"x": js.template((2,), "int32")}, js.template((2,), "int32")])
    with pytest.raises(js.TemplateMismatchError) as info:
        compiled({"x": np.ones(2, np.int32)}, np.ones(2, np.float32))
    assert str(info.value) == "argument 1: expected int32(2), got float32(2)"
    with pytest.raises(js.TemplateMismatchError) as info:
        compiled({"x": np.ones(3, np.int32)}, np.ones(2, np.int32))
    assert str(info.value) == "argument 0['x']: expected int32(2), got int32(3)"
    with pytest.raises(js.TemplateMismatchError, match="arguments do not match the compiled structure"):
        compiled(np.ones(2, np.int32), np.ones(2, np.int32))


def test_compile_accepts_python_scalar_for_scalar_template():
    compiled = js.compile(lambda x, s: x * s, [js.template((2,), "float32"), js.template((), "float32")])
    np.testing.assert_array_equal(np.asarray(compiled(np.ones(2, np.float32), 3.0)), [3, 3])
    with pytest.raises(js.TemplateMismatchError, match="argument 1: expected float32\\(\\), got"):
        compiled(np.ones(2, np.float32), np.ones(2, np.float32))


def test_compile_with_values_as_templates():
    x = np.ones((2, 2), np.int32)
    compiled = js.compile(lambda a: a.sum(), [x])
    assert int(np.asarray(compiled(x))) == 4
    assert compiled.input_templates == [js.template((2, 2), "int32")]


def test_template_printing():
    t = js.template((1000, 1000, 5), "float32")
    assert str(t) == "float32(1000, 1000, 5)"
    assert repr(t) == "template((1000, 1000, 5), 'float32')"
    assert js.template(4, "int8") == js.template((4,), np.int8)
    assert str(js.template((), "bool")) == "bool()"


def test_to_mlir_gives_main_output_container_and_used_inputs():
    def f(a, unused, b):
        return a * 2, {"s": jnp.sum(b)}

    m = js.to_mlir(f, [np.ones(4, np.float32), js.template((3,), "int32"), np.ones((2, 2), np.float32)])
    assert "func.func public @main(" in m.mlir_module
    assert "stablehlo.multiply" in m.mlir_module
    assert m.used_inputs == (0, 2)
    main = re.search(r"func\.func public @main\(([^)]*)\)", m.mlir_module).group(1)
    assert main.count("%arg") == len(m.used_inputs), "used_inputs must name exactly the arguments @main takes"
    assert m.output_container == (js.template((4,), "float32"), {"s": js.template((), "float32")})
    assert len(m.input_templates) == 3


@pytest.mark.parametrize(
    ("body", "attempted", "instead"),
    [
        (lambda t: float(t.sum()), "float() on a traced value", "jax.debug.print"),
        (lambda t: int(t.sum()), "int() on a traced value", "x.astype(jnp.int32)"),
        (lambda t: t.sum().item(), ".item() on a traced value", "jax.debug.print"),
        (lambda t: t.tolist(), ".tolist() on a traced value", "jax.debug.print"),
        (lambda t: np.asarray(t), "np.asarray()/np.array() on a traced value", "jax.debug.print"),
        (lambda t: t if t.sum() > 0 else -t, "bool() or a Python if/while/and/or on a traced value",
         "jnp.where or jax.lax.cond"),
        (lambda t: bool(t[0]), "bool() or a Python if/while/and/or on a traced value", "jax.lax.cond"),
    ],
)
def test_forbidden_operations_raise_defn_error(body, attempted, instead):
    fn = js.jit(body)
    with pytest.raises(js.DefnError) as info:
        fn(np.ones(3, np.float32))
    message = str(info.value)
    assert message.startswith(f"{attempted} is not allowed inside a numerical definition")
    assert instead in message
    assert "test_defn.py" in message, "the message points at the user's line"
    assert not isinstance(info.value, jax.errors.ConcretizationTypeError)


def test_forbidden_operation_in_compile_and_to_mlir():
    with pytest.raises(js.DefnError, match="float\\(\\) on a traced value"):
        js.compile(lambda t: float(t), [js.template((), "float32")])
    with pytest.raises(js.DefnError, match="is not allowed inside a numerical definition"):
        js.to_mlir(lambda t: t if t > 0 else t, [np.float32(1)])


def test_devices_lists_xla_cpu():
    found = js.devices()
    cpu = [d for d in found if d.compiler == "xla" and d.driver == "cpu"]
    assert cpu and cpu[0].uri == "xla:cpu:0"


def test_device_placement_option():
    fn = js.jit(lambda x: x + 1, device="cpu:0")
    out = fn(np.ones(2))
    assert out.devices() == {jax.devices("cpu")[0]}
    with pytest.raises(js.OptionError, match="device index 7 is out of range"):
        js.jit(lambda x: x, device=7)(np.ones(1))


def test_unknown_compiler_and_option():
    with pytest.raises(js.UnknownCompilerError, match="unknown compiler 'nope'; expected one of: xla"):
        js.jit(softmax, compiler="nope")
    with pytest.raises(js.OptionError, match="unknown option 'devcie' for compiler 'xla'"):
        js.jit(softmax, devcie=0)
