"""The compiler table: registering a compiler from outside jitserve, and eager as an ordinary entry."""

from __future__ import annotations

import numpy as np
import pytest

import jitserve as js
from jitserve import compilers


class Doubling(js.Compiler):
    """A toy compiler: runs the function with numpy, then doubles every output (so its use shows)."""

    name = "doubling"
    options = frozenset({"factor"})

    def compile(self, fn, templates, options):
        leaves, tree = compilers.base.flat_templates(templates)
        factor = options.get("factor", 2)
        return js.Executable(lambda *args: np.asarray(fn(*args)) * factor, leaves, tree, None)

    def devices(self):
        return [js.Device(compiler=self.name, driver="cpu", id=0, uri="doubling:cpu:0")]


@pytest.fixture
def doubling():
    js.register_compiler("doubling", Doubling(), replace=True)
    yield
    compilers.COMPILERS.pop("doubling", None)
    compilers._instances.pop("doubling", None)


def test_a_registered_compiler_works_wherever_a_compiler_name_is_accepted(doubling):
    assert js.jit(lambda x: x + 1, compiler="doubling")(np.ones(3)).tolist() == [4.0, 4.0, 4.0]
    assert js.jit(lambda x: x + 1, compiler="doubling", factor=10)(np.ones(1)).tolist() == [20.0]
    serving = js.Serving(lambda x: x * 3, batch_size=2, compiler="doubling", input_template=js.template((1,), "float32"))
    assert serving.run(js.Batch.stack([np.ones(1, np.float32)])).tolist() == [[6.0]]
    assert "doubling:cpu:0" in [d.uri for d in js.devices()]
    with pytest.raises(js.OptionError, match="unknown option 'nope' for compiler 'doubling'"):
        js.jit(lambda x: x, compiler="doubling", nope=1)(np.ones(1))


def test_registration_errors_say_what_was_wrong(doubling):
    with pytest.raises(js.OptionError, match="a compiler named 'doubling' is registered already; pass replace=True"):
        js.register_compiler("doubling", Doubling())
    with pytest.raises(js.OptionError, match="the compiler's name is 'doubling', but it is registered as 'other'"):
        js.register_compiler("other", Doubling())
    with pytest.raises(js.OptionError, match="needs an instance of a jitserve.Compiler subclass, got 42"):
        js.register_compiler("x", 42)
    with pytest.raises(js.OptionError, match="a compiler named 'xla' is registered already"):
        js.register_compiler("xla", compilers.get("xla").__class__())  # built-ins are entries like any other


def test_eager_is_an_entry_of_the_table_that_compiles_nothing():
    assert "eager" in compilers.COMPILERS and not compilers.get("eager").compiles
    serving = js.Serving(lambda x: np.sort(x, axis=1), batch_size=4, compiler="eager",
                         input_template=js.template((3,), "float32"))
    with js.serve(serving, name="eager-sort") as server:
        out = js.batched_run("eager-sort", js.Batch.stack([np.array([3.0, 1.0, 2.0], np.float32)]))
        assert out.tolist() == [[1.0, 2.0, 3.0]]
        assert server.stats().compiles == 0
    shapes = compilers.get("eager").output_shapes(lambda x: x[:, :2], [js.template((1, 3), "float32")])
    assert shapes.shape == (1, 2)
