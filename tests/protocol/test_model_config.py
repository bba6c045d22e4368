"""Every kind of model jitserve serves describes itself alike over both protocols: its configuration and its
metadata read over gRPC (tritonclient, ``as_json`` and as Triton's own messages) equal the HTTP JSON, read
into the same messages of Triton's protobuf files (which tritonclient ships: a field of the HTTP JSON
that Triton's ``model_config.proto`` does not have fails the reading). Served from a model repository
(``model.py`` files, two of them checkpoints through ``from_pretrained``). Loopback only."""

from __future__ import annotations

import json
import shutil

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2

from netutil import ROOT, start_server, stop

EXAMPLES = ROOT / "examples"

KEYED = """
import jitserve as js

def scaled(key, x):
    return x * (10 if key == "long" else 1)

serving = js.Serving(scaled, batch_size=4, batch_keys=["short", "long"], input_template=js.template((1,), "float32"))
"""

GENERATION = f"""
import sys

sys.path.insert(0, {str(ROOT / "tests" / "protocol")!r})
from generation_models import models

serving = models["gen"]
"""

PRETRAINED = f"""
import sys

sys.path.insert(0, {str(EXAMPLES)!r})
from make_checkpoint import {{family}}

import jitserve as js

serving = js.from_pretrained({{family}}(), max_length=32{{options}})
"""

KINDS = {  # name -> what the repository's model.py of that kind holds
    "mlp": (EXAMPLES / "mlp.py").read_text(),  # a Serving with weights
    "keyed": KEYED,  # declared batch keys
    "classifier": PRETRAINED.format(family="bert", options=""),  # BERT: a preprocess, its wire declared
    "counter": GENERATION,  # a Generation of token ids (picked from its logits)
    "writer": PRETRAINED.format(family="gpt2", options=", slots=2"),  # a text Generation (text_input)
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("repository")
    for name, source in KINDS.items():
        (repository / name).mkdir()
        (repository / name / "model.py").write_text(source)
    running = start_server(f"--model-repository={repository}")
    yield running
    stop(running)
    shutil.rmtree(repository)


def http_json(server, path: str) -> dict:
    status, _, data = server.request("GET", path)
    assert status == 200, data
    return json.loads(data)


@pytest.mark.parametrize("model", list(KINDS))
def test_the_grpc_model_config_equals_the_http_json(server, model):
    http = http_json(server, f"/v2/models/{model}/config")
    assert httpclient.InferenceServerClient(f"127.0.0.1:{server.port}").get_model_config(model) == http
    as_triton = json_format.ParseDict(http, model_config_pb2.ModelConfig())  # every field is one of Triton's
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    assert client.get_model_config(model).config == as_triton
    assert client.get_model_config(model, as_json=True)["config"] == \
        json_format.MessageToDict(as_triton, preserving_proto_field_name=True)


@pytest.mark.parametrize("model", list(KINDS))
def test_the_grpc_model_metadata_equals_the_http_json(server, model):
    http = http_json(server, f"/v2/models/{model}")
    as_triton = json_format.ParseDict(http, service_pb2.ModelMetadataResponse())
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    assert client.get_model_metadata(model) == as_triton
    assert as_triton.inputs and as_triton.outputs, "a client can discover what it takes and gives"


def test_a_generation_says_it_is_decoupled_and_its_slots_as_triton_parameters(server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    for model, slots, max_length in (("counter", "4", "64"), ("writer", "2", "32")):
        config = client.get_model_config(model).config
        assert config.model_transaction_policy.decoupled
        assert config.parameters["slots"].string_value == slots
        assert config.parameters["max_length"].string_value == max_length
    assert not client.get_model_config("mlp").config.model_transaction_policy.decoupled
