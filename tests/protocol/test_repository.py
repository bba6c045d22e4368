"""A model repository served by `jitserve serve --model-repository DIR`: load, reload and unload with tritonclient
over HTTP and gRPC under 8 concurrent callers, failed models reported by name, and the three control modes."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time

import numpy as np
import pytest

import jitserve as js
from jitserve.params import save_params

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

from netutil import start_server, stop  # noqa: E402
from waiting import until  # noqa: E402

WEIGHTED = """
from pathlib import Path

import jitserve as js

def affine(params, x):
    return x @ params["w"] + params["b"]{extra}

serving = js.Serving(affine, params=str(Path(__file__).parent / "weights.safetensors"), batch_size=4,
                     batch_timeout=0.001, input_template=js.template((4,), "float32"))
"""
DOUBLER = """
import jitserve as js

serving = js.Serving(lambda x: x * 2, batch_size=2, batch_timeout={timeout},
                     input_template=js.template((4,), "float32"))
"""
BROKEN = """
raise RuntimeError("this model needs a GPU\\nand a second line nobody reads")
"""


def weights(scale):
    return {"w": np.eye(4, dtype=np.float32) * scale, "b": np.full(4, scale, np.float32)}


def write_model(repository, name, source, params=None):
    folder = repository / name
    folder.mkdir(exist_ok=True)
    if params is not None:
        save_params(folder / "weights.safetensors", params)
    (folder / "model.py").write_text(source)


@pytest.fixture
def repository(tmp_path):
    write_model(tmp_path, "weighted", WEIGHTED.format(extra=""), weights(1))
    write_model(tmp_path, "doubler", DOUBLER.format(timeout=0.001))
    write_model(tmp_path, "broken", BROKEN)
    return tmp_path


class Client:
    """tritonclient over HTTP or gRPC, with the calls the tests make."""

    def __init__(self, protocol, running):
        self.protocol = protocol
        self.module = httpclient if protocol == "http" else grpcclient
        self.url = f"127.0.0.1:{running.port if protocol == 'http' else running.grpc_port}"
        self.client = self.module.InferenceServerClient(self.url)

    def infer(self, model, x, client=None):
        tensor = self.module.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        return (client or self.client).infer(model, [tensor]).as_numpy("output")

    def index(self):
        if self.protocol == "http":
            return {entry["name"]: entry for entry in self.client.get_model_repository_index()}
        models = self.client.get_model_repository_index(as_json=True).get("models", [])
        return {entry["name"]: {"state": "", "reason": "", **entry} for entry in models}

    def compiles(self, running, model):
        text = running.request("GET", "/metrics")[2].decode()
        return float(re.search(rf'jitserve_compiles{{model="{model}",version="1"}} (\S+)', text).group(1))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_load_reload_and_unload_under_eight_callers(repository, protocol):
    running = start_server(f"--model-repository={repository}", "--model-control-mode", "explicit",
                           "--load-model", "doubler")
    client = Client(protocol, running)
    x = np.ones((2, 4), np.float32)
    try:
        index = client.index()
        assert index["doubler"]["state"] == "READY" and index["weighted"]["state"] == "UNAVAILABLE"
        assert set(index) == {"broken", "doubler", "weighted"}
        with pytest.raises(InferenceServerException, match="unknown model 'weighted'"):
            client.infer("weighted", x)
        client.client.load_model("weighted")
        assert client.infer("weighted", x).tolist() == [[2.0] * 4] * 2
        compiles = client.compiles(running, "weighted")

        answers, failures, stop_load = [], [], threading.Event()

        def caller(model):
            own = client.module.InferenceServerClient(client.url)
            while not stop_load.is_set():
                try:
                    answers.append((model, float(client.infer(model, x, own)[0, 0])))
                except Exception as error:
                    failures.append(error)

        threads = [threading.Thread(target=caller, args=("weighted" if i < 6 else "doubler",), daemon=True)
                   for i in range(8)]
        for thread in threads:
            thread.start()
        try:
            until(lambda: ("weighted", 2.0) in answers, "the callers to be answered by the first weights")
            save_params(repository / "weighted" / "weights.safetensors", weights(3))  # model.py unchanged
            client.client.load_model("weighted")
            assert client.infer("weighted", x).tolist() == [[6.0] * 4] * 2, "new weights once load returns"
            assert client.compiles(running, "weighted") == compiles, "a weights-only reload compiles nothing"
            until(lambda: ("weighted", 6.0) in answers, "the callers to be answered by the new weights")
            write_model(repository, "weighted", WEIGHTED.format(extra=" + 100.0"))  # a new function: rebuilt
            client.client.load_model("weighted")
            assert client.infer("weighted", x).tolist() == [[106.0] * 4] * 2, "the new model once load returns"
            with pytest.raises(InferenceServerException, match="model 'broken' failed to load: this model needs "
                                                               "a GPU$"):
                client.client.load_model("broken")
            until(lambda: ("weighted", 106.0) in answers, "the callers to be answered by the new model")
        finally:
            stop_load.set()
            for thread in threads:
                thread.join(30)
        assert not failures, failures[:3]
        weighted = {value for model, value in answers if model == "weighted"}
        assert weighted <= {2.0, 6.0, 106.0} and {2.0, 6.0, 106.0} <= weighted
        assert {value for model, value in answers if model == "doubler"} == {2.0}, "the other model kept serving"
        index = client.index()
        assert index["weighted"]["state"] == "READY" and index["broken"]["state"] == "UNAVAILABLE"
        if protocol == "http":  # tritonclient's gRPC index omits the reason
            assert index["broken"]["reason"] == "load failed: this model needs a GPU"

        client.client.unload_model("weighted")
        with pytest.raises(InferenceServerException, match="unknown model 'weighted'"):
            client.infer("weighted", x)
        assert client.index()["weighted"]["state"] == "UNAVAILABLE"
        assert client.infer("doubler", x).tolist() == [[2.0] * 4] * 2
    finally:
        output = stop(running)
    assert "model 'weighted' reloaded: new weights, nothing compiled" in output


def test_unload_drains_what_the_model_holds(repository):
    write_model(repository, "doubler", DOUBLER.format(timeout=60.0))  # a request waits 60 s for its batch
    running = start_server(f"--model-repository={repository}", "--model-control-mode", "explicit",
                           "--load-model", "doubler", "--no-grpc")
    client = Client("http", running)
    x = np.ones((1, 4), np.float32)
    try:
        answered = []
        waiting = threading.Thread(target=lambda: answered.append(
            client.infer("doubler", x, httpclient.InferenceServerClient(client.url))))
        waiting.start()
        until(lambda: running.queued_rows("doubler") == 1, "the request to be queued")  # its batch not yet run
        client.client.unload_model("doubler")
        waiting.join(30)
        assert answered and answered[0].tolist() == [[2.0] * 4], "the queued request ran before the unload"
        with pytest.raises(InferenceServerException, match="unknown model 'doubler'"):
            client.infer("doubler", x)
        client.client.unload_model("doubler")  # unloading what is not loaded succeeds, as Triton's
    finally:
        stop(running)


def test_control_modes_none_and_poll(repository):
    shutil.rmtree(repository / "broken")
    running = start_server(f"--model-repository={repository}", "--no-grpc")  # none: everything, fixed
    client = Client("http", running)
    x = np.ones((1, 4), np.float32)
    try:
        assert {name: entry["state"] for name, entry in client.index().items()} == \
            {"doubler": "READY", "weighted": "READY"}
        for call in (client.client.load_model, client.client.unload_model):
            with pytest.raises(InferenceServerException) as info:
                call("doubler")
            assert "requests are refused under --model-control-mode none; start with --model-control-mode " \
                   "explicit" in str(info.value)
    finally:
        stop(running)

    running = start_server(f"--model-repository={repository}", "--model-control-mode", "poll",
                           "--repository-poll-secs", "0.2", "--no-grpc")
    client = Client("http", running)

    def wait_for(condition):
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline
            time.sleep(0.1)

    try:
        write_model(repository, "tripler", DOUBLER.format(timeout=0.001).replace("x * 2", "x * 3"))
        wait_for(lambda: client.index().get("tripler", {}).get("state") == "READY")
        assert client.infer("tripler", x).tolist() == [[3.0] * 4]
        write_model(repository, "tripler", DOUBLER.format(timeout=0.001).replace("x * 2", "x * 4"))
        wait_for(lambda: client.infer("tripler", x).tolist() == [[4.0] * 4])
        shutil.rmtree(repository / "tripler")
        wait_for(lambda: "tripler" not in client.index())
        with pytest.raises(InferenceServerException, match="explicit"):
            client.client.load_model("weighted")
    finally:
        stop(running)


def test_a_bad_repository_is_one_line(tmp_path, capsys):
    from jitserve.cli import main

    assert main(["serve", f"--model-repository={tmp_path / 'missing'}"]) == 2
    assert re.fullmatch(r"jitserve serve: --model-repository '.*missing' is not a directory\n",
                        capsys.readouterr().err)
    assert main(["serve"]) == 2
    assert capsys.readouterr().err == "jitserve serve: serve takes one of a TARGET, --hf DIR or --model-repository " \
                                      "DIR\n"


COUNTER = """
import jax.numpy as jnp
import numpy as np

import jitserve as js

def prefill(params, tokens, length):
    total = jnp.sum(jnp.where(jnp.arange(tokens.shape[0]) < length, tokens, 0))
    return {"last": total}, total

def decode(params, state, last):
    following = last + params["step"]
    return {"last": following}, following

serving = js.Generation(prefill, decode, params={"step": np.int32(1)}, slots=2, max_length=32, prefill_lengths=[8])
"""


def test_a_generation_loads_from_the_repository_too(repository):
    write_model(repository, "counter", COUNTER)
    running = start_server(f"--model-repository={repository}", "--model-control-mode", "explicit", "--no-grpc")
    try:
        status, _, _ = running.request("POST", "/v2/repository/models/counter/load", b"{}")
        assert status == 200
        payload = {"inputs": [{"name": "prompt", "datatype": "INT32", "shape": [3], "data": [1, 2, 3]}],
                   "parameters": {"max_steps": 4}}
        status, body = running.infer_json("counter", payload)
        assert status == 200 and body["outputs"][0]["data"] == [6, 7, 8, 9]
        status, _, _ = running.request("POST", "/v2/repository/models/counter/unload", b"{}")
        assert status == 200 and running.infer_json("counter", payload)[0] == 404
    finally:
        stop(running)


def test_names_clients_make_up_leave_no_trace(repository):
    from jitserve.protocol.repository import ModelRepository
    from jitserve.protocol.service import InferenceService

    models = ModelRepository(repository, InferenceService({}), "explicit")
    for name in ("nope", "..", "a/b"):
        with pytest.raises(js.RepositoryError, match=f"model '{re.escape(name)}' is not in the repository"):
            models.load(name, None)
        with pytest.raises(js.UnknownServerError, match="it is not in the repository and not loaded"):
            models.unload(name, None)
    models.unload("doubler", None)  # in the directory, never loaded: nothing to do
    assert models._models == {}, "no entry for a name that was never loaded"


EXITING = """
import sys

sys.exit(3)
"""


def test_a_model_that_exits_or_interrupts_is_a_failed_load_and_every_front_keeps_serving(repository):
    """``sys.exit()`` or ``KeyboardInterrupt`` in a model.py is that model's failed load, over gRPC and HTTP
    alike, and at start: the server, its gRPC front included, keeps serving the others."""
    write_model(repository, "exiting", EXITING)
    write_model(repository, "interrupting", "raise KeyboardInterrupt('from model.py')\n")
    running = start_server(f"--model-repository={repository}", "--model-control-mode", "explicit",
                           "--load-model", "exiting", "--load-model", "doubler")
    try:
        grpc = Client("grpc", running)
        http = Client("http", running)
        with pytest.raises(InferenceServerException, match=r"model 'exiting' failed to load: model.py raised "
                                                            r"SystemExit\(3\) while it ran"):
            grpc.client.load_model("exiting")
        with pytest.raises(InferenceServerException, match=r"model 'interrupting' failed to load: model.py raised "
                                                            r"KeyboardInterrupt\(from model.py\)"):
            http.client.load_model("interrupting")
        assert grpc.index()["exiting"]["state"] == "UNAVAILABLE"
        x = np.ones((1, 4), np.float32)
        assert grpc.infer("doubler", x).tolist() == http.infer("doubler", x).tolist() == [[2.0] * 4]
    finally:
        output = stop(running)
    assert "model 'exiting' failed to load: model.py raised SystemExit(3)" in output


def test_polling_outlives_the_directory_going_away_for_a_moment(repository, tmp_path_factory):
    from jitserve.protocol.repository import ModelRepository
    from jitserve.protocol.service import InferenceService

    service = InferenceService({})
    polled = ModelRepository(repository, service, "poll", poll_seconds=0.05)
    polled.start()
    try:
        assert "doubler" in service.models
        aside = tmp_path_factory.mktemp("aside") / "repository"
        repository.rename(aside)
        time.sleep(0.3)  # polls that find no directory
        aside.rename(repository)
        write_model(repository, "doubler2", DOUBLER.format(timeout=0.001))
        deadline = time.monotonic() + 60
        while "doubler2" not in service.models and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "doubler2" in service.models, "a model added after the directory came back is loaded"
    finally:
        polled.stop()
        for name in list(service.models):
            for server in service.remove(name):
                server.stop()


@pytest.mark.parametrize("seconds", ["0", "-1", "nan", "1e30"])
def test_a_poll_interval_that_would_spin_or_overflow_is_refused(repository, capsys, seconds):
    from jitserve.cli import main

    assert main(["serve", f"--model-repository={repository}", "--model-control-mode", "poll",
                 f"--repository-poll-secs={seconds}"]) == 2
    assert capsys.readouterr().err.startswith("jitserve serve: --repository-poll-secs must be a number of seconds "
                                              "from 0.01 to 31,536,000, got ")


def test_a_name_too_long_for_the_filesystem_is_not_in_the_repository_and_is_quoted_short(repository):
    from jitserve.protocol.repository import ModelRepository
    from jitserve.protocol.service import InferenceService

    models = ModelRepository(repository, InferenceService({}), "explicit")
    for name in ("x" * 256, "é" * 200, "y" * 20_000, "nul\0byte"):
        with pytest.raises(js.RepositoryError, match=r"is not in the repository") as raised:
            models.load(name, None)
        assert len(str(raised.value)) < 200 and str(repository) not in str(raised.value)
        with pytest.raises(js.UnknownServerError, match=r"characters\)|nul"):
            models.unload(name, None)
    assert models._models == {}


GATED = """
import time
from pathlib import Path

import jitserve as js

(Path(__file__).parent / "loading").touch()  # the test knows the load has started
while not (Path(__file__).parent / "open").exists():  # a load that lasts until the test opens the gate
    time.sleep(0.02)
serving = js.Serving(lambda x: x * 2, batch_size=2, batch_timeout=0.001, input_template=js.template((4,), "float32"))
"""


PER_MODEL = "8 loads and unloads of model 'gated' are running or waiting (--max-loads-per-model); try again once " \
    "one ends"
ALL_MODELS = "16 model loads and unloads are running; try '{}' again once one ends"


def test_many_slow_loads_hold_no_shared_pool_and_sigterm_during_a_load_exits(repository):
    """40 loads of a model whose model.py does not return leave the server free: 8 are taken
    (--max-loads-per-model), each on a daemon thread of its own, not in the event loop's shared pool, the rest
    refused 503 with Retry-After, so that another model still loads (issue 56: the 16 places of all models
    went to the one model); 9 loads of a second such model fill the 16 places, and one more load of any model
    is refused alike; a request body of over 1 MiB (decoded off the event loop) is answered; once the gated
    loads end, another model loads; and SIGTERM while a load hangs exits."""
    for name in ("gated", "gated2"):
        write_model(repository, name, GATED)
    running = start_server(f"--model-repository={repository}", "--model-control-mode", "explicit",
                           "--load-model", "doubler", "--drain-timeout", "2", "--max-loads-per-model", "8")
    answers: dict[str, list] = {"gated": [], "gated2": []}

    def load(name):
        answers[name].append(running.request("POST", f"/v2/repository/models/{name}/load", b"{}", timeout=120))

    def loading(name, count):
        for thread in [threading.Thread(target=load, args=(name,), daemon=True) for _ in range(count)]:
            thread.start()

    def refusals(name, count) -> set[str]:
        """The texts of the first ``count`` answers to loads of ``name`` once they came, each a 503 to retry."""
        until(lambda: len(answers[name]) >= count, f"{count} loads of '{name}' answered")
        assert {(status, headers.get("retry-after")) for status, headers, _ in answers[name]} == {(503, "1")}
        return {json.loads(body)["error"] for _, _, body in answers[name]}

    try:
        loading("gated", 40)
        # past the 8th, each is refused as the 9th of 'gated', or as the 17th of all while refused ones held places
        texts = refusals("gated", 32)
        assert PER_MODEL in texts and texts <= {PER_MODEL, ALL_MODELS.format("gated")}
        assert running.request("POST", "/v2/repository/models/doubler/load", b"{}")[0] == 200
        loading("gated2", 9)  # 8 places left: the last of these to arrive is refused, the others wait
        assert refusals("gated2", 1) == {ALL_MODELS.format("gated2")}
        status, _, body = running.request("POST", "/v2/repository/models/doubler/load", b"{}")
        assert (status, json.loads(body)["error"]) == (503, ALL_MODELS.format("doubler"))
        big = np.ones((2**16 + 1, 4), np.float32)  # over 1 MiB as JSON, decoded off the event loop
        status, answer = running.infer_json("doubler", {"inputs": [{"name": "input", "datatype": "FP32",
                                                                    "shape": list(big.shape),
                                                                    "data": big.ravel().tolist()}]})
        assert status == 200 and answer["outputs"][0]["data"][:4] == [2.0] * 4
        for name in ("gated", "gated2"):
            write_model(repository, name, GATED.replace('while not (Path(__file__).parent / "open").exists()',
                                                        "while False"))
            (repository / name / "open").touch()  # the gated loads end, one after another (each reloads it)
        until(lambda: len(answers["gated"]) == 40 and len(answers["gated2"]) == 9, "every gated load answered")
        assert running.request("POST", "/v2/repository/models/doubler/load", b"{}")[0] == 200
        (repository / "gated" / "open").unlink()
        write_model(repository, "gated", GATED)
        hanging = threading.Thread(target=load, args=("gated",), daemon=True)
        (repository / "gated" / "loading").unlink()
        hanging.start()
        until(lambda: (repository / "gated" / "loading").exists(), "the load that never ends to start")
    finally:
        output = stop(running)  # SIGTERM with the gated loads still running; stop() asserts exit code 0
    assert "Traceback" not in output
    assert "exiting with the load of model 'gated' still running: abandoned" in output


@pytest.mark.parametrize("count", ["0", "17"])
def test_a_count_of_loads_per_model_past_the_count_of_all_is_refused(repository, capsys, count):
    from jitserve.cli import main

    assert main(["serve", f"--model-repository={repository}", "--model-control-mode", "explicit",
                 f"--max-loads-per-model={count}"]) == 2
    assert capsys.readouterr().err.startswith(f"jitserve serve: --max-loads-per-model must be a count from 1 to 16 "
                                              f"(the loads and unloads of all models taken at once), got {count}")


def test_a_load_that_never_finishes_fails_at_the_load_timeout_and_the_model_loads_again(repository):
    from jitserve.protocol.repository import ModelRepository
    from jitserve.protocol.service import InferenceService

    write_model(repository, "gated", GATED)
    service = InferenceService({})
    models = ModelRepository(repository, service, "explicit", load_timeout=0.5)
    try:
        with pytest.raises(js.RepositoryError, match=r"model 'gated' failed to load: model.py did not finish "
                                                     r"within 0.5 s \(--model-load-timeout\); that run is abandoned"):
            models.load("gated", None)
        assert {e["name"]: e["state"] for e in models.index(False)}["gated"] == "UNAVAILABLE"
        (repository / "gated" / "open").touch()
        models.load("gated", None)
        assert {e["name"]: e["state"] for e in models.index(False)}["gated"] == "READY"
    finally:
        for name in list(service.models):
            for server in service.remove(name):
                server.stop()


def test_a_failed_load_shows_the_client_the_model_not_the_servers_paths(repository):
    """The client's error and the repository index name the model (its folder from the repository), never
    the server's filesystem; the server's log keeps the paths."""
    write_model(repository, "unweighted", WEIGHTED.format(extra=""))  # its weights.safetensors is not there
    write_model(repository, "elsewhere", "open('/nonexistent-jitserve/outside/data.bin')\n")  # not in the repository
    write_model(repository, "empty", "serving = None\n")
    running = start_server(f"--model-repository={repository}", "--model-control-mode", "explicit")
    try:
        http, grpc = Client("http", running), Client("grpc", running)
        errors = {}
        for name, client in (("unweighted", http), ("elsewhere", grpc), ("empty", http)):
            with pytest.raises(InferenceServerException) as refused:
                client.client.load_model(name)
            errors[name] = str(refused.value)
        reasons = {name: entry["reason"] for name, entry in http.index().items()}
    finally:
        output = stop(running)
    assert "model 'unweighted' failed to load: cannot load weights from 'unweighted/weights.safetensors': no " \
           "such file" in errors["unweighted"]
    assert "model 'elsewhere' failed to load: [Errno 2] No such file or directory: 'data.bin'" in errors["elsewhere"]
    assert "model 'empty' failed to load: empty/model.py must define serving = js.Serving(...)" in errors["empty"]
    assert reasons["unweighted"] == "load failed: cannot load weights from 'unweighted/weights.safetensors': no " \
                                    "such file"
    shown = " ".join([*errors.values(), *reasons.values()])
    assert str(repository) not in shown and str(repository.resolve()) not in shown and "outside" not in shown
    assert f"cannot load weights from '{repository / 'unweighted' / 'weights.safetensors'}'" in output
    assert "'/nonexistent-jitserve/outside/data.bin'" in output
