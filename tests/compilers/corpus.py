"""The portability corpus: ordinary jax.numpy / jax.lax definitions with their inputs.

Each :class:`Case` is run on every compiler and compared with XLA (see
``test_portability.py`` and ``bench/portability.py``). The cases cover what
numerical code does day to day: elementwise math, reductions, broadcasting,
dot/einsum, convolutions, gathers and scatters with in- and out-of-range
indices, sorting, cumulative ops, control flow, dynamic slicing, shape ops,
integer and bitwise ops, every dtype (64-bit ones under ``jax.enable_x64``),
``jax.random``, ``jax.grad``, linear algebra and FFTs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

rng = np.random.default_rng(20261122)


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    x64: bool = False      # run under jax.enable_x64(True)
    rtol: float | None = None  # None: by dtype (see tolerance())


def f32(*shape: int, low: float = -2.0, high: float = 2.0) -> np.ndarray:
    return rng.uniform(low, high, size=shape).astype(np.float32)


def ints(*shape: int, low: int = -50, high: int = 50, dtype: Any = np.int32) -> np.ndarray:
    return rng.integers(low, high, size=shape).astype(dtype)


X = f32(4, 5)
V = f32(16)
POS = f32(4, 5, low=0.1, high=3.0)
UNIT = f32(4, 5, low=-0.9, high=0.9)
I = ints(4, 5)
B = rng.uniform(size=(4, 5)) > 0.5
SPD = (lambda a: a @ a.T + 4 * np.eye(4, dtype=np.float32))(f32(4, 4))
IMG = f32(2, 3, 8, 8)
KER = f32(4, 3, 3, 3)
E = f32(10, 4)   # an embedding table
KEY = np.array([0, 42], np.uint32)
CASES: list[Case] = []


def case(name: str, fn: Callable[..., Any], *args: Any, x64: bool = False, rtol: float | None = None) -> None:
    CASES.append(Case(name, fn, args, x64, rtol))


# elementwise math
for name, fn, arg in [
    ("exp", jnp.exp, X), ("log", jnp.log, POS), ("sin", jnp.sin, X), ("cos", jnp.cos, X), ("tan", jnp.tan, UNIT),
    ("tanh", jnp.tanh, X), ("sqrt", jnp.sqrt, POS), ("rsqrt", lax.rsqrt, POS), ("cbrt", jnp.cbrt, X),
    ("expm1", jnp.expm1, X), ("log1p", jnp.log1p, POS), ("arcsin", jnp.arcsin, UNIT), ("arccos", jnp.arccos, UNIT),
    ("arctan", jnp.arctan, X), ("sinh", jnp.sinh, X), ("cosh", jnp.cosh, X), ("arcsinh", jnp.arcsinh, X),
    ("arccosh", jnp.arccosh, POS + 1), ("arctanh", jnp.arctanh, UNIT), ("erf", jax.scipy.special.erf, X),
    ("erfc", jax.scipy.special.erfc, X), ("erfinv", jax.scipy.special.erfinv, UNIT),
    ("lgamma", jax.scipy.special.gammaln, POS), ("digamma", jax.scipy.special.digamma, POS),
    ("sigmoid", jax.nn.sigmoid, X * 5), ("softplus", jax.nn.softplus, X), ("relu", jax.nn.relu, X),
    ("gelu", jax.nn.gelu, X), ("silu", jax.nn.silu, X), ("abs", jnp.abs, X), ("sign", jnp.sign, X),
    ("floor", jnp.floor, X * 3), ("ceil", jnp.ceil, X * 3), ("round", jnp.round, X * 3), ("square", jnp.square, X),
    ("reciprocal", jnp.reciprocal, POS), ("exp2", jnp.exp2, X), ("log2", jnp.log2, POS), ("log10", jnp.log10, POS),
    ("isnan", jnp.isnan, np.array([1.0, np.nan, np.inf, -np.inf], np.float32)),
    ("isfinite", jnp.isfinite, np.array([1.0, np.nan, np.inf, -np.inf], np.float32)),
    ("nan_to_num", jnp.nan_to_num, np.array([1.0, np.nan, np.inf, -np.inf], np.float32)),
]:
    case(f"elementwise/{name}", fn, arg)
for name, fn in [("power", jnp.power), ("arctan2", jnp.arctan2), ("hypot", jnp.hypot), ("logaddexp", jnp.logaddexp),
                 ("maximum", jnp.maximum), ("minimum", jnp.minimum), ("fmod", jnp.fmod), ("remainder", jnp.remainder),
                 ("copysign", jnp.copysign), ("divide", jnp.divide)]:
    case(f"elementwise/{name}", fn, POS, POS[::-1])
SPECIAL = np.array([0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, np.nan], np.float32)  # C99's atan2 table, row by column
case("elementwise/arctan2_zeros_infinities_signs", jnp.arctan2, *np.meshgrid(SPECIAL, SPECIAL, indexing="ij"))
POWERS = np.array([0.0, -0.0, 1.0, -1.0, 2.0, -3.0, 0.5, -2.5, np.inf, -np.inf, np.nan], np.float32)
case("elementwise/power_negative_bases_and_special_values", jnp.power, *np.meshgrid(POWERS, POWERS, indexing="ij"))
case("elementwise/cbrt_infinities", jnp.cbrt, np.array([np.inf, -np.inf, -8.0, 27.0, 0.0, np.nan], np.float32))
ZEROS = np.array([-0.0, 0.0, -0.0], np.float32)  # 1 / x tells -0 (-inf) from +0 (inf)
case("elementwise/minus_zero_kept", lambda z: [1 / y for y in (jnp.sign(z), jax.scipy.special.erfinv(z), jnp.sin(z),
                                                                jnp.tan(z))], ZEROS)
case("elementwise/special_function_poles", lambda x: (jax.scipy.special.gammaln(x), jax.scipy.special.digamma(x)),
     np.array([-np.inf, 0.0, -0.0, -2.0, 1.0], np.float32))
case("elementwise/clip", lambda x: jnp.clip(x, -0.5, 0.7), X)
case("elementwise/where", lambda x, b: jnp.where(b, x, -x), X, B)
case("elementwise/reduce_precision", lambda x: lax.reduce_precision(x, 5, 2),
     np.array([1.0001, 3.14159, 1e5, 65519], np.float32))
case("elementwise/bitcast_narrow", lambda x: lax.bitcast_convert_type(x, jnp.uint8), f32(2, 4))

# reductions
for name, fn in [("sum", jnp.sum), ("mean", jnp.mean), ("max", jnp.max), ("min", jnp.min), ("prod", jnp.prod),
                 ("var", jnp.var), ("std", jnp.std), ("logsumexp", jax.scipy.special.logsumexp),
                 ("norm", jnp.linalg.norm)]:
    case(f"reduce/{name}", fn, X)
    case(f"reduce/{name}_axis1", lambda x, fn=fn: fn(x, axis=1), X)
case("reduce/argmax", lambda x: jnp.argmax(x, axis=0), X)
case("reduce/argmin", lambda x: jnp.argmin(x, axis=1), X)
case("reduce/all", lambda b: jnp.all(b, axis=0), B)
case("reduce/any", lambda b: jnp.any(b, axis=1), B)
case("reduce/count_nonzero", lambda x: jnp.count_nonzero(x > 0, axis=0), X)
case("reduce/sum_int", lambda i: jnp.sum(i, axis=1), I)
case("reduce/softmax", lambda x: jax.nn.softmax(x, axis=-1), X)
case("reduce/layer_norm", lambda x: (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5), X)

# reductions over no elements: the identity, as XLA gives it
EMPTY = np.zeros((0, 3), np.float32)
case("reduce/empty_max_min", lambda z: (lax.reduce_max(z, (0,)), lax.reduce_min(z.astype(jnp.int8), (0,)),
                                        z.max(initial=-1.0), jnp.all(z > 0, axis=0)), EMPTY)
case("reduce/empty_dot", lambda z: (z.T @ z, jnp.einsum("ij,ij->j", z, z)), EMPTY)
case("reduce/empty_fft", lambda z: jnp.fft.fft(z.astype(jnp.complex64), axis=0), EMPTY)
case("reduce/window_larger_than_input", lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (9, 2), (1, 1), "VALID"), X)

# broadcasting
case("broadcast/row_col", lambda a, b: a + b, f32(4, 1), f32(1, 5))
case("broadcast/scalar", lambda a: a * 3.0 + 1, X)
case("broadcast/rank3", lambda a, b: a * b, f32(2, 1, 5), f32(4, 1))
case("broadcast/to", lambda a: jnp.broadcast_to(a, (3, 4, 5)), X)
case("broadcast/outer_compare", lambda a, b: a[:, None] < b[None, :], V, V[::-1])
case("broadcast/expand_dims", lambda a: jnp.expand_dims(a, (0, 2)) * 2, X)

# dot / einsum
case("dot/matmul", jnp.matmul, X, f32(5, 3))
case("dot/batched", jnp.matmul, f32(3, 4, 5), f32(3, 5, 2))
case("dot/broadcast_batch", jnp.matmul, f32(3, 4, 5), f32(5, 2))
case("dot/vdot", jnp.vdot, V, V[::-1])
case("dot/outer", jnp.outer, V, V)
case("dot/tensordot", lambda a, b: jnp.tensordot(a, b, axes=([1, 2], [0, 1])), f32(2, 3, 4), f32(3, 4, 5))
case("dot/einsum_trace", lambda a: jnp.einsum("ii->", a), SPD)
case("dot/einsum_bilinear", lambda a, w, b: jnp.einsum("bi,ij,bj->b", a, w, b), f32(3, 4), f32(4, 4), f32(3, 4))
case("dot/einsum_attention", lambda q, k, v: jnp.einsum("qk,kd->qd", jax.nn.softmax(q @ k.T / 2.0), v),
     f32(6, 8), f32(5, 8), f32(5, 3))
case("dot/int", jnp.matmul, ints(3, 4, low=-5, high=5), ints(4, 2, low=-5, high=5))
case("dot/mlp", lambda x, w1, w2: jnp.tanh(x @ w1) @ w2, f32(8, 16), f32(16, 32) * 0.3, f32(32, 4) * 0.3)

# convolutions
case("conv/2d_same", lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME"), IMG, KER)
case("conv/2d_valid_strided", lambda x, w: lax.conv_general_dilated(x, w, (2, 2), "VALID"), IMG, KER)
case("conv/2d_dilated", lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", rhs_dilation=(2, 2)), IMG, KER)
case("conv/2d_nhwc", lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")),
     f32(2, 8, 8, 3), f32(3, 3, 3, 4))
case("conv/1d_groups", lambda x, w: lax.conv_general_dilated(x, w, (1,), "VALID", feature_group_count=2),
     f32(2, 4, 9), f32(6, 2, 3))
case("conv/transpose", lambda x, w: lax.conv_transpose(x, w, (2, 2), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")),
     f32(1, 3, 4, 4), f32(2, 3, 3, 3))
case("conv/convolve", lambda a, b: jnp.convolve(a, b, mode="same"), V, f32(5))
case("conv/correlate", lambda a, b: jnp.correlate(a, b, mode="full"), V, f32(3))
case("conv/max_pool", lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID"), IMG)
case("conv/avg_pool", lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 1, 3, 3), (1, 1, 1, 1), "SAME") / 9, IMG)

# gather / scatter, in and out of range
IDX_IN = np.array([0, 3, 9, 2], np.int32)
IDX_OUT = np.array([0, 5, 9, 100, -1, -20, 2**30], np.int32)
case("gather/take_in", lambda e, i: e[i], E, IDX_IN)
case("gather/take_out_of_range", lambda e, i: e[i], E, IDX_OUT)
case("gather/vector_out_of_range", lambda v, i: v[i], V, IDX_OUT)
case("gather/clip", lambda v, i: jnp.take(v, i, mode="clip"), V, IDX_OUT)
case("gather/fill", lambda v, i: jnp.take(v, i, mode="fill", fill_value=-1.0), V, IDX_OUT)
case("gather/fill_nan", lambda e, i: jnp.take(e, i, axis=0, mode="fill"), E, IDX_OUT)
case("gather/wrap", lambda v, i: jnp.take(v, i, mode="wrap"), V, IDX_OUT)
case("gather/take_along_axis", lambda x, i: jnp.take_along_axis(x, i, axis=1), X, ints(4, 3, low=0, high=5))
case("gather/take_along_axis_out", lambda x, i: jnp.take_along_axis(x, i, axis=1, mode="clip"), X, ints(4, 3, low=-9, high=9))
case("gather/2d_points", lambda x, r, c: x[r, c], X, np.array([0, 3, 7, -9], np.int32), np.array([1, 4, 2, 99], np.int32))
case("gather/embedding_int64_ids", lambda e, i: e[i].sum(0), E, np.array([1, 3, 2**31 - 1], np.int32))
case("gather/uint8_ids", lambda e, i: e[i], E, np.array([0, 9, 200, 255], np.uint8))
case("scatter/set_in", lambda v, i: v.at[i].set(7.0), V, IDX_IN)
case("scatter/set_out_of_range", lambda v, i: v.at[i].set(7.0), V, IDX_OUT)
case("scatter/add_out_of_range", lambda v, i: v.at[i].add(1.0), V, IDX_OUT)
case("scatter/mul_out_of_range", lambda v, i: v.at[i].multiply(3.0), V, IDX_OUT)
case("scatter/min_out_of_range", lambda v, i: v.at[i].min(-5.0), V, IDX_OUT)
case("scatter/max_out_of_range", lambda v, i: v.at[i].max(5.0), V, IDX_OUT)
case("scatter/rows_out_of_range", lambda e, i: e.at[i].set(1.0), E, IDX_OUT)
IDX_CLIPPED = np.array([5, 100, -20, 2**30], np.int32)  # 100 and 2**30 land on 15, -20 (-4) on 0
case("scatter/clip", lambda v, i: v.at[i].set(7.0, mode="clip"), V, IDX_CLIPPED)
case("scatter/add_clip", lambda v, i: v.at[i].add(1.0, mode="clip"), V, IDX_CLIPPED)
case("scatter/rows_clip", lambda e, i, u: e.at[i].max(u, mode="clip"), E, IDX_CLIPPED, f32(4, 4))
case("scatter/drop", lambda v, i: v.at[i].add(2.0, mode="drop"), V, IDX_OUT)
case("scatter/duplicates_add", lambda v, i: v.at[i].add(1.0), V, np.array([1, 1, 1, 4], np.int32))
case("scatter/2d", lambda x, r, c: x.at[r, c].set(0.0), X, np.array([0, 3, 9], np.int32), np.array([1, 4, 2], np.int32))
case("scatter/apply", lambda v, i: v.at[i].apply(jnp.sin), V, IDX_IN)
case("scatter/segment_sum", lambda v, s: jax.ops.segment_sum(v, s, num_segments=4), V, ints(16, low=0, high=6))

# sort / top_k
case("sort/sort", jnp.sort, V)
case("sort/sort_axis0", lambda x: jnp.sort(x, axis=0), X)
case("sort/descending", lambda v: jnp.sort(v, descending=True), V)
case("sort/argsort_stable", lambda v: jnp.argsort(v, stable=True), np.array([2.0, 1.0, 2.0, 1.0, 0.0, 2.0] * 6, np.float32))
case("sort/lax_sort_stable", lambda k, v: lax.sort((k, v), num_keys=1, is_stable=True),
     np.array([1, 0, 1, 0] * 8, np.int32), np.arange(32, dtype=np.float32))
case("sort/two_keys", lambda a, b, c: lax.sort((a, b, c), num_keys=2), ints(12, low=0, high=3), ints(12, low=0, high=3),
     f32(12))
case("sort/nan", jnp.sort, np.array([3.0, np.nan, -1.0, np.inf, -np.inf, 0.0], np.float32))
case("sort/int", jnp.sort, ints(20))
case("sort/top_k", lambda v: lax.top_k(v, 3), V)
case("sort/top_k_axis0", lambda x: lax.top_k(x, 2, axis=0), X)
case("sort/top_k_nan_zeros_and_ties", lambda v: lax.top_k(v, 9),
     np.array([1.0, -np.nan, np.nan, -np.inf, 0.0, -0.0, 1.0, np.inf, 2.0, 2.0, -0.0], np.float32))
case("sort/top_k_integer_ties", lambda v: lax.top_k(v, 4), np.array([3, -1, 7, 7, 2, 7, 3], np.int32))
case("sort/median", jnp.median, V)
case("sort/unique_size", lambda v: jnp.unique(v, size=8, fill_value=-1), ints(16, low=0, high=6))

# cumulative
case("cumulative/cumsum", lambda x: jnp.cumsum(x, axis=1), X)
case("cumulative/cumprod", lambda x: jnp.cumprod(x, axis=0), UNIT + 1)
case("cumulative/cummax", lambda x: lax.cummax(x, axis=1), X)
case("cumulative/cummin_reverse", lambda x: lax.cummin(x, axis=0, reverse=True), X)
case("cumulative/cumlogsumexp", lambda x: lax.cumlogsumexp(x, axis=1), X)
case("cumulative/cumsum_int", lambda i: jnp.cumsum(i), I)

# control flow
case("control/cond", lambda x: lax.cond(x.sum() > 0, lambda y: y * 2, lambda y: y - 1, x), X)
case("control/switch", lambda i, x: lax.switch(i, [jnp.sin, jnp.cos, jnp.tanh], x), np.int32(2), X)
case("control/switch_out_of_range", lambda i, x: lax.switch(i, [jnp.sin, jnp.cos], x), np.int32(9), X)
case("control/while", lambda x: lax.while_loop(lambda c: c[0] < 10, lambda c: (c[0] + 1, c[1] * 0.9), (0, x))[1], X)
case("control/fori", lambda n: lax.fori_loop(0, n, lambda i, a: a + i * i, 0), np.int32(12))
case("control/scan_cumsum", lambda x: lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(5), x), X)
case("control/scan_reverse", lambda x: lax.scan(lambda c, r: (c * 0.5 + r, c), 0.0, x, reverse=True), V)
case("control/rnn", lambda h, xs, w: lax.scan(lambda h, x: (jnp.tanh(h @ w + x), h.sum()), h, xs),
     f32(4), f32(6, 4), f32(4, 4) * 0.5)
case("control/nested", lambda x: lax.fori_loop(0, 3, lambda i, a: lax.cond(i % 2 == 0, lambda b: b * 2, lambda b: b - 1, a), x), X)
case("control/vmap", jax.vmap(lambda row: jnp.dot(row, row)), X)
case("control/map", lambda x: lax.map(jnp.sum, x), X)

# dynamic slicing
case("dynamic/slice", lambda x, i: lax.dynamic_slice(x, (i, 1), (2, 3)), X, np.int32(1))
case("dynamic/slice_out_of_range", lambda x, i: lax.dynamic_slice(x, (i, 1), (2, 3)), X, np.int32(100))
case("dynamic/slice_negative", lambda v, i: lax.dynamic_slice_in_dim(v, i, 4), V, np.int32(-7))
case("dynamic/update", lambda x, u, i: lax.dynamic_update_slice(x, u, (i, 0)), X, f32(2, 5), np.int32(1))
case("dynamic/update_out_of_range", lambda x, u, i: lax.dynamic_update_slice(x, u, (i, 0)), X, f32(2, 5), np.int32(2**30))
case("dynamic/index", lambda x, i: x[i], X, np.int32(-1))

# shape ops
case("shape/reshape", lambda x: x.reshape(5, 4), X)
case("shape/transpose", lambda x: jnp.transpose(x.reshape(2, 2, 5), (2, 0, 1)), X)
case("shape/concatenate", lambda a, b: jnp.concatenate([a, b], axis=1), X, f32(4, 2))
case("shape/stack", lambda a, b: jnp.stack([a, b], axis=1), X, X * 2)
case("shape/split", lambda x: jnp.split(x, [1, 3], axis=1), X)
case("shape/pad", lambda x: jnp.pad(x, ((1, 2), (0, 3)), constant_values=9.0), X)
case("shape/pad_reflect", lambda x: jnp.pad(x, ((1, 1), (2, 2)), mode="reflect"), X)
case("shape/tile", lambda x: jnp.tile(x, (2, 3)), X)
case("shape/repeat", lambda x: jnp.repeat(x, 2, axis=0), X)
case("shape/flip", lambda x: jnp.flip(x, (0, 1)), X)
case("shape/roll", lambda x: jnp.roll(x, 3, axis=1), X)
case("shape/squeeze", lambda x: jnp.squeeze(x[:, :1]), X)
case("shape/diag", jnp.diag, X[:, :4])
case("shape/diag_vector", jnp.diag, V[:5])
case("shape/tril", jnp.tril, X)
case("shape/triu", lambda x: jnp.triu(x, 1), X)
case("shape/eye_like", lambda x: x * jnp.eye(4, 5), X)
case("shape/slice_stride", lambda x: x[::2, 1::2], X)
case("shape/rot90", jnp.rot90, X)
case("shape/meshgrid", lambda a, b: jnp.stack(jnp.meshgrid(a, b)), V[:3], V[:4])
case("shape/interp", lambda x: jnp.interp(x, jnp.arange(4.0), jnp.arange(4.0) ** 2), X + 1)
case("shape/searchsorted", lambda x: jnp.searchsorted(jnp.array([-1.0, 0.0, 0.5, 2.0]), x), X)
case("shape/histogram", lambda v: jnp.histogram(v, bins=4, range=(-2.0, 2.0))[0], V)

# integer and bitwise
case("int/add_wrap", lambda a: a + np.int32(2**31 - 1), ints(6))
case("int/mul_wrap", lambda a: a * np.int32(65537), ints(6, low=-10**6, high=10**6))
case("int/floor_divide", jnp.floor_divide, I, np.where(I == 0, 3, I))
case("int/div_by_zero", lax.div, np.array([7, -7, 0], np.int32), np.array([0, 0, 0], np.int32))
case("int/rem_negative", jnp.remainder, I, np.where(I == 0, -3, I))
case("int/shift_left", lambda a, s: a << s, I, ints(4, 5, low=0, high=35))
case("int/shift_right", lambda a, s: a >> s, I, ints(4, 5, low=0, high=35))
case("int/shift_right_logical", lax.shift_right_logical, I, ints(4, 5, low=0, high=35))
case("int/unsigned_shifts", lambda a, s: (lax.shift_right_arithmetic(a, s), lax.shift_right_logical(a, s),
                                          lax.shift_left(a, s)), np.array([2**31, 5, 2**32 - 1, 1, 2**31 + 7], np.uint32),
     np.array([31, 32, 0, 100, 3], np.uint32))
case("int/shift_amounts_out_of_range", lambda a, s: (lax.shift_right_arithmetic(a, s), lax.shift_right_logical(a, s),
                                                     lax.shift_left(a, s)), I, ints(4, 5, low=-40, high=40))
case("int/and_or_xor", lambda a, b: (a & b, a | b, a ^ b, ~a), I, I[::-1])
case("int/popcount", lax.population_count, I)
case("int/clz", lax.clz, I)
case("int/int8_overflow", lambda a: a * np.int8(3), ints(8, low=-128, high=127, dtype=np.int8))
case("int/uint8_arith", lambda a, b: (a - b, a * b, a // np.uint8(7)), ints(8, low=0, high=255, dtype=np.uint8),
     ints(8, low=0, high=255, dtype=np.uint8))
case("int/uint32_ops", lambda a: (a >> np.uint32(3), a * np.uint32(2654435761)), ints(8, low=0, high=2**31, dtype=np.uint32))
case("int/gcd", jnp.gcd, ints(8, low=1, high=100), ints(8, low=1, high=100))
case("int/float_to_int_saturates", lambda x: x.astype(jnp.int8), np.array([-300.0, 1e10, np.nan, 2.7, -2.7], np.float32))
case("int/float_to_int32_saturates_at_the_limits", lambda x: (x.astype(jnp.int32), x.astype(jnp.uint32)),
     np.array([np.inf, -np.inf, np.nan, 3e9, -3e9, 2**31, 2147483520.0, -2**31, 5e9, 4294967040.0], np.float32))
case("int/bool_logic", lambda a, b: (a & b, a | ~b, a ^ b), B, B[::-1])

# every dtype
for dtype in ["float16", "bfloat16", "float32", "int8", "int16", "int32", "uint8", "uint16", "uint32", "complex64"]:
    array = (X * 10).astype(dtype) if "int" not in dtype else ints(4, 5, low=0, high=100, dtype=dtype)
    case(f"dtype/{dtype}_arith", lambda a: a * a + a - (a // 3 if jnp.issubdtype(a.dtype, jnp.integer) else a / 3), array)
    case(f"dtype/{dtype}_reduce", lambda a: (a.sum(axis=0), a.max(axis=1)) if a.dtype != jnp.complex64 else a.sum(axis=0), array)
    case(f"dtype/{dtype}_convert", lambda a: (a.astype(jnp.float32) if a.dtype != jnp.complex64 else a.real, a.astype(jnp.int32) if a.dtype != jnp.complex64 else a.imag), array)
case("dtype/bool", lambda b: (jnp.logical_not(b), b.sum(), b.astype(jnp.float32)), B)
case("dtype/complex64_math", lambda z: (jnp.exp(z), jnp.abs(z), jnp.conj(z) * z, jnp.angle(z)), (X + 1j * POS).astype(np.complex64))
case("dtype/float16_math", lambda a: jnp.tanh(a) * jnp.exp(a / 4), X.astype(np.float16))
case("dtype/bfloat16_matmul", lambda a, b: a @ b, X.astype(jnp.bfloat16), f32(5, 3).astype(jnp.bfloat16))
case("dtype/float16_matmul_accumulates_wide", lambda a, b: a @ b, f32(64, 256).astype(np.float16),
     f32(256, 64).astype(np.float16), rtol=2e-3)
case("dtype/float16_conv_accumulates_wide", lambda x, k: lax.conv(x, k, (1, 1), "SAME"),
     (IMG * 20).astype(np.float16), (KER * 20).astype(np.float16), rtol=2e-3)
for dtype in ["float64", "int64", "uint64"]:
    array = (X.astype(np.float64) / 3 if dtype == "float64" else ints(4, 5, low=0, high=100, dtype=dtype))
    case(f"dtype/{dtype}_arith", lambda a: a * a + a, array, x64=True)
    case(f"dtype/{dtype}_reduce", lambda a: (a.sum(axis=0), a.max(axis=1)), array, x64=True)
case("dtype/int64_large", lambda a: a + 1, np.array([1, 2**32 + 1, 2**62], np.int64), x64=True)
case("dtype/float64_precision", lambda a: (a + 1e-12) - a, np.array([1.0, 1e5], np.float64), x64=True)
case("dtype/float64_math", lambda a: (jnp.exp(a), jnp.sin(a), jnp.sqrt(jnp.abs(a))), X.astype(np.float64), x64=True)
case("dtype/float64_matmul", lambda a, b: a @ b, X.astype(np.float64), f32(5, 3).astype(np.float64), x64=True)

# jax.random
case("random/uniform_const_key", lambda x: jax.random.uniform(jax.random.PRNGKey(0), (3,)) + x[:3], V)
case("random/normal_key_input", lambda k: jax.random.normal(k, (4, 3)), KEY)
case("random/randint", lambda k: jax.random.randint(k, (10,), 0, 100), KEY)
case("random/bernoulli", lambda k: jax.random.bernoulli(k, 0.3, (12,)), KEY)
case("random/split_fold_in", lambda k: jax.random.uniform(jax.random.fold_in(jax.random.split(k)[1], 7), (5,)), KEY)
case("random/typed_key", lambda s: jax.random.normal(jax.random.key(s), (6,)), np.int32(11))
case("random/permutation", lambda k: jax.random.permutation(k, 10), KEY)
case("random/categorical", lambda k, logits: jax.random.categorical(k, logits, axis=-1), KEY, X)
case("random/dropout", lambda k, x: jnp.where(jax.random.bernoulli(k, 0.8, x.shape), x / 0.8, 0.0), KEY, X)
case("random/bits_uint8", lambda k: jax.random.bits(k, (7,), jnp.uint8), KEY)

# jax.grad
case("grad/tanh", jax.grad(lambda x: jnp.sum(jnp.tanh(x) ** 2)), X)
case("grad/mlp", jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)), f32(5, 3), X)
case("grad/softmax_xent", jax.grad(lambda logits, y: -jnp.sum(jax.nn.log_softmax(logits) * y)), X, jax.nn.one_hot(np.array([0, 2, 4, 1]), 5))
case("grad/value_and_grad", jax.value_and_grad(lambda x: jnp.sum(jnp.sin(x) * x)), X)
case("grad/conv", jax.grad(lambda w, x: jnp.sum(lax.conv_general_dilated(x, w, (1, 1), "SAME") ** 2)), KER, IMG)
case("grad/max_pool", jax.grad(lambda x: jnp.sum(lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID"))), IMG)
POOLED = f32(2, 3, 7, 7)
POOLED[0, 0, 1, 1], POOLED[1, 2, 3:5, 3:5] = np.nan, 2.0  # a NaN and a block of ties inside overlapping windows
case("grad/max_pool_overlapping_nan_ties",
     jax.grad(lambda x: jnp.sum(lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 3, 3), (1, 1, 2, 2), "SAME") * 1.5)),
     POOLED)
case("grad/min_pool_stride_1",
     jax.grad(lambda x: jnp.sum(lax.reduce_window(x, jnp.inf, lax.min, (1, 1, 3, 3), (1, 1, 1, 1), "SAME") ** 2)),
     POOLED)
case("grad/max_pool_window_larger_than_input",
     jax.grad(lambda x: jnp.sum(lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 9, 1), (1, 1, 1, 1), "VALID"))), POOLED)
case("grad/gather", jax.grad(lambda e, i: jnp.sum(e[i] ** 2)), E, IDX_IN)
case("grad/hessian", jax.hessian(lambda x: jnp.sum(x ** 3)), V[:4])
case("grad/jacfwd", jax.jacfwd(lambda x: jnp.sin(x) * x[0]), V[:4])
case("grad/scan", jax.grad(lambda w, xs: lax.scan(lambda h, x: (jnp.tanh(h * w + x), None), 0.0, xs)[0]), np.float32(0.5), V)

# linear algebra
case("linalg/solve", lambda a, b: jnp.linalg.solve(a, b), SPD, f32(4))
case("linalg/inv", jnp.linalg.inv, SPD)
case("linalg/det", jnp.linalg.det, SPD)
case("linalg/slogdet", lambda a: jnp.linalg.slogdet(a), SPD)
case("linalg/cholesky", jnp.linalg.cholesky, SPD)
case("linalg/qr_r_abs", lambda a: jnp.abs(jnp.linalg.qr(a)[1]), X)
case("linalg/svd_values", lambda a: jnp.linalg.svd(a, compute_uv=False), X)
case("linalg/eigvalsh", jnp.linalg.eigvalsh, SPD)
case("linalg/lstsq", lambda a, b: jnp.linalg.lstsq(a, b)[0], f32(6, 3), f32(6))
case("linalg/pinv", jnp.linalg.pinv, X)
case("linalg/solve_triangular", lambda a, b: jax.scipy.linalg.solve_triangular(jnp.tril(a) + 4 * jnp.eye(4), b, lower=True), SPD, f32(4, 2))
case("linalg/lu_factor_lu_solve", lambda a, b: jax.scipy.linalg.lu_solve(jax.scipy.linalg.lu_factor(a), b), X[:, :4], f32(4))
case("linalg/solve_singular", jnp.linalg.solve, np.array([[1, 2, 3], [2, 4, 6], [1, 0, 1]], np.float32), f32(3))
case("linalg/cholesky_not_positive_definite", jnp.linalg.cholesky, -SPD)
case("linalg/expm", jax.scipy.linalg.expm, SPD / 8)
case("sort/searchsorted_scan_scalar", lambda a, v: jnp.searchsorted(a, v, method="scan"), np.sort(V), np.float32(0.3))

# FFT
case("fft/fft_pow2", jnp.fft.fft, V)
case("fft/ifft_pow2", jnp.fft.ifft, (V + 1j * V[::-1]).astype(np.complex64))
case("fft/rfft_pow2", jnp.fft.rfft, V)
case("fft/irfft_pow2", lambda z: jnp.fft.irfft(z, n=16), jnp.fft.rfft(V))
case("fft/fft2", jnp.fft.fft2, f32(4, 8))
case("fft/fft_odd_length", jnp.fft.fft, f32(10))
case("fft/rfft_odd_length", jnp.fft.rfft, f32(7))
case("fft/irfft_odd_length", lambda z: jnp.fft.irfft(z, n=9), jnp.fft.rfft(f32(9)))
case("fft/fftn_mixed_lengths", jnp.fft.fftn, (f32(3, 4, 5) + 1j * f32(3, 4, 5)).astype(np.complex64))
case("fft/stft_400_hann", lambda v: jnp.abs(jnp.fft.rfft(v.reshape(-1, 400) * jnp.hanning(400))) ** 2, f32(2000))
case("fft/power_spectrum", lambda v: jnp.abs(jnp.fft.rfft(v)) ** 2, V)

assert len({c.name for c in CASES}) == len(CASES), "case names must be unique"


def tolerance(dtype: np.dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing with XLA: exact for integers and bools, by precision for floats."""
    name = np.dtype(dtype).name
    return {"float16": (1e-2, 1e-2), "bfloat16": (3e-2, 3e-2), "float32": (2e-4, 2e-5), "complex64": (2e-4, 2e-5),
            "float64": (1e-10, 1e-12), "complex128": (1e-10, 1e-12)}.get(name, (0.0, 0.0))


def mismatch(case: Case, got: Any, want: Any) -> str | None:
    """Why ``got`` differs from XLA's ``want`` (structure, shape, dtype or values), or None when they agree."""
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    if got_tree != want_tree:
        return f"structure {got_tree} != {want_tree}"
    for position, (mine, theirs) in enumerate(zip(got_leaves, want_leaves)):
        mine, theirs = np.asarray(mine), np.asarray(theirs)
        if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
            return f"output {position}: {mine.dtype}{list(mine.shape)} != XLA's {theirs.dtype}{list(theirs.shape)}"
        rtol, atol = (case.rtol, case.rtol) if case.rtol is not None else tolerance(theirs.dtype)
        wide = np.complex128 if theirs.dtype.kind == "c" else np.float64
        if not np.allclose(mine.astype(wide), theirs.astype(wide), rtol=rtol, atol=atol, equal_nan=True):
            return f"output {position}: values differ from XLA's (rtol {rtol}, atol {atol}):\n{mine}\nvs\n{theirs}"
    return None


def run(case: Case, compiler: str, **options: Any) -> tuple[str, str]:
    """("agree" | "clear error" | "wrong" | "unclear error", detail) of ``case`` on ``compiler`` (with these
    options, e.g. a GPU device) against XLA on the CPU."""
    import jitserve as js

    with jax.enable_x64(case.x64):
        with jax.default_device(jax.devices("cpu")[0]):  # the reference: XLA on the CPU
            want = jax.device_get(jax.jit(case.fn)(*case.args))
        try:
            got = js.jit(case.fn, compiler=compiler, **options)(*case.args)
            got = jax.tree_util.tree_map(np.asarray, got)
        except js.JitserveError as error:
            return "clear error", f"{type(error).__name__}: {str(error).splitlines()[0]}"
        except Exception as error:
            return "unclear error", f"{type(error).__name__}: {error}"
    problem = mismatch(case, got, want)
    return ("agree", "") if problem is None else ("wrong", problem)

# scatters under jax.vmap: batching dimensions, and the windows of dynamic_update_slice (a KV cache per slot)
CACHE = f32(3, 2, 4, 8, 5)  # (slots, layers, heads, positions, head size)
POSITIONS = np.array([0, 7, 3], np.int32)
case("scatter/vmap_update_slice",
     jax.vmap(lambda c, r, p: lax.dynamic_update_slice(c, r[None], (p, 0))), f32(3, 8, 4), f32(3, 4), POSITIONS)
case("scatter/vmap_kv_cache_write",
     jax.vmap(lambda c, k, p: lax.dynamic_update_slice(c, k[None, :, None], (1, 0, p, 0))), CACHE, f32(3, 4, 5),
     POSITIONS)
case("scatter/vmap_update_slice_clamped",
     jax.vmap(lambda c, b, p: lax.dynamic_update_slice(c, b, (p, 0))), f32(3, 8, 4), f32(3, 3, 4),
     np.array([-4, 6, 2**30], np.int32))
case("scatter/vmap_add_drop",
     jax.vmap(lambda v, p: v.at[p].add(1.0, mode="drop")), f32(3, 9), np.array([[0, 9], [4, -1], [8, 8]], np.int32))
case("scatter/vmap_rows_max", jax.vmap(lambda x, p, u: x.at[p].max(u)), f32(3, 6, 4), ints(3, 2, low=0, high=6),
     f32(3, 2, 4))
