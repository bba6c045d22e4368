"""Weights as resident runtime params: served on every compiler, swapped atomically without a compile,
never compiled in; ``load_params``; the warning for large captured constants."""

from __future__ import annotations

import importlib
import json
import logging
import threading
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jitserve as js
from jitserve import iree
from jitserve.params import save_params
from waiting import HANG_S, until

ROW = js.template((8,), "float32")


def dense(params, x):
    for layer in params["layers"]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x


def dense_numpy(params, x):
    for layer in params["layers"]:
        x = np.tanh(x @ layer["w"] + layer["b"])
    return x


def weights(seed, layers=3, width=8):
    rng = np.random.default_rng(seed)
    return {"layers": [{"w": rng.standard_normal((width, width), np.float32) / np.float32(3),
                        "b": rng.standard_normal(width, np.float32)} for _ in range(layers)]}


@pytest.mark.parametrize("compiler", ["xla", "evaluator", "iree", "eager"])
def test_a_serving_with_params_agrees_with_numpy_run_and_served(compiler):
    params = weights(0)
    serving = js.Serving(dense_numpy if compiler == "eager" else dense, params=params, batch_size=4,
                         input_template=ROW, compiler=compiler)
    x = np.random.default_rng(1).standard_normal((6, 8), np.float32)
    expected = dense_numpy(params, x)
    np.testing.assert_allclose(serving.run(js.Batch.concatenate([x])), expected, rtol=1e-5, atol=1e-6)
    with js.serve(serving, name=f"params-{compiler}") as server:
        served = js.batched_run(f"params-{compiler}", js.Batch.concatenate([x]))
        np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)
        compiles = server.stats().compiles
        assert compiles == (0 if compiler == "eager" else 3)  # batch sizes 1, 2, 4
        other = weights(2)
        server.update_params(other)
        np.testing.assert_allclose(js.batched_run(f"params-{compiler}", js.Batch.concatenate([x])),
                                   dense_numpy(other, x), rtol=1e-5, atol=1e-6)
        assert server.stats().compiles == compiles, "new weights of the same shapes compile nothing"


@pytest.mark.parametrize("compiler", ["xla", "evaluator", "iree"])
def test_python_scalar_weights_are_the_dtypes_jax_traces_them_as(compiler):
    """``2.0`` is a float32 weight (JAX's weak type), not numpy's float64: IREE refused the float64 buffer
    at every call, and float16 inputs keep their dtype."""
    serving = js.Serving(lambda params, x: x * params["scale"] + params["shift"], params={"scale": 2.0, "shift": 3},
                         batch_size=2, input_template=js.template(3, "float16"), compiler=compiler)
    with js.serve(serving, name=f"scalar-params-{compiler}"):
        served = js.batched_run(f"scalar-params-{compiler}", js.Batch.stack([np.arange(3, dtype=np.float16)]))
    assert served.dtype == np.float16 and served.tolist() == [[3.0, 5.0, 7.0]]


def marked(params, x):
    """Writes into a copy of its weights, functionally: the row a request names is set to ones."""
    rows = jax.lax.dynamic_update_slice(params["table"], jnp.ones((1, 4), jnp.float32), (x[0, 0].astype(jnp.int32), 0))
    return jnp.broadcast_to(rows.sum(), (x.shape[0],))


@pytest.mark.parametrize("compiler", ["xla", "evaluator", "iree"])
def test_a_function_that_writes_into_a_copy_of_its_weights_leaves_them_as_they_are(compiler):
    """On IREE such a write once reached the resident weights themselves (iree-org/iree#16168): each call
    saw every earlier one's, 4, 8, 12, ... instead of 4 each time."""
    serving = js.Serving(marked, params={"table": np.zeros((16, 4), np.float32)}, batch_size=1,
                         input_template=js.template((1,), "float32"), compiler=compiler)
    with js.serve(serving, name=f"params-marked-{compiler}"):
        sums = [js.batched_run(f"params-marked-{compiler}", js.Batch.stack([np.float32([row])]))[0]
                for row in (1, 2, 3, 2)]
    assert sums == [4.0] * 4


def test_batch_keys_come_after_the_params():
    serving = js.Serving(lambda params, key, x: x * params["scale"] + key, params={"scale": np.float32(3)},
                         batch_size=2, batch_keys=[10, 20])
    with js.serve(serving, name="params-keys"):
        batch = js.Batch.stack([np.ones(2, np.float32)]).key(20)
        assert js.batched_run("params-keys", batch).tolist() == [[23, 23]]


def test_the_weights_are_not_compiled_into_iree_modules(monkeypatch):
    compiled_texts = []
    real_compile = iree.compile

    def recording(mlir_text, *args, **kwargs):
        compiled_texts.append(mlir_text)
        return real_compile(mlir_text, *args, **kwargs)

    monkeypatch.setattr(iree, "compile", recording)
    params = weights(0, layers=2, width=256)  # 512 KB of weights
    serving = js.Serving(dense, params=params, batch_size=2, input_template=js.template((256,), "float32"),
                         compiler="iree")
    with js.serve(serving, name="params-iree-mlir"):
        pass
    assert len(compiled_texts) == 2
    assert all(len(text) < 20_000 for text in compiled_texts), [len(text) for text in compiled_texts]


def test_a_mismatched_update_names_the_leaf_and_the_old_weights_keep_serving():
    params = weights(0)
    serving = js.Serving(dense, params=params, batch_size=2, input_template=ROW)
    x = np.ones((1, 8), np.float32)
    with js.serve(serving, name="params-mismatch") as server:
        wrong_shape = weights(1)
        wrong_shape["layers"][2]["w"] = np.zeros((8, 4), np.float32)
        with pytest.raises(js.TemplateMismatchError) as info:
            server.update_params(wrong_shape)
        assert str(info.value) == "params['layers'][2]['w']: expected float32(8, 8), got float32(8, 4)"
        wrong_dtype = weights(1)
        wrong_dtype["layers"][0]["b"] = wrong_dtype["layers"][0]["b"].astype(np.float16)
        with pytest.raises(js.TemplateMismatchError) as info:
            server.update_params(wrong_dtype)
        assert str(info.value) == "params['layers'][0]['b']: expected float32(8), got float16(8)"
        missing = weights(1)
        del missing["layers"][1]["b"]
        with pytest.raises(js.TemplateMismatchError) as info:
            server.update_params(missing)
        assert str(info.value) == ("params: expected the structure of the serving's weights, got another "
                                   "(missing params['layers'][1]['b'])")
        with pytest.raises(js.OptionError) as info:
            server.reload_params()
        assert str(info.value) == ("server 'params-mismatch' was given its weights as arrays, not as a file "
                                   "(params=PATH), so there is no file to reload them from")
        np.testing.assert_allclose(js.batched_run("params-mismatch", js.Batch.concatenate([x])),
                                   dense_numpy(params, x), rtol=1e-5, atol=1e-6)
    plain = js.Serving(lambda x: x, batch_size=2)
    with js.serve(plain, name="params-none") as server, pytest.raises(js.OptionError) as info:
        server.update_params(params)
    assert str(info.value) == "this serving was built without params=; it has no weights to update"


def _offset_model(params, x):
    return x + params["offset"]


def test_20_swaps_under_8_callers_every_answer_from_exactly_one_weight_set():
    """Requests of 1..12 rows with batch_size 8: many are split over two batches, and still see one set. Each
    swap waits until a caller was answered by the weights before it, so that all 21 sets serve, however the
    callers and the swaps interleave."""
    serving = js.Serving(_offset_model, params={"offset": np.zeros(4, np.float32)}, batch_size=8,
                         batch_timeout=0.001, input_template=js.template((4,), "float32"))
    answers: list[np.ndarray] = []
    answered_by: set[float] = set()  # the weight sets that answered a whole request
    failures: list[BaseException] = []
    done = threading.Event()
    with js.serve(serving, name="params-swaps") as server:
        compiles = server.stats().compiles

        def caller(seed):
            rng = np.random.default_rng(seed)
            while not done.is_set():
                rows = int(rng.integers(1, 13))
                try:
                    answer = js.batched_run("params-swaps", js.Batch.concatenate([np.zeros((rows, 4), np.float32)]))
                except BaseException as error:
                    failures.append(error)
                    return
                answers.append(answer)
                values = set(answer.ravel().tolist())
                if len(values) == 1:
                    answered_by.update(values)

        threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(8)]
        for thread in threads:
            thread.start()
        try:
            for version in range(1, 21):
                until(lambda: failures or version - 1 in answered_by, f"an answer of weights {version - 1}")
                server.update_params({"offset": np.full(4, version, np.float32)})
            until(lambda: failures or 20 in answered_by, "an answer of the last weights")
        finally:
            done.set()
            for thread in threads:
                thread.join(HANG_S)
        assert server.stats().compiles == compiles
        assert js.batched_run("params-swaps", js.Batch.concatenate([np.zeros((1, 4), np.float32)])).tolist() == \
            [[20.0] * 4], "update_params returns once the new weights are live"
    assert not failures
    for answer in answers:
        values = set(answer.ravel().tolist())
        assert len(values) == 1 and values <= set(map(float, range(21))), values
    assert answered_by == set(map(float, range(21))), "each set answered while the callers ran"


def test_a_batch_of_requests_pinned_to_two_weight_sets_runs_once_per_set():
    """A low-priority request split over batches keeps its weights while an urgent one started on the new: its
    first batch is held until the urgent rows are queued behind it, however fast the machine."""
    started, go = threading.Event(), threading.Event()

    def slow(params, x):
        started.set()
        assert go.wait(HANG_S), "the gate stayed shut"
        return x + params["offset"]

    serving = js.Serving(slow, params={"offset": np.zeros(1, np.float32)}, batch_size=4, batch_timeout=0,
                         priority_levels=2, compiler="eager")
    results = {}
    with js.serve(serving, name="params-pinned") as server:
        low = threading.Thread(target=lambda: results.setdefault("low", js.batched_run(
            "params-pinned", js.Batch.concatenate([np.zeros((6, 1), np.float32)]), priority=2)))
        low.start()
        until(started.is_set, "the first 4 rows of the low-priority request to run, with offset 0")
        server.update_params({"offset": np.ones(1, np.float32)})
        high = threading.Thread(target=lambda: results.setdefault("high", js.batched_run(
            "params-pinned", js.Batch.concatenate([np.zeros((6, 1), np.float32)]), priority=1)))
        high.start()
        until(lambda: server.stats().queue_depth == 8, "the urgent rows queued beside the low request's last 2")
        go.set()
        low.join(HANG_S)
        high.join(HANG_S)
        stats = server.stats()
    assert results["low"].ravel().tolist() == [0.0] * 6
    assert results["high"].ravel().tolist() == [1.0] * 6
    assert stats.batches == 3  # 4 low; 4 high; 2 high + 2 low, run as one batch of two runs


def test_process_isolation_sends_the_weights_once_and_swaps_them():
    params = weights(0, layers=2, width=512)  # 2 MB
    serving = js.Serving(dense, params=params, batch_size=2, input_template=js.template((512,), "float32"),
                         isolation="process")
    x = np.random.default_rng(3).standard_normal((3, 512), np.float32)
    with js.serve(serving, name="params-process") as server:
        executor = server._partitions[0].executor
        assert len(executor._payload) < 100_000, "the serving travels without its weights"
        np.testing.assert_allclose(js.batched_run("params-process", js.Batch.concatenate([x])),
                                   dense_numpy(params, x), rtol=1e-4, atol=1e-5)
        other = weights(5, layers=2, width=512)
        server.update_params(other)
        np.testing.assert_allclose(js.batched_run("params-process", js.Batch.concatenate([x])),
                                   dense_numpy(other, x), rtol=1e-4, atol=1e-5)
        assert list(executor._live) == [1], "the first version was dropped once nothing held it"


# load_params ------------------------------------------------------------------------------------

def mapped(array):
    """Whether ``array`` views a memory-mapped file."""
    import mmap

    base = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return isinstance(getattr(base, "obj", base), mmap.mmap)


def resident_mb(path):
    """How much of file ``path`` this process holds resident (its mappings' Rss in /proc/self/smaps)."""
    import re

    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total / 1024


def test_a_served_checkpoint_is_not_held_twice(tmp_path):
    """Once the weights are on the devices, the file's pages leave the process: one host copy, not two."""
    params = {"layers": [{"w": np.random.default_rng(i).standard_normal((1024, 1024), np.float32) / np.float32(32)}
                         for i in range(16)]}
    path = tmp_path / "big.safetensors"  # 64 MB
    save_params(path, params)
    loaded = js.load_params(path)
    assert sum(float(layer["w"][::64].sum()) for layer in loaded["layers"]) != 0 and resident_mb(path) > 1
    np.testing.assert_array_equal(loaded["layers"][3]["w"], params["layers"][3]["w"])
    assert resident_mb(path) > 60, "reading every weight brought the file's pages in"

    def model(p, x):
        for layer in p["layers"]:
            x = jnp.tanh(x @ layer["w"])
        return x

    serving = js.Serving(model, params=loaded, batch_size=2, input_template=js.template((1024,), "float32"))
    x = np.ones((1, 1024), np.float32) / 32
    with js.serve(serving, name="params-held-once"):
        assert resident_mb(path) < 1, f"{resident_mb(path):.1f} MB of the file still resident after placing"
        np.testing.assert_allclose(js.batched_run("params-held-once", js.Batch.concatenate([x])),
                                   np.asarray(model(params, x)), rtol=1e-4, atol=1e-5)

def test_load_params_maps_safetensors_and_npz_into_nested_trees(tmp_path):
    params = weights(0)
    save_params(tmp_path / "model.safetensors", params)
    loaded = js.load_params(tmp_path / "model.safetensors")
    assert isinstance(loaded["layers"], list) and len(loaded["layers"]) == 3
    for got, want in zip(loaded["layers"], params["layers"]):
        np.testing.assert_array_equal(got["w"], want["w"])
        np.testing.assert_array_equal(got["b"], want["b"])
        assert mapped(got["w"]) and not got["w"].flags.writeable
    np.savez(tmp_path / "model.npz", **{"encoder.scale": np.float32(2), "encoder.layer.0.w": np.eye(2),
                                        "encoder.layer.1.w": np.ones((2, 3), order="F")})
    loaded = js.load_params(tmp_path / "model.npz")
    assert mapped(loaded["encoder"]["layer"][1]["w"])
    np.testing.assert_array_equal(loaded["encoder"]["layer"][1]["w"], np.ones((2, 3)))
    assert loaded["encoder"]["scale"] == 2
    np.savez_compressed(tmp_path / "small.npz", x=np.arange(3))
    assert js.load_params(tmp_path / "small.npz")["x"].tolist() == [0, 1, 2]


def shard(folder, params, parts):
    """``params`` saved as shards of ``parts`` layers each, with the index transformers writes."""
    folder.mkdir()
    weight_map = {}
    for number, start in enumerate(range(0, len(params["layers"]), parts)):
        name = f"model-{number + 1:05d}.safetensors"
        part = {str(i): layer for i, layer in enumerate(params["layers"]) if start <= i < start + parts}
        save_params(folder / name, {"layers": part})
        weight_map.update({f"layers.{i}.{leaf}": name for i in map(int, part) for leaf in ("w", "b")})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def test_a_sharded_checkpoint_loads_whole_from_its_index_or_its_folder(tmp_path):
    params = weights(5, layers=5)
    folder = shard(tmp_path / "sharded", params, parts=2)
    assert len(list(folder.glob("*.safetensors"))) == 3
    for path in (folder / "model.safetensors.index.json", folder):
        loaded = js.load_params(path)
        assert len(loaded["layers"]) == 5
        for got, want in zip(loaded["layers"], params["layers"]):
            np.testing.assert_array_equal(got["w"], want["w"])
            np.testing.assert_array_equal(got["b"], want["b"])
            assert mapped(got["w"])
    single = tmp_path / "single"
    single.mkdir()
    save_params(single / "weights.safetensors", params)
    np.testing.assert_array_equal(js.load_params(single)["layers"][4]["b"], params["layers"][4]["b"])


def test_sharded_checkpoint_errors(tmp_path):
    folder = shard(tmp_path / "sharded", weights(5, layers=4), parts=2)
    index = folder / "model.safetensors.index.json"
    listing = json.loads(index.read_text())

    def refused(path):
        with pytest.raises(js.CheckpointError) as info:
            js.load_params(path)
        return str(info.value)

    index.write_text(json.dumps({**listing, "weight_map": {**listing["weight_map"], "layers.0.w": "other.safetensors"}}))
    assert refused(index) == f"{str(index)!r} names shard 'other.safetensors', which is not a file beside it"
    index.write_text(json.dumps({**listing, "weight_map": {**listing["weight_map"], "layers.0.w": "model-00002.safetensors"}}))
    assert refused(folder) == (f"{str(index)!r} and its shard 'model-00001.safetensors' disagree on which arrays "
                               f"it holds (for example layers.0.w)")
    index.write_text(json.dumps({**listing, "weight_map": {**listing["weight_map"], "layers.0.w": "../w.safetensors"}}))
    assert refused(index) == f"{str(index)!r} names shard '../w.safetensors', which is not a file beside it"
    index.write_text("{not json")
    assert refused(index).startswith(f"{str(index)!r} is not a shard index (JSON with a 'weight_map' of names to "
                                     f"shard files): JSONDecodeError(")
    index.unlink()
    assert refused(folder) == (f"cannot load weights from folder {str(folder)!r}: it holds 2 .safetensors files "
                               f"(model-00001.safetensors, model-00002.safetensors); name the one to load")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert refused(empty) == (f"cannot load weights from folder {str(empty)!r}: it holds no "
                              f".safetensors.index.json and no .safetensors file")


def test_a_loaded_checkpoint_serves(tmp_path):
    params = weights(4)
    save_params(tmp_path / "w.safetensors", params)
    serving = js.Serving(dense, params=js.load_params(tmp_path / "w.safetensors"), batch_size=2, input_template=ROW)
    x = np.ones((2, 8), np.float32)
    with js.serve(serving, name="params-loaded"):
        np.testing.assert_allclose(js.batched_run("params-loaded", js.Batch.concatenate([x])),
                                   dense_numpy(params, x), rtol=1e-5, atol=1e-6)


def test_load_params_errors(tmp_path):
    with pytest.raises(js.CheckpointError) as info:
        js.load_params(tmp_path / "w.bin")
    assert str(info.value) == (f"cannot load weights from {str(tmp_path / 'w.bin')!r}: expected a .safetensors or "
                               f".npz file, a .safetensors.index.json of shards, or a folder holding one of those")
    with pytest.raises(js.CheckpointError) as info:
        js.load_params(tmp_path / "none.safetensors")
    assert str(info.value).endswith("none.safetensors': no such file")
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(js.CheckpointError) as info:
        js.load_params(tmp_path / "bad.safetensors")
    assert "bad.safetensors' is not a readable .safetensors file: " in str(info.value)
    (tmp_path / "bad.npz").write_bytes(b"PK not a zip")
    with pytest.raises(js.CheckpointError) as info:
        js.load_params(tmp_path / "bad.npz")
    assert "bad.npz' is not a readable .npz file: " in str(info.value)
    np.savez(tmp_path / "clash.npz", **{"a": np.ones(1), "a.b": np.ones(1)})
    with pytest.raises(js.CheckpointError) as info:
        js.load_params(tmp_path / "clash.npz")
    assert str(info.value).endswith("clash.npz': 'a' is an array and also the prefix of 'a.b'")
    with zipfile.ZipFile(tmp_path / "objects.npz", "w") as archive:
        with archive.open("x.npy", "w") as member:
            np.save(member, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(js.CheckpointError) as info:
        js.load_params(tmp_path / "objects.npz")
    assert str(info.value).endswith("objects.npz': x.npy holds Python objects, not numbers; it is not loaded")


# the warning for weights compiled in as constants ----------------------------------------------

def test_large_captured_constants_are_flagged_once_and_params_are_not(caplog):
    big = np.ones((4096, 1025), np.float32)  # 16.02 MB

    def closed_over(x):
        return x @ big

    caplog.set_level(logging.WARNING, logger="jitserve.defn")
    serving = js.Serving(closed_over, batch_size=2, input_template=js.template((4096,), "float32"))
    with js.serve(serving, name="params-closure"):
        pass
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "serving function 'closed_over' captures 16.0 MB of arrays as constants, which every compiled executable "
        "embeds (the limit for this warning is 16 MB): pass them as params instead (js.Serving(fn, params=tree) "
        "calls fn(params, batch); a definition takes them as an argument)"]
    caplog.clear()
    jitted = js.jit(lambda x: x @ big)
    jitted(np.ones((1, 4096), np.float32))
    jitted(np.ones((2, 4096), np.float32))
    assert len(caplog.records) == 1 and caplog.records[0].getMessage().startswith("definition '<lambda>' captures")
    caplog.clear()
    with js.serve(js.Serving(lambda p, x: x @ p, params=big, batch_size=2,
                             input_template=js.template((4096,), "float32")), name="params-no-warning"):
        pass
    assert caplog.records == []


def test_a_function_that_gets_the_id_of_a_warned_dead_one_is_warned_too(caplog, monkeypatch):
    """The functions warned about are remembered by identity, not by id alone (ids are reused once an
    object is collected, which had silenced the warning for a new function)."""
    big = np.ones((4096, 1025), np.float32)

    def closed_over(x):
        return x @ big

    stranger = object()  # stands for the dead function whose id closed_over got
    defn = importlib.import_module("jitserve.defn")  # the module (js.defn is its decorator)
    monkeypatch.setattr(defn, "_warned", {id(closed_over): lambda: stranger})
    caplog.set_level(logging.WARNING, logger="jitserve.defn")
    defn.warn_large_constants(closed_over, [js.template((2, 4096), "float32")], "definition 'closed_over'")
    defn.warn_large_constants(closed_over, [js.template((2, 4096), "float32")], "definition 'closed_over'")
    assert [r.getMessage()[:44] for r in caplog.records] == ["definition 'closed_over' captures 16.0 MB of"]


CACHED_SERVING = """
import sys, numpy as np, jax.numpy as jnp, jitserve as js
rng = np.random.default_rng(0)
params = [rng.standard_normal((512, 512), np.float32) for _ in range(16)]  # 16 MB
def model(params, x):
    for w in params:
        x = jnp.tanh(x @ w)
    return x
serving = js.Serving(model, params=params, batch_size=4, input_template=js.template((512,), "float32"),
                     cache_dir=sys.argv[1])
with js.serve(serving, name="cached") as server:
    out = js.batched_run("cached", js.Batch.stack([np.ones(512, np.float32)]))
    print(server.stats().compiles, float(out.sum()))
"""


def test_the_persistent_compile_cache_holds_no_weights_and_a_second_process_reuses_it(tmp_path):
    """Closed over, each cached executable held its own copy of the weights (1.1 GB for a 200 MB model);
    as params, the cache holds code only, and a second process compiles nothing new into it."""
    import subprocess
    import sys

    script = tmp_path / "cached.py"
    script.write_text(CACHED_SERVING)
    cache = tmp_path / "cache"

    def run():
        done = subprocess.run([sys.executable, str(script), str(cache)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    first = run()
    files = {path: path.stat().st_size for path in cache.rglob("*") if path.is_file()}
    assert files and sum(files.values()) < 2 * 2**20, f"{sum(files.values()):,} bytes cached for 16 MB of weights"
    second = run()
    assert second == first, "same answers, from the cached executables"
    assert {path: path.stat().st_size for path in cache.rglob("*") if path.is_file()} == files, \
        "the second process found every executable in the cache"


def test_a_streaming_serving_takes_its_params_first_and_swaps_them_between_batches():
    def steps(params, x):
        for step in range(3):
            yield x * params["scale"] + step

    serving = js.Serving(steps, params={"scale": np.float32(2)}, batch_size=2, streaming=True)
    with js.serve(serving, name="params-streaming") as server:
        batch = js.Batch.stack([np.ones(1, np.float32)])
        assert [s.tolist() for s in js.batched_stream("params-streaming", batch)] == [[[2.0]], [[3.0]], [[4.0]]]
        server.update_params({"scale": np.float32(10)})
        assert [s.tolist() for s in js.batched_stream("params-streaming", batch)] == [[[10.0]], [[11.0]], [[12.0]]]


@pytest.mark.parametrize(("declared", "message"), [
    (b"'shape': (9,), }", r"w.npy declares shape \(9,\) of float32, 36 bytes, but holds 16"),
    (b"'shape': (-1,),}", r"w.npy declares shape \(-1,\) of float32, -4 bytes, but holds 16"),
])
def test_an_npz_member_whose_header_disagrees_with_its_bytes_is_refused(tmp_path, declared, message):
    """A stored .npz member's declared shape must match the bytes it holds: too large was a bare TypeError,
    and -1 mapped the zip's own directory bytes as weights."""
    path = tmp_path / "model.npz"
    np.savez(path, w=np.arange(4, dtype=np.float32))
    data = path.read_bytes()
    assert data.count(b"'shape': (4,), }") == 1
    path.write_bytes(data.replace(b"'shape': (4,), }", declared))
    with pytest.raises(js.CheckpointError, match=message):
        js.load_params(path)
