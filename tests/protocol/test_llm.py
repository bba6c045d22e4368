"""What a generation reads from the wire (protocol/llm.py), without a server: the fields as genai-perf's
``tensorrtllm`` back end sends them (tensors), as its ``vllm`` back end does (``sampling_parameters``, a JSON
tensor whose numbers are strings), as parameters; one value given in two places; and every refusal by
name."""

from __future__ import annotations

import numpy as np
import pytest

from jitserve.errors import ProtocolError
from jitserve.protocol.llm import FIELDS, OPTIONAL_INPUTS, read_fields


def texts(*values: str) -> np.ndarray:
    return np.array([value.encode() for value in values], dtype=object)


def test_tensorrtllm_tensors_as_genai_perf_sends_them():
    tensors = {"max_tokens": np.array([[8]], np.int32), "exclude_input_in_output": np.array([True]),
               "stream": np.array([[True]]), "temperature": np.array([0.5], np.float32),
               "seed": np.array([7], np.uint64), "stop": texts("\n", "THE END"), "min_length": np.array([[8]]),
               "stop_token_ids": np.array([3, 4], np.int32), "repetition_penalty": np.array([[1.25]], np.float32),
               "presence_penalty": np.array([0.5], np.float32), "frequency_penalty": np.array([-1.0], np.float32)}
    assert read_fields("m", True, tensors, {}) == {"max_tokens": 8, "exclude_input_in_output": True,
                                                   "stream": True, "temperature": 0.5, "seed": 7,
                                                   "stop": ["\n", "THE END"], "min_tokens": 8,
                                                   "stop_token_ids": [3, 4], "repetition_penalty": 1.25,
                                                   "presence_penalty": 0.5, "frequency_penalty": -1.0}


def test_vllm_sampling_parameters_read_numbers_in_strings_as_vllm_does():
    tensors = {"sampling_parameters": texts('{"max_tokens": "4", "min_tokens": "4", "temperature": "0.25", '
                                            '"top_k": 3, "stop": "x", "repetition_penalty": "1.1", '
                                            '"frequency_penalty": 0.5, "ignore_eos": true, "min_p": "0.05", '
                                            '"logit_bias": {"7": -100, "9": 2.5}}'),
               "stream": np.array([False]), "exclude_input_in_output": np.array([True])}
    assert read_fields("m", True, tensors, {}) == {"max_tokens": 4, "min_tokens": 4, "temperature": 0.25, "top_k": 3,
                                                   "stop": "x", "repetition_penalty": 1.1, "frequency_penalty": 0.5,
                                                   "ignore_eos": True, "min_p": 0.05, "logit_bias": {7: -100, 9: 2.5},
                                                   "stream": False, "exclude_input_in_output": True}


def test_logit_bias_comes_as_a_json_object_or_its_text_as_grpc_parameters_carry_it():
    assert read_fields("m", True, {}, {"logit_bias": '{"7": -100}'}) == {"logit_bias": {7: -100}}
    assert read_fields("m", True, {}, {"logit_bias": {"7": -100}}) == {"logit_bias": {7: -100}}


def test_a_field_given_twice_must_agree():
    tensors = {"max_tokens": np.array([4], np.int32), "sampling_parameters": texts('{"max_tokens": "4"}')}
    assert read_fields("m", True, tensors, {"max_tokens": 4}) == {"max_tokens": 4}
    with pytest.raises(ProtocolError, match=r"^'max_tokens' is given twice with different values: 4 \(the "
                                            r"'max_tokens' input\) and 5 \('max_tokens' in sampling_parameters\); "
                                            r"give it once$"):
        read_fields("m", True, {**tensors, "sampling_parameters": texts('{"max_tokens": 5}')}, {})
    with pytest.raises(ProtocolError, match=r"2 \(the 'top_k' parameter\)"):
        read_fields("m", True, {"top_k": np.array([1], np.int32)}, {"top_k": 2})
    with pytest.raises(ProtocolError, match=r"'min_tokens' is given twice with different values: 3 \(the "
                                            r"'min_length' input\) and 2 \(the 'min_tokens' parameter\)"):
        read_fields("m", True, {"min_length": np.array([3], np.int32)}, {"min_tokens": 2})


@pytest.mark.parametrize(("tensors", "parameters", "message"), [
    ({"bad_words": texts("x")}, {}, "model 'm' does not take the input 'bad_words'; it takes text_input and, "
                                    "optionally, max_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids, "
                                    "min_tokens, min_length, repetition_penalty, presence_penalty, "
                                    "frequency_penalty, stream, exclude_input_in_output, sampling_parameters"),
    ({}, {"beam_width": 2}, "model 'm' does not take the parameter 'beam_width'; a text generation takes "
                            "max_tokens, temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, min_tokens, "
                            "min_length, ignore_eos, logit_bias, repetition_penalty, presence_penalty, "
                            "frequency_penalty, "
                            "stream, exclude_input_in_output"),
    ({"sampling_parameters": texts('{"use_beam_search": true}')}, {},
     "the 'sampling_parameters' input: model 'm' does not take 'use_beam_search'; its sampling parameters are "
     "max_tokens, temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, min_tokens, ignore_eos, logit_bias, "
     "repetition_penalty, presence_penalty, frequency_penalty"),
    ({"sampling_parameters": texts('{"ignore_eos": "true"}')}, {},
     "'ignore_eos' in sampling_parameters must be true or false, got 'true'"),
    ({"ignore_eos": np.array([True])}, {}, "model 'm' does not take the input 'ignore_eos'"),
    ({"sampling_parameters": texts("max_tokens=4")}, {},
     "the 'sampling_parameters' input must be a JSON object (vLLM's sampling parameters), got 'max_tokens=4'"),
    ({"sampling_parameters": texts("[4]")}, {}, "must be a JSON object (vLLM's sampling parameters), got '[4]'"),
    ({"sampling_parameters": texts('{"max_tokens": "four"}')}, {},
     "'max_tokens' in sampling_parameters must be a positive integer, got 'four'"),
    ({"max_tokens": np.array([4, 5], np.int32)}, {}, "the 'max_tokens' input must hold one value, got shape [2]"),
    ({"max_tokens": np.array([4.0], np.float32)}, {}, "the 'max_tokens' input must be a positive integer, got 4.0"),
    ({"max_tokens": np.array([0], np.int32)}, {}, "the 'max_tokens' input must be a positive integer, got 0"),
    ({"stream": np.array([1], np.int32)}, {}, "the 'stream' input must be true or false, got 1"),
    ({}, {"temperature": "hot"}, "the 'temperature' parameter must be a number, got 'hot'"),
    ({}, {"stop": ["a", 1]}, "the 'stop' parameter must be a string or a list of strings, got ['a', 1]"),
    ({}, {"stop_token_ids": 3}, "the 'stop_token_ids' parameter must be a list of token ids (integers), got 3"),
    ({}, {"presence_penalty": "high"}, "the 'presence_penalty' parameter must be a number, got 'high'"),
    ({"sampling_parameters": texts('{"logprobs": 2}')}, {}, "model 'm' does not take 'logprobs'"),
    ({}, {"logit_bias": '{"5": 1, "05": 2}'}, "the 'logit_bias' parameter names a token id twice"),
    ({}, {"logit_bias": "{5: 1}"}, "the 'logit_bias' parameter must map token ids"),
    ({}, {"logit_bias": '{"' + "1" * 5000 + '": 1}'},  # past int()'s limit of 4,300 digits: read no further
     "the 'logit_bias' parameter names a token id of 5000 digits; a token id has at most 10"),
    ({"sampling_parameters": texts('{"logit_bias": {"' + "1" * 11 + '": 1}}')}, {},
     "'logit_bias' in sampling_parameters names a token id of 11 digits; a token id has at most 10"),
    ({"sampling_parameters": texts('{"logit_bias": {"the": 1}}')}, {},
     "'logit_bias' in sampling_parameters must map token ids (integers, as JSON writes them: \"50256\") to biases, "
     "got {'the': 1}"),
])
def test_refusals_name_the_field_and_what_it_takes(tensors, parameters, message):
    with pytest.raises(ProtocolError) as refused:
        read_fields("m", True, tensors, parameters)
    assert message in str(refused.value)


def test_a_token_generation_takes_its_fields_as_parameters():
    assert read_fields("g", False, {}, {"max_steps": 3, "seed": 1, "priority": 0}) == {"max_steps": 3, "seed": 1}
    with pytest.raises(ProtocolError, match="does not take the parameter 'max_tokens'; a token generation takes "
                                            "max_steps, temperature, top_p, top_k, min_p, seed, stop, "
                                            "stop_token_ids, min_tokens, ignore_eos, logit_bias, repetition_penalty, "
                                            "presence_penalty, "
                                            "frequency_penalty$"):
        read_fields("g", False, {}, {"max_tokens": 3})


def test_the_optional_inputs_are_the_fields_with_a_datatype_and_vllms_json():
    assert list(OPTIONAL_INPUTS) == [*(name for name, field in FIELDS.items() if field.datatype),
                                     "sampling_parameters"]
    assert OPTIONAL_INPUTS["max_tokens"] == ("INT32", (1,)) and OPTIONAL_INPUTS["stop"] == ("BYTES", (-1,))
    assert OPTIONAL_INPUTS["min_length"] == ("INT32", (1,))  # TensorRT-LLM's name of min_tokens
