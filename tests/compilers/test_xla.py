"""The xla compiler: the contract, partitions and the persistent compile cache."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np

import jitserve as js
from jitserve import compilers


def test_contract_compile_returns_executable():
    xla = compilers.get("xla")
    exe = xla.compile(lambda a, b: (a + b, a * b), [js.template((2,), "float32")] * 2, {})
    total, product = exe(np.full(2, 2, np.float32), np.full(2, 3, np.float32))
    assert np.asarray(total).tolist() == [5, 5] and np.asarray(product).tolist() == [6, 6]
    assert exe.output_container == (js.template((2,), "float32"), js.template((2,), "float32"))


def test_partitions_one_per_device():
    xla = compilers.get("xla")
    parts = xla.partitions({"compiler": "xla"})
    assert [p["device"] for p in parts] == jax.devices()
    assert xla.partitions({"device": "cpu:0"}) == [{"device": "cpu:0"}]


SCRIPT = """
import numpy as np, jax, jitserve as js
hits = []
jax.monitoring.register_event_listener(lambda event, **kw: hits.append(event) if "cache_hits" in event else None)
c = js.compile(lambda x: jax.numpy.tanh(x) * 3, [js.template((64,), "float32")])
print(float(np.asarray(c(np.ones(64, np.float32)))[0]), len(hits))
"""


def test_persistent_cache_through_environment_variable(tmp_path):
    env = dict(os.environ, JITSERVE_CACHE_DIR=str(tmp_path / "cache"))
    runs = [subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
            for _ in range(2)]
    (value, first_hits), (_, second_hits) = (run.stdout.split() for run in runs)
    assert value.startswith("2.28")
    assert (first_hits, second_hits) == ("0", "1"), "the second process loads the executable from disk"
    entries = list((tmp_path / "cache").iterdir())
    assert entries, "the compiled executable is written to the cache directory"


def test_persistent_cache_through_option(tmp_path):
    cache = tmp_path / "opt-cache"
    c = js.compile(lambda x: x * 7 - 1, [js.template((5,), "int32")], cache_dir=str(cache))
    assert np.asarray(c(np.ones(5, np.int32))).tolist() == [6] * 5
    assert any(cache.iterdir())
