"""A checkpoint's ``generation_config.json`` gives its requests their default sampling, as ``transformers``'
``generate()`` reads it: greedy text under its ``repetition_penalty`` equals ``generate()``'s with that
config, ``do_sample: true`` makes a request that asks nothing sample at the file's temperature and cuts,
and what a request gives wins. Before, only ``eos_token_id`` was read (greedy text differed from
``generate()``'s, and requests that should sample came back greedy)."""

from __future__ import annotations

import http.client
import json

import pytest
import torch
from test_checkpoint_errors import copy
from transformers import AutoModelForCausalLM, AutoTokenizer

import jitserve as js
from jitserve.protocol import app
from jitserve.protocol.service import InferenceService
from netutil import free_port, http_front

PROMPT = "A server batches requests, a scheduler admits them"
STEPS = 16


def configured(made, tmp_path, **fields):
    folder = copy(made, "llama-gqa-llama3-rope", tmp_path)
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return folder


def generated(folder):
    """``generate()``'s text for ``PROMPT``, with the folder's own generation config."""
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=STEPS, attention_mask=torch.ones_like(ids))
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_greedy_text_under_the_files_repetition_penalty_equals_generate(made, tmp_path):
    folder = configured(made, tmp_path, repetition_penalty=1.3, temperature=0.7)  # no do_sample: greedy
    expected = generated(folder)
    assert expected != generated(made("llama-gqa-llama3-rope")), "a penalty that changes nothing proves little"
    generation = js.from_pretrained(folder, slots=2)
    assert generation.default_sampling == {"repetition_penalty": 1.3}
    with js.serve(generation, name="penalized"):
        assert js.generate("penalized", PROMPT, max_steps=STEPS) == expected
        assert js.generate("penalized", PROMPT, max_steps=STEPS, repetition_penalty=1.0) == \
            generated(made("llama-gqa-llama3-rope"))


def test_do_sample_makes_requests_sample_by_default_and_a_requests_own_values_win(made, tmp_path):
    folder = configured(made, tmp_path, do_sample=True, top_k=40, top_p=0.95)
    generation = js.from_pretrained(folder, slots=2)
    assert generation.default_sampling == {"temperature": 1.0, "top_k": 40, "top_p": 0.95}
    with js.serve(generation, name="sampled"):
        texts = {js.generate("sampled", PROMPT, max_steps=STEPS, seed=seed) for seed in range(4)}
        greedy = js.generate("sampled", PROMPT, max_steps=STEPS, temperature=0.0)
        again = js.generate("sampled", PROMPT, max_steps=STEPS, seed=2)
    assert len(texts) > 1 and again in texts
    assert greedy == generated(made("llama-gqa-llama3-rope"))


def test_a_value_the_engine_refuses_is_named_in_generation_config(made, tmp_path):
    folder = configured(made, tmp_path, do_sample=True, top_p=1.5)
    with pytest.raises(js.CheckpointError, match=r"generation_config.json's 'top_p': top_p must be a number in "
                                                 r"\(0, 1\]"):
        js.from_pretrained(folder)


def test_the_files_defaults_hold_over_kserve_and_openai_too(made, tmp_path):
    """The network doors read a request's fields over the folder's defaults too (vLLM's order: the request,
    then generation_config.json, then the door's own)."""
    folder = configured(made, tmp_path, repetition_penalty=1.3)
    expected = generated(folder)
    server = js.serve(js.from_pretrained(folder, slots=2), name="penalized")
    port = free_port()

    def post(path, payload):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            connection.request("POST", path, json.dumps(payload).encode())
            response = connection.getresponse()
            return response.status, json.loads(response.read())
        finally:
            connection.close()

    try:
        with http_front(app.http_config(InferenceService({"penalized": server}), "127.0.0.1", port)):
            status, completion = post("/v1/completions", {"model": "penalized", "prompt": PROMPT,
                                                          "max_tokens": STEPS, "temperature": 0})
            assert status == 200, completion
            assert completion["choices"][0]["text"] == expected
            status, generate = post("/v2/models/penalized/generate", {"text_input": PROMPT, "max_tokens": STEPS})
            assert status == 200, generate
            assert generate["text_output"] == expected
            status, plain = post("/v2/models/penalized/generate", {"text_input": PROMPT, "max_tokens": STEPS,
                                                                   "repetition_penalty": 1.0})
            assert plain["text_output"] == generated(made("llama-gqa-llama3-rope"))
    finally:
        server.stop()
