"""Default options: process-wide, scoped per thread/task, used by definitions at call time."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import jitserve as js


def test_defaults_and_set_default_options_returns_previous():
    assert js.default_options()["compiler"] == "xla"
    previous = js.set_default_options(compiler="xla", device="cpu:0")
    assert previous["compiler"] == "xla" and "device" not in previous
    assert js.default_options() == {"compiler": "xla", "device": "cpu:0"}


def test_options_scope_is_nested_and_restored():
    with js.options(device="cpu:0") as outer:
        assert outer["device"] == "cpu:0"
        with js.options(compiler="xla", device=0):
            assert js.default_options()["device"] == 0
        assert js.default_options()["device"] == "cpu:0"
    assert "device" not in js.default_options()


def test_options_scope_is_per_thread():
    seen = {}
    entered, checked = threading.Event(), threading.Event()

    def other():
        entered.wait(5)
        seen["other"] = js.default_options().get("device")
        checked.set()

    thread = threading.Thread(target=other)
    thread.start()
    with js.options(device="cpu:0"):
        entered.set()
        checked.wait(5)
    thread.join(5)
    assert seen["other"] is None


def test_definition_reads_options_at_call_time():
    @js.defn
    def f(x):
        return x + 1

    f(np.ones(2))
    with js.options(compiler="nope"), pytest.raises(js.UnknownCompilerError, match="unknown compiler 'nope'"):
        f(np.ones(2))


def test_options_meant_for_other_compilers_are_left_out():
    js.set_default_options(compiler="xla", iree_compiler_flags=["--x"])
    assert np.asarray(js.jit(lambda x: x * 3)(np.ones(1))).tolist() == [3.0]
