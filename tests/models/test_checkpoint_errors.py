"""A checkpoint that does not fit is refused by ``from_pretrained`` itself, before anything compiles, with
a ``js.CheckpointError`` naming the key or field: the three ways the hand-copied example gave silently
wrong answers (an untied head left unused, a head count not read, a context clamped), and a missing,
misshaped or unexpected key, or a config field jitserve does not implement."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jitserve as js


def copy(made, variant, tmp_path):
    folder = tmp_path / variant
    shutil.copytree(made(variant), folder)
    return folder


def edit_weights(folder, change):
    (path,) = folder.glob("*.safetensors")
    weights = dict(load_file(path))
    change(weights)
    save_file(weights, path)


def edit_config(folder, change):
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


def test_a_missing_key_is_named_with_its_expected_shape(made, tmp_path):
    folder = copy(made, "llama-tied", tmp_path)
    edit_weights(folder, lambda w: w.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(js.CheckpointError, match=r"weight 'model\.layers\.1\.self_attn\.k_proj\.weight' is "
                                                 r"missing; config.json implies it, shaped \(64, 64\)"):
        js.from_pretrained(folder)


def test_a_misshaped_key_is_named_with_both_shapes(made, tmp_path):
    folder = copy(made, "gpt2-8-heads", tmp_path)
    edit_weights(folder, lambda w: w.update({"transformer.h.0.mlp.c_fc.weight": np.zeros((64, 200), np.float32)}))
    with pytest.raises(js.CheckpointError, match=r"weight 'transformer\.h\.0\.mlp\.c_fc\.weight' has shape "
                                                 r"\(64, 200\), but config.json implies \(64, 256\)"):
        js.from_pretrained(folder)


def test_an_unexpected_key_is_named(made, tmp_path):
    folder = copy(made, "llama-tied", tmp_path)
    edit_weights(folder, lambda w: w.update({"model.layers.0.self_attn.q_norm.weight": np.ones(16, np.float32)}))
    with pytest.raises(js.CheckpointError, match=r"weight 'model\.layers\.0\.self_attn\.q_norm\.weight' \(shape "
                                                 r"\(16,\)\) is unexpected"):
        js.from_pretrained(folder)


@pytest.mark.parametrize(("variant", "change", "message"), [
    ("qwen3-qk-norms", lambda w: w.pop("model.layers.1.self_attn.q_norm.weight"),
     r"weight 'model\.layers\.1\.self_attn\.q_norm\.weight' is missing; config.json implies it, shaped \(16,\)"),
    ("qwen3-qk-norms", lambda w: w.update({"model.layers.0.self_attn.k_norm.weight": np.ones(64, np.float32)}),
     r"weight 'model\.layers\.0\.self_attn\.k_norm\.weight' has shape \(64,\), but config.json implies \(16,\)"),
    ("phi3-fused", lambda w: w.pop("model.layers.0.self_attn.qkv_proj.weight"),
     r"weight 'model\.layers\.0\.self_attn\.qkv_proj\.weight' is missing; config.json implies it, shaped "
     r"\(96, 64\)"),
    ("phi3-fused", lambda w: w.update({"model.layers.1.mlp.gate_up_proj.weight": np.ones((128, 64), np.float32)}),
     r"weight 'model\.layers\.1\.mlp\.gate_up_proj\.weight' has shape \(128, 64\), but config.json implies "
     r"\(256, 64\)"),
    ("phi3-fused", lambda w: w.update({"model.layers.0.mlp.up_proj.weight": np.ones((128, 64), np.float32)}),
     r"weight 'model\.layers\.0\.mlp\.up_proj\.weight' \(shape \(128, 64\)\) is unexpected"),
])
def test_a_later_familys_own_weights_are_checked_by_name(made, tmp_path, variant, change, message):
    folder = copy(made, variant, tmp_path)
    edit_weights(folder, change)
    with pytest.raises(js.CheckpointError, match=message):
        js.from_pretrained(folder)


def test_an_untied_head_missing_from_the_checkpoint_is_refused_not_replaced_by_the_embedding(made, tmp_path):
    folder = copy(made, "gpt2-untied", tmp_path)
    edit_weights(folder, lambda w: w.pop("lm_head.weight"))
    with pytest.raises(js.CheckpointError, match=r"weight 'lm_head\.weight' is missing"):
        js.from_pretrained(folder)


def test_the_head_count_comes_from_the_config(made):
    """gpt2-8-heads has GPT-2's shapes for any head count: only config.json says 8 (the greedy text test
    shows the answers are then right)."""
    generation = js.from_pretrained(made("gpt2-8-heads"))
    assert generation.functions[0].args[0].heads == 8


def test_a_max_length_beyond_the_context_is_refused_naming_the_field(made):
    with pytest.raises(js.CheckpointError, match=r"max_length=300 must be a positive integer at most the model's "
                                                 r"context, config.json's 'n_positions' \(256\)"):
        js.from_pretrained(made("gpt2-8-heads"), max_length=300)


@pytest.mark.parametrize(("variant", "change", "message"), [
    ("llama-tied", lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
     r"config.json's 'rope_parameters' is .*'yarn'.*jitserve implements default, linear, llama3"),
    ("llama-tied", lambda c: (c.pop("rope_parameters"), c.update(rope_theta=5e5, rope_scaling={"type": "dynamic",
                                                                                               "factor": 2.0})),
     r"config.json's 'rope_scaling' is .*'dynamic'"),
    ("mistral", lambda c: c.update(sliding_window=128),
     r"config.json's 'sliding_window' is 128, which jitserve does not implement \(attention over a sliding window"),
    ("qwen2-biases", lambda c: c.update(use_sliding_window=True), r"'use_sliding_window' is True"),
    ("qwen3-qk-norms", lambda c: c.update(use_sliding_window=True), r"'use_sliding_window' is True"),
    *[("phi3-fused", lambda c, kind=kind: (c.pop("rope_parameters"), c.update(rope_theta=1e4, rope_scaling={
        "type": kind, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4})), rf"'rope_scaling' is .*'{kind}'.*"
       r"jitserve implements default, linear, llama3") for kind in ("longrope", "su", "yarn")],
    ("phi3-fused", lambda c: c.update(sliding_window=64), r"'sliding_window' is 64, which jitserve does not "
                                                          r"implement \(attention over a sliding window"),
    ("gpt2-8-heads", lambda c: c.update(activation_function="quick_gelu"), r"'activation_function' is 'quick_gelu'"),
    ("gpt2-8-heads", lambda c: c.update(architectures=["GPT2ForTokenClassification"]),
     r"'architectures' is \['GPT2ForTokenClassification'\]; jitserve serves GPT2LMHeadModel, LlamaForCausalLM"),
    ("llama-tied", lambda c: c.pop("num_attention_heads"), r"config.json has no 'num_attention_heads'"),
    ("llama-tied", lambda c: c.update(num_key_value_heads=3), r"'num_key_value_heads' is 3.*must divide"),
])
def test_a_config_field_jitserve_does_not_implement_is_refused_naming_it(made, tmp_path, variant, change, message):
    folder = copy(made, variant, tmp_path)
    edit_config(folder, change)
    with pytest.raises(js.CheckpointError, match=message):
        js.from_pretrained(folder)


def test_a_sliding_window_as_long_as_what_is_served_changes_nothing_and_is_accepted(made, tmp_path):
    folder = copy(made, "mistral", tmp_path)
    edit_config(folder, lambda c: c.update(sliding_window=128))
    assert js.from_pretrained(folder, max_length=128).max_length == 128


def test_a_folder_without_a_tokenizer_or_config_is_refused(made, tmp_path):
    folder = copy(made, "gpt2-8-heads", tmp_path)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(js.CheckpointError, match=r"has no tokenizer.json"):
        js.from_pretrained(folder)
    (folder / "config.json").unlink()
    with pytest.raises(js.CheckpointError, match=r"has no config.json"):
        js.from_pretrained(folder)


def test_a_task_the_architecture_cannot_do_is_refused(made):
    with pytest.raises(js.OptionError, match=r"task 'classification' is not one GPT2LMHeadModel can do"):
        js.from_pretrained(made("gpt2-8-heads"), task="classification")
