"""The fingerprint a restarted owner compares before it adopts stale replicas: digested from what a servable
declares (``fingerprint_fields``) and its weights' bytes; no Ray cluster."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ray")
import ray_models

import jitserve as js
from jitserve.cluster.ray.operations import fingerprint

# what a servable keeps that is no part of what it computes: the weights (digested by their bytes), the
# arguments it was built from (their checked forms are declared), and what it derives or caches
UNDECLARED = {"params", "options", "policy", "_inline", "_inline_lock"}


@pytest.mark.parametrize("servable", [ray_models.weights_serving(16), ray_models.generation(slots=2)],
                         ids=["serving", "generation"])
def test_every_attribute_of_a_servable_is_declared_or_no_part_of_what_it_computes(servable):
    getattr(servable, "policy", None)  # a serving's cached policy, among its attributes from now on
    assert set(vars(servable)) - UNDECLARED == set(servable.fingerprint_fields())


def test_the_same_serving_built_twice_has_one_fingerprint_and_any_change_another():
    first = fingerprint(ray_models.weights_serving(16))
    assert first == fingerprint(ray_models.weights_serving(16))
    assert first != fingerprint(ray_models.weights_serving(16).replace(batch_size=4))
    changed = ray_models.weights_serving(16)
    assert first != fingerprint(changed.with_params({"w": np.ones((16, 16), np.float32)}))
    assert fingerprint(js.Serving(lambda x: x * 2)) != fingerprint(js.Serving(lambda x: x * 3))
