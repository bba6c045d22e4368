"""Batch: stack, concatenate, keys, split, merge, padding and clear errors."""

from __future__ import annotations

import numpy as np
import pytest

import jitserve as js


def test_stack_and_concatenate_sizes():
    assert js.Batch.stack([np.array([1]), np.array([2])]).size == 2
    assert js.Batch.concatenate([np.ones((3, 4)), np.ones((2, 4))]).size == 5
    b = js.Batch.stack([np.array([1])])
    assert repr(b) == "#Batch<size: 1, pad: 0, rows: int64(1)>"


def test_materialize_pads_with_zeros_and_keeps_order():
    b = js.Batch.concatenate([np.arange(6).reshape(3, 2), np.arange(6, 8).reshape(1, 2)]).pad_to(6)
    assert (b.size, b.padding) == (4, 2)
    out = b.materialize()
    assert out.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 0], [0, 0]]


def test_pytree_entries():
    b = js.Batch.stack([{"a": np.ones(2, np.float32), "b": (np.int32(1), np.zeros(3))} for _ in range(3)])
    out = b.materialize()
    assert out["a"].shape == (3, 2) and out["b"][0].shape == (3,) and out["b"][1].shape == (3, 3)


def test_split_and_merge():
    b = js.Batch.concatenate([np.arange(3), np.arange(3, 7)])
    head, tail = b.split(4)
    assert head.materialize().tolist() == [0, 1, 2, 3] and tail.materialize().tolist() == [4, 5, 6]
    assert js.Batch.merge([tail, head]).materialize().tolist() == [4, 5, 6, 0, 1, 2, 3]
    assert [c.size for c in b.chunks(3)] == [3, 3, 1]
    assert b.materialize().tolist() == list(range(7)), "splitting copies nothing and changes nothing"


def test_keys_separate_signatures():
    a = js.Batch.stack([np.ones(2)]).key("en")
    b = js.Batch.stack([np.ones(2)]).key("fr")
    assert a.signature != b.signature
    with pytest.raises(js.BatchError, match="cannot merge batches with different keys: batch 1 has key 'fr', "
                                             "but batch 0 has 'en'"):
        js.Batch.merge([a, b])


def test_errors_name_the_problem():
    with pytest.raises(js.BatchError, match="a batch needs at least one entry; got none"):
        js.Batch.stack([])
    with pytest.raises(js.BatchError, match=r"cannot add to batch due to incompatible tensors/containers: entry 1 has "
                                             r"rows of float64\(3\), but entry 0 has rows of float64\(2\)"):
        js.Batch.stack([np.ones(2), np.ones(3)])
    with pytest.raises(js.BatchError, match=r"entry 1 has rows of int32\(2\), but entry 0 has rows of float64\(2\)"):
        js.Batch.concatenate([np.ones((1, 2)), np.ones((1, 2), np.int32)])
    with pytest.raises(js.BatchError, match="entry 1 has structure"):
        js.Batch.stack([(np.ones(1), np.ones(1)), np.ones(1)])
    with pytest.raises(js.BatchError, match="same number of rows"):
        js.Batch.concatenate([(np.ones((2, 1)), np.ones((3, 1)))])
    with pytest.raises(js.BatchError, match="got a scalar"):
        js.Batch.concatenate([np.float32(1)])
    with pytest.raises(js.BatchError, match="cannot pad a batch of 3 rows down to 2"):
        js.Batch.stack([np.ones(1)] * 3).pad_to(2)


# Nx.Batch parity -----------------------------------------------------------------------------

def test_stack_and_concatenate_add_to_an_existing_batch_as_in_seed_000():
    batch = js.Batch.stack([np.array([1])]).stack([np.array([2])])  # Nx.Batch.stack(...) |> Nx.Batch.stack(...)
    assert batch.size == 2 and batch.materialize().tolist() == [[1], [2]]
    grown = js.Batch.concatenate([np.ones((2, 3))]).concatenate([np.zeros((1, 3)), np.full((2, 3), 5.0)])
    assert grown.size == 5 and grown.materialize()[:, 0].tolist() == [1, 1, 0, 5, 5]
    keyed = js.Batch.stack([np.ones(2)]).key("k").stack([np.zeros(2)])
    assert keyed.user_key == "k" and keyed.size == 2, "adding keeps the batch's key"
    with pytest.raises(js.BatchError, match=r"cannot add to batch due to incompatible tensors/containers: the batch "
                                             r"has rows of int64\(1\), but the entries have rows of float64\(1\)"):
        js.Batch.stack([np.array([1])]).stack([np.array([1.0])])


def test_pad_adds_zero_rows_and_merge_sums_padding():
    batch = js.Batch.stack([np.array(1), np.array(2), np.array(3)]).pad(2)  # Nx.Batch.pad's doc example
    assert (batch.size, batch.padding) == (3, 2) and batch.materialize().tolist() == [1, 2, 3, 0, 0]
    merged = js.Batch.merge([js.Batch.stack([np.array(1)]).pad(1), js.Batch.stack([np.array(2)]).pad(2)])
    assert (merged.size, merged.padding) == (2, 3) and merged.materialize().tolist() == [1, 2, 0, 0, 0]
    assert repr(merged) == "#Batch<size: 2, pad: 3, rows: int64()>"
    for bad in (-1, 1.5, True):
        with pytest.raises(js.BatchError, match=f"Batch.pad takes a number of rows >= 0, got {bad!r}"):
            batch.pad(bad)
    with pytest.raises(js.BatchError, match=r"cannot merge batches due to incompatible templates: batch 1 has rows of "
                                             r"float64\(\), but batch 0 has rows of int64\(\)"):
        js.Batch.merge([js.Batch.stack([np.array(1)]), js.Batch.stack([np.array(1.0)])])
