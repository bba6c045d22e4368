"""``from_pretrained(..., devices=N)``: a causal LM's weights and KV cache split tensor parallel over N devices
generate the text one device generates, alone and several prompts at once, greedy and sampled with a
seed, and after their weights are updated. Checked on the CPU in a process
of its own whose host platform has four XLA devices (``XLA_FLAGS=--xla_force_host_platform_device_count=4``
is read when jax starts; tensor_parallel_child.py runs there): GPT-2 (fused ``c_attn``) on 2 and 4, Llama
with 8 heads over 2 key/value heads on 2, and a tied Llama with 4 key/value heads on 4; each device holds
its share only. What cannot be split is refused by its numbers; the refusals that need no second device
run here, over a mesh of one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from checkpoints import CORPUS
from jax.sharding import Mesh

import jitserve as js

DEVICES = 4
PROMPTS = ["a", "Once upon a time", CORPUS[1]]  # 1 to 20-odd tokens: one and several prefill lengths
STEPS = 12
SPLIT = {"gpt2-8-heads": [2, 4], "llama-gqa-llama3-rope": [2], "llama-tied": [4]}
CACHE = {"gpt2-8-heads": (8, 8), "llama-gqa-llama3-rope": (2, 8), "llama-tied": (4, 16)}  # kv heads, head dim


@pytest.fixture(scope="module")
def child(made):
    """What tensor_parallel_child.py saw, served over four host devices."""
    plan = {"folders": {variant: str(made(variant)) for variant in SPLIT}, "devices": SPLIT,
            "prompts": PROMPTS, "steps": STEPS,
            "refused": [["llama-gqa-llama3-rope", 4], ["llama-tied", DEVICES * 2]]}
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("tensor_parallel_child.py")),
                           json.dumps(plan)], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_n_devices_generate_the_text_of_one_alone_several_at_once_sampled_and_updated(child):
    assert child["devices"] == DEVICES
    for variant, counts in SPLIT.items():
        one = child["served"][variant]["1"]
        assert one["together"] == one["alone"] * 2 and one["updated"] == one["alone"][1]
        assert len(set("".join(one["alone"]))) > 3, "random weights that repeat one token would prove little"
        for n in counts:
            split = child["served"][variant][str(n)]
            assert (split["alone"], split["together"]) == (one["alone"], one["alone"] * 2), (variant, n)
            assert (split["sampled"], split["updated"]) == (one["sampled"], one["alone"][1]), (variant, n)


def test_each_device_holds_its_share_of_the_weights_and_of_the_kv_cache(child):
    for variant, counts in SPLIT.items():
        kv_heads, head_dim = CACHE[variant]
        for n in counts:
            split = child["served"][variant][str(n)]
            rows, columns = split["query"]
            # Llama's q_proj (out, in) is split by heads, its rows; GPT-2's c_attn (in, out) by its columns
            share = [rows, columns // n] if variant.startswith("gpt2") else [rows // n, columns]
            assert json.dumps([share] * n) in split["query_shares"], (variant, n, split["query_shares"])
            # the slots' KV cache (slots, layers, kv heads, length, head dim): each device its kv heads
            caches = [json.loads(shares) for shares in split["cache_shares"]]
            assert [[2, 2, kv_heads // n, 96, head_dim]] * n in caches, (variant, n, caches)
            assert all(shard[2] == kv_heads // n for shares in caches for shard in shares), (variant, n, caches)


def test_what_cannot_be_split_evenly_is_refused_by_its_numbers(child):
    refused = child["refused"]
    assert refused["llama-gqa-llama3-rope on 4"].endswith(
        "config.json's 'num_key_value_heads' (2) is not divisible by devices=4; tensor parallel gives each "
        "device an equal share of it")
    assert refused[f"llama-tied on {DEVICES * 2}"] == f"devices=8, but this host has {DEVICES} cpu devices"


@pytest.fixture(scope="module")
def mesh_of_one():
    return Mesh(np.array(jax.devices()[:1]), ("model",))


def test_refusals_that_one_device_shows(made, mesh_of_one):
    folder = made("llama-tied")
    with pytest.raises(js.OptionError, match=r"^compiler 'evaluator' runs each program on one device; a "
                                             r"generation over several devices \(tensor parallel\) needs "
                                             r"compiler 'xla'$"):
        js.from_pretrained(folder, devices=mesh_of_one, compiler="evaluator")
    with pytest.raises(js.OptionError, match=r"^a generation runs over its mesh's devices or on device=0, not "
                                             r"both$"):
        js.from_pretrained(folder, devices=mesh_of_one, device=0)
    for wrong in (0, True, "2", 1.5):
        with pytest.raises(js.OptionError, match=r"^devices must be a number of devices \(a positive integer\) "
                                                 r"or a jax.sharding.Mesh, got "):
            js.from_pretrained(folder, devices=wrong)
    with pytest.raises(js.OptionError, match=r"^mesh must be a jitserve.mesh.MeshPlacement or None, got str$"):
        js.from_pretrained(folder, mesh="two")
    assert js.from_pretrained(folder, devices=1).mesh is None, "one device is the path without a mesh"


def test_an_encoder_is_refused_a_mesh(tmp_path, mesh_of_one):
    from checkpoints import bert

    with pytest.raises(js.OptionError, match=r"^devices=Mesh\(.*\): tensor parallel splits a generation \(a "
                                             r"causal LM\); BertForSequenceClassification as 'classification' "
                                             r"runs on one device \(leave devices out; partitions=N serves "
                                             r"copies on N\)$"):
        js.from_pretrained(bert(tmp_path / "bert"), devices=mesh_of_one)


def test_serve_hf_passes_devices_through(made):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"}
    done = subprocess.run([sys.executable, "-m", "jitserve", "serve", "--hf", str(made("llama-tied")), "--devices",
                           "3"], capture_output=True, text=True, timeout=120, env=env)
    assert (done.returncode, done.stderr.strip().splitlines()) == (
        2, ["jitserve serve: devices=3, but this host has 2 cpu devices"])
