"""Tensor parallel over the devices of one host (``from_pretrained(..., devices=N)``): which axis of each
of a family's weights is split across the devices, the KV cache split on its key/value heads, and the
checks that refuse a split that would not be even.

The split is Megatron's: in each block, the matrices that make attention heads or MLP columns (q, k and v,
GPT-2's fused ``c_attn``, the MLP's up and gate) are split on their output axis, so each device computes
its own heads and columns; the matrices after them (the attention's output, the MLP's down) on their input
axis, so each device adds its part and XLA all-reduces the sums. The vocabulary tables (embedding, head)
are split by token where the device count divides the vocabulary; norms and the rest are replicated."""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from ..errors import OptionError
from ..mesh import MeshPlacement
from ..params import flatten, nest
from .gpt2 import GPT2
from .llama import Llama

AXIS = "model"  # the axis of the mesh that devices=N makes

# family -> (weight name pattern, the axis split over the devices); a weight no pattern names is replicated
SPLITS: dict[type, tuple[tuple[str, int], ...]] = {
    GPT2: ((r"transformer\.h\.\d+\.(attn\.c_attn|mlp\.c_fc)\.(weight|bias)", -1),  # Conv1D: (in, out)
           (r"transformer\.h\.\d+\.(attn|mlp)\.c_proj\.weight", 0),
           (r"transformer\.wte\.weight|lm_head\.weight", 0)),
    Llama: ((r"model\.layers\.\d+\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.(weight|bias)", 0),
            (r"model\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.weight", 1),
            (r"model\.embed_tokens\.weight|lm_head\.weight", 0)),
}
# family -> the counts each device takes an equal share of: (the family's attribute, config.json's field)
SHARES: dict[type, tuple[tuple[str, str], ...]] = {
    GPT2: (("heads", "n_head"), ("inner", "n_inner")),
    Llama: (("heads", "num_attention_heads"), ("kv_heads", "num_key_value_heads"), ("inner", "intermediate_size")),
}


def mesh_of(devices: Any) -> Mesh | None:
    """``devices`` as the mesh to serve on: None for one device (None or 1), the first N devices of the
    default platform for N, or a ``jax.sharding.Mesh`` as given (split over all its axes together)."""
    if isinstance(devices, Mesh):
        return devices
    if isinstance(devices, bool) or not isinstance(devices, int | None) or (devices is not None and devices < 1):
        raise OptionError(f"devices must be a number of devices (a positive integer) or a jax.sharding.Mesh, "
                          f"got {devices!r}")
    if devices is None or devices == 1:
        return None
    present = jax.devices()
    if devices > len(present):
        raise OptionError(f"devices={devices}, but this host has {len(present)} {present[0].platform} "
                          f"device{'s' if len(present) > 1 else ''}")
    return Mesh(np.array(present[:devices]), (AXIS,))


def tensor_parallel(model: Any, mesh: Mesh, params: Any, folder: str) -> MeshPlacement:
    """Where the weights ``params`` of ``model`` (a decoder family) and its KV cache lie over ``mesh``: split
    as :data:`SPLITS` says, after :data:`SHARES` are checked to divide by the mesh's device count."""
    count = mesh.size
    for attribute, field in SHARES[type(model)]:
        share = getattr(model, attribute)
        if share % count:
            raise OptionError(f"checkpoint {folder!r}: config.json's {field!r} ({share}) is not divisible by "
                              f"devices={count}; tensor parallel gives each device an equal share of it")
    axes = tuple(mesh.axis_names)
    splits = [(re.compile(pattern), axis) for pattern, axis in SPLITS[type(model)]]

    def spec(name: str, array: np.ndarray) -> PartitionSpec:
        axis = next((axis for pattern, axis in splits if pattern.fullmatch(name)), None)
        if axis is None or array.shape[axis] % count:  # a vocabulary the devices do not divide: replicated
            return PartitionSpec()
        parts: list[Any] = [None] * array.ndim
        parts[axis] = axes
        return PartitionSpec(*parts)

    weights = nest({name: spec(name, array) for name, array in flatten(params).items()})
    # the decoder loop's state row (layers.prefill): keys and values (layers, kv heads, length, head dim)
    heads = PartitionSpec(None, axes, None, None)
    return MeshPlacement(mesh, weights, {"k": heads, "v": heads, "position": PartitionSpec()})
