"""Reloading a served model's weights over the network (Triton's repository load), under load, with no compile."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from jitserve.params import save_params

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

from netutil import start_server, stop  # noqa: E402

MODEL = """
import jax.numpy as jnp
import jitserve as js

def affine(params, x):
    return x @ params["w"] + params["b"]

weighted = js.Serving(affine, params={path!r}, batch_size=8, batch_timeout=0.001,
                      input_template=js.template((4,), "float32"))
fixed = js.Serving(lambda x: x * 2, batch_size=2, input_template=js.template((4,), "float32"))
models = {{"weighted": weighted, "fixed": fixed}}
"""


def weights(scale):
    return {"w": np.eye(4, dtype=np.float32) * scale, "b": np.full(4, scale, np.float32)}


def test_tritonclient_load_model_reloads_the_weights_under_load_without_a_compile(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_params(path, weights(1))
    (tmp_path / "models.py").write_text(MODEL.format(path=str(path)))
    running = start_server(f"{tmp_path / 'models.py'}:models", "--no-grpc")
    client = httpclient.InferenceServerClient(f"127.0.0.1:{running.port}")
    x = np.ones((2, 4), np.float32)

    def infer(via=client):
        tensor = httpclient.InferInput("input", [2, 4], "FP32")
        tensor.set_data_from_numpy(x)
        return via.infer("weighted", [tensor]).as_numpy("output")

    answers, failures = [], []
    stop_load = threading.Event()

    def caller():
        own = httpclient.InferenceServerClient(f"127.0.0.1:{running.port}")  # a client per thread (gevent)
        while not stop_load.is_set():
            try:
                answers.append(float(infer(own)[0, 0]))
            except Exception as error:
                failures.append(error)

    try:
        assert infer().tolist() == [[2.0] * 4] * 2
        threads = [threading.Thread(target=caller, daemon=True) for _ in range(8)]
        for thread in threads:
            thread.start()
        try:
            save_params(path, weights(3))  # a new file renamed over the old: the server still maps the old
            client.load_model("weighted")
            after = infer().tolist()
        finally:
            stop_load.set()
            for thread in threads:
                thread.join(30)
        assert after == [[6.0] * 4] * 2, "the new weights answer once load_model returns"
        assert not failures and set(answers) <= {2.0, 6.0} and len(answers) > 10
        save_params(path, {"w": np.eye(4, 2, dtype=np.float32), "b": np.zeros(4, np.float32)})
        with pytest.raises(InferenceServerException) as info:
            client.load_model("weighted")
        assert "params['w']: expected float32(4, 4), got float32(4, 2)" in str(info.value)
        assert infer().tolist() == [[6.0] * 4] * 2, "the old weights keep serving"
        with pytest.raises(InferenceServerException) as info:
            client.load_model("fixed")
        assert "model 'fixed' was given its weights as arrays, not as a file (Serving(params=PATH)): there is " \
               "nothing to reload" in str(info.value)
        with pytest.raises(InferenceServerException) as info:
            client.load_model("weighted", config=json.dumps({"max_batch_size": 4}))
        assert "load parameters (config) are not supported" in str(info.value)
        with pytest.raises(InferenceServerException) as info:
            client.load_model("nope")
        assert "unknown model 'nope'" in str(info.value)
    finally:
        output = stop(running)
    assert output.count("compiled batch size") == 4 + 2, "the reloads compiled nothing"
