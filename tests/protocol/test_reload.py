"""Reloading a served model's weights over the network (Triton's repository load), under load, with no compile:
servings and generations, given their weights as a file or from a model repository."""

from __future__ import annotations

import json
import re
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


GENERATION = """
from pathlib import Path

import jax.numpy as jnp
import jitserve as js

def prefill(params, tokens, length):
    total = jnp.sum(tokens) * params["scale"][0]
    return {{"total": total}}, total

def decode(params, state, last):
    return state, state["total"]  # each output repeats the first: the prompt's sum times the weight

serving = js.Generation(prefill, decode, params={path}, slots=2, max_length=16, prefill_lengths=[8])
"""


def compiled(running, model):
    text = running.request("GET", "/metrics")[2].decode()
    return float(re.search(rf'jitserve_compiles{{model="{model}",version="1"}} (\S+)', text).group(1))


def generate(client, model, prompt, steps=3):
    tensor = httpclient.InferInput("prompt", [len(prompt)], "INT32")
    tensor.set_data_from_numpy(np.array(prompt, np.int32))
    return client.infer(model, [tensor], parameters={"max_steps": steps}).as_numpy("output").tolist()


@pytest.mark.parametrize("source", ["file", "repository"])
def test_a_generations_weights_reload_over_the_network_between_requests_without_a_compile(tmp_path, source):
    """Given as a file (params=PATH), load_model reloads them; from a repository, a load with model.py
    unchanged swaps them. Requests in slots finish with the weights they started with."""
    folder = tmp_path / "counter"
    folder.mkdir()
    path = folder / "weights.safetensors"
    save_params(path, {"scale": np.array([1], np.int32)})
    if source == "file":
        (folder / "model.py").write_text(GENERATION.format(path=repr(str(path))))
        running = start_server(f"{folder / 'model.py'}:serving", "--no-grpc")
        model = "model"
    else:
        (folder / "model.py").write_text(GENERATION.format(path='str(Path(__file__).parent / "weights.safetensors")'))
        running = start_server(f"--model-repository={tmp_path}", "--model-control-mode", "explicit",
                               "--load-model", "counter", "--no-grpc")
        model = "counter"
    client = httpclient.InferenceServerClient(f"127.0.0.1:{running.port}")
    answers, failures, stop_load = [], [], threading.Event()

    def caller():
        own = httpclient.InferenceServerClient(f"127.0.0.1:{running.port}")
        while not stop_load.is_set():
            try:
                answers.append(generate(own, model, [1, 2, 3], 8))
            except Exception as error:
                failures.append(error)

    try:
        assert generate(client, model, [1, 2, 3]) == [6, 6, 6]
        compiles = compiled(running, model)
        threads = [threading.Thread(target=caller, daemon=True) for _ in range(4)]
        for thread in threads:
            thread.start()
        try:
            save_params(path, {"scale": np.array([5], np.int32)})
            client.load_model(model)
            after = generate(client, model, [1, 2, 3])
        finally:
            stop_load.set()
            for thread in threads:
                thread.join(30)
        assert after == [30, 30, 30], "the new weights generate once load_model returns"
        assert not failures and {tuple(answer) for answer in answers} <= {(6,) * 8, (30,) * 8}
        assert compiled(running, model) == compiles == 2 + 2 + 1, "the reload compiled nothing"
        save_params(path, {"scale": np.array([1, 2], np.int32)})
        if source == "file":
            with pytest.raises(InferenceServerException) as info:
                client.load_model(model)
            assert "params['scale']: expected int32(1), got int32(2)" in str(info.value)
            assert generate(client, model, [1, 2, 3]) == [30, 30, 30], "the old weights keep generating"
        else:  # weights of other shapes: the repository builds the model anew
            client.load_model(model)
            assert generate(client, model, [1, 2, 3]) == [6, 6, 6]
    finally:
        output = stop(running)
    if source == "repository":
        assert output.count("model 'counter' reloaded: new weights, nothing compiled") == 1


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
        assert "model 'fixed' was given its weights as arrays, not as a file (params=PATH): there is nothing to " \
               "reload" in str(info.value)
        with pytest.raises(InferenceServerException) as info:
            client.load_model("weighted", config=json.dumps({"max_batch_size": 4}))
        assert "load parameters (config) are not supported" in str(info.value)
        with pytest.raises(InferenceServerException) as info:
            client.load_model("nope")
        assert "unknown model 'nope'" in str(info.value)
        path.unlink()
        with pytest.raises(InferenceServerException) as info:
            client.load_model("weighted")  # the client sees the file's name, not the server's path
        assert "cannot load weights from 'weights.safetensors': no such file" in str(info.value)
        assert str(tmp_path) not in str(info.value) and infer().tolist() == [[6.0] * 4] * 2
    finally:
        output = stop(running)
    assert output.count("compiled batch size") == 4 + 2, "the reloads compiled nothing"
    assert f"model 'weighted': its weights did not reload: cannot load weights from '{path}'" in output
