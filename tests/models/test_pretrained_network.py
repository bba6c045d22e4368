"""Checkpoints behind the real ``jitserve serve``: ``--hf DIR`` answers tritonclient over HTTP and the gRPC
stream with the text ``js.generate`` gives in process (Triton's LLM convention: ``text_input``,
``text_output``, ``max_tokens``), refuses a parameter it does not know by name, exits with one line on a
checkpoint that does not fit, and a repository of two checkpoint folders loads, reloads (weights only
when only weights changed) and unloads them under load with no failed request. Loopback only."""

from __future__ import annotations

import json
import queue
import re
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from safetensors.numpy import load_file, save_file
from tritonclient.utils import InferenceServerException

import jitserve as js
from netutil import start_server, stop

PROMPT = "Once upon a time"
STEPS = 12
# a load compiles a checkpoint's programs: minutes on a busy machine, past tritonclient's 60 s socket timeout;
# this bound catches a hang, it times nothing
SLOW_CALLS = 600.0
PENALTIES = {"repetition_penalty": 0.6, "presence_penalty": -1.5}  # below neutral: repeats favoured
BIAS = {3: 9.0, 7: -100.0}  # token ids -> biases (logit_bias)


@pytest.fixture(scope="module")
def expected(made):
    """What js.generate gives in process for PROMPT, per checkpoint (and with PENALTIES)."""
    answers = {}
    for variant in ("llama-tied", "gpt2-8-heads"):
        with js.serve(js.from_pretrained(made(variant), slots=2), name=f"in-process-{variant}"):
            answers[variant] = js.generate(f"in-process-{variant}", PROMPT, max_steps=STEPS)
            answers[variant, "penalized"] = js.generate(f"in-process-{variant}", PROMPT, max_steps=STEPS,
                                                        **PENALTIES)
            answers[variant, "biased"] = js.generate(f"in-process-{variant}", PROMPT, max_steps=STEPS,
                                                     logit_bias=BIAS)
    return answers


def text_input(module, prompt=PROMPT):
    tensor = module.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    return tensor


def test_serve_hf_sizes_the_paged_cache_refuses_what_never_fits_and_reports_its_blocks(made):
    running = start_server(f"--hf={made('llama-tied')}", "--name", "llm", "--slots", "4", "--max-length", "128",
                           "--kv-cache-tokens", "64")
    try:
        status, refusal = running.infer_json("llm", json.dumps({"inputs": [
            {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [PROMPT]}],
            "parameters": {"max_tokens": 100}}).encode())
        assert status == 400 and re.search(r"the prompt \(\d+ tokens\) and its outputs \(max_steps 100\) need \d+ "
                                           r"positions of KV cache; the whole cache of generation server 'llm' "
                                           r"holds 64 \(4 blocks of 16\)", refusal["error"]), refusal
        status, answer = running.infer_json("llm", json.dumps({"inputs": [
            {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [PROMPT]}],
            "parameters": {"max_tokens": 4}}).encode())
        assert status == 200, answer
        metrics = running.request("GET", "/metrics")[2].decode()
        for line in ('jitserve_generation_kv_blocks{model="llm",version="1"} 4.0',
                     'jitserve_generation_kv_blocks_used{model="llm",version="1"} 0.0',
                     'jitserve_generation_slots{model="llm",version="1"} 4.0'):
            assert line in metrics, line
        assert re.search(r'jitserve_generation_prefix_lookups_total\{model="llm",version="1"\} \d', metrics)
        assert re.search(r'jitserve_generation_preemptions_total\{model="llm",version="1"\} 0\.0', metrics)
    finally:
        output = stop(running)
    assert "Traceback" not in output


def test_serve_hf_on_a_checkpoint_that_does_not_fit_exits_with_one_line(made, tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(made("llama-tied"), folder)
    (path,) = folder.glob("*.safetensors")
    weights = dict(load_file(path))
    weights.pop("model.norm.weight")
    save_file(weights, path)
    done = subprocess.run([sys.executable, "-m", "jitserve", "serve", "--hf", str(folder)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"jitserve serve: checkpoint {str(folder)!r}: weight 'model.norm.weight' is missing; config.json implies "
        f"it, shaped (64,)"]


def test_a_repository_of_two_checkpoints_loads_reloads_and_unloads_them_under_load(made, expected, tmp_path):
    for variant in ("llama-tied", "gpt2-8-heads"):
        shutil.copytree(made(variant), tmp_path / variant)
    running = start_server(f"--model-repository={tmp_path}", "--model-control-mode", "explicit")
    client = httpclient.InferenceServerClient(f"127.0.0.1:{running.port}", network_timeout=SLOW_CALLS)
    failures, answers, stopping = [], [], threading.Event()

    def call(model):
        own = httpclient.InferenceServerClient(f"127.0.0.1:{running.port}",  # a client per thread (gevent's)
                                               network_timeout=SLOW_CALLS)
        while not stopping.is_set():
            try:
                result = own.infer(model, [text_input(httpclient)], parameters={"max_tokens": STEPS})
                answers.append((model, result.as_numpy("text_output")[0].decode()))
            except Exception as error:
                failures.append(repr(error))

    try:
        for variant in ("llama-tied", "gpt2-8-heads"):
            client.load_model(variant)
        callers = [threading.Thread(target=call, args=(v,)) for v in ("llama-tied", "gpt2-8-heads") * 2]
        for caller in callers:
            caller.start()
        while {model for model, _ in answers} != {"llama-tied", "gpt2-8-heads"}:  # both answer the old weights
            assert not failures, failures
            threading.Event().wait(0.05)
        (path,) = (tmp_path / "gpt2-8-heads").glob("*.safetensors")
        weights = dict(load_file(path))
        save_file({**weights, "transformer.ln_f.bias": weights["transformer.ln_f.bias"] + 1}, path)
        client.load_model("gpt2-8-heads")  # new weights, same shapes: swapped, nothing compiles
        before = len(answers)
        while sum(model == "gpt2-8-heads" for model, _ in answers[before:]) < 2:
            assert not failures, failures
            threading.Event().wait(0.05)
        stopping.set()
        for caller in callers:
            caller.join(SLOW_CALLS)
        client.unload_model("llama-tied")
        assert not client.is_model_ready("llama-tied") and client.is_model_ready("gpt2-8-heads")
        (tmp_path / "gpt2-8-heads" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
        with pytest.raises(Exception, match=r"model 'gpt2-8-heads' failed to load: checkpoint 'gpt2-8-heads': "
                                            r"config.json has no 'n_positions'.*the version loaded before still "
                                            r"serves") as refused:
            client.load_model("gpt2-8-heads")
        assert str(tmp_path) not in str(refused.value)
    finally:
        stopping.set()
        output = stop(running)
    assert failures == []
    assert {text for model, text in answers if model == "llama-tied"} == {expected["llama-tied"]}
    gpt2 = [text for model, text in answers if model == "gpt2-8-heads"]
    assert gpt2[0] == expected["gpt2-8-heads"] and gpt2[-1] != expected["gpt2-8-heads"]  # old weights, then new
    assert re.search(r"model 'gpt2-8-heads' reloaded: new weights, nothing compiled", output), output


def test_serve_hf_classifier_lists_its_text_input_and_answers_labels(tmp_path):
    from checkpoints import bert

    folder = bert(tmp_path / "classifier", "classification")
    expected = js.from_pretrained(folder).run(["a great film", "terrible"])
    running = start_server(f"--hf={folder}", "--name", "bert")
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{running.port}")
        metadata = client.get_model_metadata("bert")
        assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["inputs"]] == [("text", "BYTES", [-1])]
        assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["outputs"]] == [
            ("label", "BYTES", [-1]), ("probabilities", "FP32", [-1, 3])]
        text = httpclient.InferInput("text", [2], "BYTES")
        text.set_data_from_numpy(np.array([b"a great film", b"terrible"], dtype=object))
        top = httpclient.InferRequestedOutput("probabilities", class_count=1)
        answer = client.infer("bert", [text], outputs=[httpclient.InferRequestedOutput("label"), top])
        assert answer.as_numpy("label").tolist() == expected["label"].tolist()
        assert [row[0].decode().rsplit(":", 1)[1] for row in answer.as_numpy("probabilities")] == \
            [label.decode() for label in expected["label"]]
        status, refusal = running.infer_json("bert", json.dumps({"inputs": [
            {"name": "foo", "datatype": "BYTES", "shape": [1], "data": ["x"]}]}).encode())
        assert status == 400 and "unknown input 'foo' for model 'bert'; expected: text" in refusal["error"]
    finally:
        output = stop(running)
    assert "Traceback" not in output


@pytest.fixture(scope="module")
def llm(made):
    """``jitserve serve --hf`` of the tied Llama, as model ``llm``."""
    running = start_server(f"--hf={made('llama-tied')}", "--name", "llm")
    yield running
    assert "Traceback" not in stop(running)


def tensor(module, name, value, datatype, shape=(1,)):
    array = np.array(value, dtype=object if datatype == "BYTES" else None).reshape(shape)
    made = module.InferInput(name, list(shape), datatype)
    made.set_data_from_numpy(array.astype({"INT32": np.int32, "BOOL": np.bool_, "FP32": np.float32,
                                           "UINT64": np.uint64}.get(datatype, object)))
    return made


def streamed(running, inputs, **options):
    """The responses of one request over the gRPC stream (``ModelStreamInfer``), up to the last one."""
    pieces: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{running.grpc_port}")
    try:
        client.start_stream(callback=lambda result, error: pieces.put(error or result))
        client.async_stream_infer("llm", inputs, enable_empty_final_response=True, **options)
        answers = []
        while True:
            item = pieces.get(timeout=60)
            assert not isinstance(item, Exception), item
            if item.get_response().parameters["triton_final_response"].bool_param:
                return answers
            answers.append(item.as_numpy("text_output").reshape(-1)[0].decode())
    finally:
        client.stop_stream()
        client.close()  # no gRPC channel left in this process: a later fork would wait on its threads


def test_serve_hf_answers_tritonclient_over_http_and_the_grpc_stream_as_in_process(llm, expected):
    http = httpclient.InferenceServerClient(f"127.0.0.1:{llm.port}")
    metadata = http.get_model_metadata("llm")
    assert [(t["name"], t["datatype"]) for t in metadata["outputs"]] == [("text_output", "BYTES")]
    answer = http.infer("llm", [text_input(httpclient)], parameters={"max_tokens": STEPS})
    assert answer.as_numpy("text_output")[0].decode() == expected["llama-tied"]
    pieces = streamed(llm, [text_input(grpcclient)], parameters={"max_tokens": STEPS})
    assert "".join(pieces) == expected["llama-tied"] and len(pieces) > 1

    status, _, body = llm.request("POST", "/v2/models/llm/generate", json.dumps(
        {"id": "g", "text_input": PROMPT, "max_tokens": STEPS}).encode())
    assert status == 200 and json.loads(body) == {"model_name": "llm", "model_version": "1", "id": "g",
                                                  "text_output": expected["llama-tied"]}
    status, headers, body = llm.request("POST", "/v2/models/llm/generate_stream", json.dumps(
        {"text_input": PROMPT, "parameters": {"max_tokens": STEPS, "stream": True}}).encode())
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[len(b"data: "):]) for line in body.split(b"\n\n") if line.startswith(b"data: ")]
    assert "".join(event["text_output"] for event in events) == expected["llama-tied"] and len(events) > 1
    status, _, body = llm.request("POST", "/v2/models/llm/generate", json.dumps(
        {"text_input": PROMPT, "stream": True}).encode())
    assert status == 400 and "POST to generate_stream instead" in json.loads(body)["error"]

    status, refusal = llm.infer_json("llm", json.dumps({"inputs": [
        {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [PROMPT]}],
        "parameters": {"max_tokens": 4, "beam_width": 2}}).encode())
    assert status == 400 and "does not take the parameter 'beam_width'" in refusal["error"]


def test_tensorrtllm_and_vllm_requests_as_genai_perf_sends_them(llm, expected):
    """The optional inputs are in the metadata and, ``optional``, in the config over both protocols (so that
    perf_analyzer sends them); TensorRT-LLM's tensors ([1, 1]: its batch axis) and vLLM's
    ``sampling_parameters`` give the text of the same ``max_tokens`` as the parameter does."""
    http = httpclient.InferenceServerClient(f"127.0.0.1:{llm.port}")
    inputs = [(t["name"], t["datatype"], t["shape"]) for t in http.get_model_metadata("llm")["inputs"]]
    assert inputs == [("text_input", "BYTES", [1]), ("max_tokens", "INT32", [1]), ("temperature", "FP32", [1]),
                      ("top_p", "FP32", [1]), ("top_k", "INT32", [1]), ("seed", "UINT64", [1]),
                      ("stop", "BYTES", [-1]), ("stop_token_ids", "INT32", [-1]), ("min_tokens", "INT32", [1]),
                      ("min_length", "INT32", [1]), ("repetition_penalty", "FP32", [1]),
                      ("presence_penalty", "FP32", [1]), ("frequency_penalty", "FP32", [1]), ("stream", "BOOL", [1]),
                      ("exclude_input_in_output", "BOOL", [1]), ("sampling_parameters", "BYTES", [1])]
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{llm.grpc_port}")
    for config in (http.get_model_config("llm"), grpc.get_model_config("llm", as_json=True)["config"]):
        assert [(t["name"], t.get("optional", False)) for t in config["input"]] == \
            [(name, name != "text_input") for name, _, _ in inputs]
    grpc.close()

    tensorrtllm = [tensor(grpcclient, "text_input", [PROMPT.encode()], "BYTES", (1, 1)),
                   tensor(grpcclient, "max_tokens", [STEPS], "INT32", (1, 1)),
                   tensor(grpcclient, "stream", [True], "BOOL", (1, 1)),
                   tensor(grpcclient, "exclude_input_in_output", [True], "BOOL", (1, 1))]
    pieces = streamed(llm, tensorrtllm)
    assert "".join(pieces) == expected["llama-tied"] and len(pieces) > 1
    vllm = [text_input(grpcclient), tensor(grpcclient, "sampling_parameters",
                                           [json.dumps({"max_tokens": str(STEPS)}).encode()], "BYTES"),
            tensor(grpcclient, "exclude_input_in_output", [True], "BOOL")]
    pieces = streamed(llm, [*vllm, tensor(grpcclient, "stream", [True], "BOOL")])
    assert "".join(pieces) == expected["llama-tied"] and len(pieces) > 1
    assert streamed(llm, [*vllm, tensor(grpcclient, "stream", [False], "BOOL")]) == [expected["llama-tied"]]
    fixed_length = tensor(grpcclient, "sampling_parameters", [json.dumps(  # genai-perf's --extra-inputs, vLLM's
        {"max_tokens": STEPS, "ignore_eos": True, "min_p": 0.05}).encode()], "BYTES")
    assert "".join(streamed(llm, [text_input(grpcclient), fixed_length])) == expected["llama-tied"], \
        "greedy: min_p cuts nothing the argmax keeps, and no end token comes within these steps"
    assert expected["llama-tied", "biased"] != expected["llama-tied"]
    biased = tensor(grpcclient, "sampling_parameters", [json.dumps(  # vLLM's logit_bias: ids as JSON's keys
        {"max_tokens": STEPS, "logit_bias": {str(token): value for token, value in BIAS.items()}}).encode()], "BYTES")
    assert "".join(streamed(llm, [text_input(grpcclient), biased])) == expected["llama-tied", "biased"]
    assert expected["llama-tied", "penalized"] != expected["llama-tied"]
    penalties = [tensor(grpcclient, name, [value], "FP32", (1, 1)) for name, value in PENALTIES.items()]
    assert "".join(streamed(llm, [*tensorrtllm, *penalties])) == expected["llama-tied", "penalized"]
    as_vllm = tensor(grpcclient, "sampling_parameters", [json.dumps(
        {"max_tokens": str(STEPS), **{name: str(value) for name, value in PENALTIES.items()}}).encode()], "BYTES")
    assert "".join(streamed(llm, [text_input(grpcclient), as_vllm, tensor(grpcclient, "exclude_input_in_output",
                                                                          [True], "BOOL")])) == \
        expected["llama-tied", "penalized"]

    echoed = http.infer("llm", [text_input(httpclient), tensor(httpclient, "exclude_input_in_output", [False], "BOOL")],
                        parameters={"max_tokens": STEPS})
    assert echoed.as_numpy("text_output")[0].decode() == PROMPT + expected["llama-tied"]
    sampled = [http.infer("llm", [text_input(httpclient), tensor(httpclient, "max_tokens", [STEPS], "INT32"),
                                  tensor(httpclient, "temperature", [1.0], "FP32"),
                                  tensor(httpclient, "seed", [seed], "UINT64")]).as_numpy("text_output")[0]
               for seed in (5, 5, 6)]
    assert sampled[0] == sampled[1] != sampled[2]
    assert http.infer("llm", [text_input(httpclient)], parameters={"max_tokens": STEPS, "temperature": 1.0,
                                                                   "seed": 5}).as_numpy("text_output")[0] == sampled[0]

    for inputs, message in [
            ([text_input(httpclient), tensor(httpclient, "stream", [True], "BOOL")],
             "'stream' true asks for a response per token, which infer does not give"),
            ([text_input(httpclient), tensor(httpclient, "max_tokens", [4], "INT32"),
              tensor(httpclient, "sampling_parameters", [b'{"max_tokens": 5}'], "BYTES")],
             "'max_tokens' is given twice with different values: 4 (the 'max_tokens' input) and 5 ('max_tokens' "
             "in sampling_parameters); give it once"),
            ([text_input(httpclient), tensor(httpclient, "bad_words", [b"x"], "BYTES")],
             "model 'llm' does not take the input 'bad_words'"),
            ([text_input(httpclient), tensor(httpclient, "sampling_parameters", [b'{"use_beam_search": true}'],
                                             "BYTES")],
             "does not take 'use_beam_search'; its sampling parameters are max_tokens, temperature")]:
        with pytest.raises(InferenceServerException, match=re.escape(message)) as refused:
            http.infer("llm", inputs)
        assert refused.value.status() == "400"
