"""Every entry of the evaluator's table against XLA, on seeded random inputs.

``CASES`` holds, per primitive, functions whose traced graph contains it and
their inputs; each is run by the evaluator and by ``jax.jit`` and compared,
dtypes included. A meta-test fails when a table entry has no case, or when a
case does not actually exercise its primitive.
"""

from __future__ import annotations

import jax
import jax.extend.random
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from jax import lax
from jax.extend import core as jcore

import jitserve as js
from jitserve.compilers.evaluator.primitives import PHYSICAL_RULES, PRIMITIVES, physical_shape_dtype

rng = np.random.default_rng(20261122)


def f32(*shape, low=-2.0, high=2.0):
    return rng.uniform(low, high, size=shape).astype(np.float32)


def i32(*shape, low=-50, high=50):
    return rng.integers(low, high, size=shape).astype(np.int32)


def u8(*shape):
    return rng.integers(0, 255, size=shape).astype(np.uint8)


def boolean(*shape):
    return rng.uniform(size=shape) > 0.5


X = f32(3, 4)
POS = f32(3, 4, low=0.1, high=3.0)
UNIT = f32(3, 4, low=-0.9, high=0.9)
I = i32(3, 4)
NZ = np.where(i32(3, 4) == 0, 7, i32(3, 4)).astype(np.int32)
B = boolean(3, 4)


def unary(fn, *inputs):
    return [(fn, (x,)) for x in inputs]


CASES: dict[str, list[tuple]] = {
    "neg": unary(lax.neg, X, I),
    "sign": unary(lax.sign, X, I),
    "floor": unary(lax.floor, X),
    "ceil": unary(lax.ceil, X),
    "round": [(lambda x: lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO), (np.array([0.5, 1.5, -0.5, -2.5, 2.4], np.float32),)),
              (lambda x: lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN), (np.array([0.5, 1.5, -0.5, -2.5, 2.6], np.float32),))],
    "is_finite": unary(lax.is_finite, np.array([1.0, np.inf, -np.inf, np.nan], np.float32)),
    "exp": unary(lax.exp, X),
    "exp2": unary(lax.exp2, X),
    "log": unary(lax.log, POS),
    "log1p": unary(lax.log1p, POS),
    "expm1": unary(lax.expm1, X),
    "tanh": unary(lax.tanh, X),
    "logistic": unary(lax.logistic, X * 10),
    "sin": unary(lax.sin, X),
    "cos": unary(lax.cos, X),
    "tan": unary(lax.tan, UNIT),
    "asin": unary(lax.asin, UNIT),
    "acos": unary(lax.acos, UNIT),
    "atan": unary(lax.atan, X),
    "sinh": unary(lax.sinh, X),
    "cosh": unary(lax.cosh, X),
    "asinh": unary(lax.asinh, X),
    "acosh": unary(lax.acosh, POS + 1),
    "atanh": unary(lax.atanh, UNIT),
    "sqrt": unary(lax.sqrt, POS),
    "rsqrt": unary(lax.rsqrt, POS),
    "cbrt": unary(lax.cbrt, X),
    "abs": unary(lax.abs, X, I),
    "square": unary(lax.square, X, I),
    "not": unary(lax.bitwise_not, B, I, u8(5)),
    "erf": unary(lax.erf, X),
    "erfc": unary(lax.erfc, X),
    "erf_inv": unary(lax.erf_inv, UNIT),
    "lgamma": unary(lax.lgamma, POS),
    "digamma": unary(lax.digamma, POS),
    "igamma": [(lax.igamma, (POS, POS[::-1]))],
    "igammac": [(lax.igammac, (POS, POS[::-1]))],
    "bessel_i0e": unary(lax.bessel_i0e, X),
    "bessel_i1e": unary(lax.bessel_i1e, X),
    "polygamma": [(lax.polygamma, (np.float32(1.0) + 0 * POS, POS))],
    "zeta": [(lax.zeta, (POS + 1.5, POS))],
    "regularized_incomplete_beta": [(lax.betainc, (POS, POS[::-1], f32(3, 4, low=0.05, high=0.95)))],
    "integer_pow": [(lambda x: lax.integer_pow(x, 3), (X,)), (lambda x: lax.integer_pow(x, -2), (POS,)),
                    (lambda x: lax.integer_pow(x, 2), (I,)), (lambda x: lax.integer_pow(x, 0), (X,))],
    "real": unary(lax.real, (X + 1j * POS).astype(np.complex64)),
    "imag": unary(lax.imag, (X + 1j * POS).astype(np.complex64)),
    "conj": unary(lax.conj, (X + 1j * POS).astype(np.complex64)),
    "population_count": unary(lax.population_count, I, u8(6)),
    "clz": unary(lax.clz, I, u8(6), np.array([0, 1, -1, 2**30], np.int32)),
    "copy": [(lambda x: jnp.array(x, copy=True) * 1, (X,)), (lax.copy_p.bind, (X,))],
    "reduce_precision": [(lambda x: lax.reduce_precision(x, exponent_bits=8, mantissa_bits=23), (X,)),
                         (lambda x: lax.reduce_precision(x, 5, 2), (np.array([1.0001, 3.14159, 1e5, 65519, np.nan, -7.9], np.float32),)),
                         (lambda x: lax.reduce_precision(x, 5, 10), (X * 1e4,)),
                         (lambda x: lax.reduce_precision(x, 8, 7), (X.astype(np.float16),))],
    "stop_gradient": [(lambda x: lax.stop_gradient(x) + 1, (X,))],
    "optimization_barrier": [(lambda x, y: lax.optimization_barrier((x, y)), (X, I))],
    "add": [(lax.add, (X, f32(3, 4))), (lax.add, (I, I)), (jnp.add, (X, np.float32(2.0)))],
    "sub": [(lax.sub, (X, f32(3, 4))), (lax.sub, (I, I))],
    "add_any": [(jax.grad(lambda x: jnp.sum(x * x + jnp.sin(x))), (X,))],
    "mul": [(lax.mul, (X, f32(3, 4))), (lax.mul, (I, I)), (lambda x, y: x * y, (f32(3, 1), f32(1, 4)))],
    "div": [(lax.div, (X, POS)), (lax.div, (I, NZ)), (lax.div, (np.array([7, -7, 5], np.int32), np.array([2, 2, 0], np.int32)))],
    "rem": [(lax.rem, (X, POS)), (lax.rem, (I, NZ)), (lax.rem, (np.array([7, -7], np.int32), np.array([0, 3], np.int32)))],
    "pow": [(lax.pow, (POS, X)), (lax.pow, (POS, i32(3, 4, low=-3, high=4)))],
    "max": [(lax.max, (X, f32(3, 4))), (lax.max, (I, I[::-1]))],
    "min": [(lax.min, (X, f32(3, 4))), (lax.min, (I, I[::-1]))],
    "atan2": [(lax.atan2, (X, f32(3, 4)))],
    "nextafter": [(lax.nextafter, (X, f32(3, 4)))],
    "complex": [(lax.complex, (X, POS))],
    "and": [(lax.bitwise_and, (B, B[::-1])), (lax.bitwise_and, (I, NZ))],
    "or": [(lax.bitwise_or, (B, B[::-1])), (lax.bitwise_or, (I, NZ))],
    "xor": [(lax.bitwise_xor, (B, B[::-1])), (lax.bitwise_xor, (I, NZ))],
    "eq": [(lax.eq, (I, I[::-1])), (lax.eq, (X, X))],
    "ne": [(lax.ne, (I, I[::-1]))],
    "lt": [(lax.lt, (X, X[::-1]))],
    "le": [(lax.le, (I, I[::-1]))],
    "gt": [(lax.gt, (X, X[::-1]))],
    "ge": [(lax.ge, (I, I[::-1]))],
    "le_to": [(lambda x: jnp.searchsorted(jnp.array([-1.0, 0.0, 0.5, 2.0]), x), (np.array([-0.0, 0.0, np.nan, 0.7, -np.inf], np.float32),))],
    "lt_to": [(lambda x: jnp.searchsorted(jnp.array([-1.0, 0.0, 0.5, 2.0]), x, side="right"), (X,)),
              (lambda x: jnp.interp(x, jnp.arange(4.0), jnp.arange(4.0) ** 2), (X + 1,))],
    "shift_left": [(lax.shift_left, (I, i32(3, 4, low=0, high=40))), (lax.shift_left, (u8(4), u8(4) % 9))],
    "shift_right_logical": [(lax.shift_right_logical, (I, i32(3, 4, low=0, high=40)))],
    "shift_right_arithmetic": [(lax.shift_right_arithmetic, (I, i32(3, 4, low=0, high=40)))],
    "select_n": [(lax.select_n, (B, X, X * 2)), (lax.select_n, (i32(3, 4, low=0, high=3), X, X * 2, X * 3)),
                 (jnp.where, (B[0], np.float32(1.0), X))],
    "clamp": [(lax.clamp, (np.float32(-0.5), X, np.float32(0.5))), (jnp.clip, (I, -3, 5))],
    "convert_element_type": [(lambda x: x.astype(jnp.int32), (X * 10,)), (lambda x: x.astype(jnp.float32), (I,)),
                             (lambda x: x.astype(jnp.bool_), (I,)), (lambda x: x.astype(jnp.uint8), (np.array([-1.5, 300.0, np.nan], np.float32),)),
                             (lambda x: x.astype(jnp.float16), (X,))],
    "bitcast_convert_type": [(lambda x: lax.bitcast_convert_type(x, jnp.int32), (X,)),
                             (lambda x: lax.bitcast_convert_type(x, jnp.uint8), (f32(2),)),
                             (lambda x: lax.bitcast_convert_type(x, jnp.float32), (u8(3, 4),))],
    "iota": [(lambda: lax.iota(jnp.int32, 5), ()), (lambda: lax.broadcasted_iota(jnp.float32, (2, 3), 1), ())],
    "broadcast_in_dim": [(lambda x: jnp.broadcast_to(x, (2, 3, 4)), (X,)), (lambda x: x[:, None, :] + jnp.zeros((3, 2, 4)), (X,))],
    "reshape": [(lambda x: x.reshape(4, 3), (X,)), (lambda x: x.reshape(-1), (I,))],
    "squeeze": [(lambda x: jnp.squeeze(x, 0), (f32(1, 3),))],
    "transpose": [(lambda x: x.T, (X,)), (lambda x: jnp.transpose(x, (2, 0, 1)), (f32(2, 3, 4),))],
    "rev": [(lambda x: jnp.flip(x, 0), (X,)), (lambda x: x[::-1, ::-1], (I,))],
    "slice": [(lambda x: x[1:3, ::2], (X,)), (lambda x: x[1], (X,))],
    "dynamic_slice": [(lambda x, i: lax.dynamic_slice(x, (i, 1), (2, 2)), (X, np.int32(1))),
                      (lambda x, i: lax.dynamic_slice(x, (i, 1), (2, 2)), (X, np.int32(5)))],
    "dynamic_update_slice": [(lambda x, u, i: lax.dynamic_update_slice(x, u, (i, 0)), (X, f32(2, 2), np.int32(2)))],
    "stack": [(lambda a, b: jnp.stack([a, b], axis=1), (X, X * 2))],
    "tile": [(lambda x: jnp.tile(x, (2, 3)), (X,))],
    "concatenate": [(lambda a, b: jnp.concatenate([a, b], axis=1), (X, f32(3, 2)))],
    "pad": [(lambda x: jnp.pad(x, ((1, 2), (0, 1))), (X,)),
            (lambda x: lax.pad(x, np.float32(9), ((1, -1, 1), (-1, 2, 2))), (X,))],
    "split": [(lambda x: jnp.split(x, [1, 3], axis=1), (X,))],
    "gather": [(lambda x, i: x[i], (X, np.array([2, 0, 1, 2], np.int32))),
               (lambda x, i: x[:, i], (X, np.array([[3, 0], [1, 1]], np.int32))),
               (lambda x, i: x[i[0], i[1]], (X, np.array([[0, 2], [3, 1]], np.int32))),
               (lambda x, i: jnp.take(x, i, axis=1, mode="fill", fill_value=-1.0), (X, np.array([0, 7, -9, 2], np.int32))),
               (lambda x, i: jnp.take(x, i, axis=0, mode="clip"), (X, np.array([5, -3, 1], np.int32))),
               (lambda x, i: jnp.take_along_axis(x, i, axis=1), (X, i32(3, 2, low=0, high=4)))],
    "scatter": [(lambda x, i: x.at[i].set(0.0), (X, np.array([2, 0], np.int32))),
                (lambda x, i: x.at[:, i].set(jnp.arange(6.0).reshape(3, 2)), (X, np.array([1, 3], np.int32))),
                (lambda x, i: x.at[i].set(5.0, mode="drop"), (X, np.array([1, 9], np.int32)))],
    "scatter-add": [(lambda x, i: x.at[i].add(1.0), (X, np.array([2, 0, 2], np.int32))),
                    (lambda x, i: x.at[i, 1].add(2), (I, np.array([1, 1], np.int32)))],
    "scatter-mul": [(lambda x, i: x.at[i].multiply(3.0), (X, np.array([1, 1], np.int32)))],
    "scatter-min": [(lambda x, i: x.at[i].min(0.0), (X, np.array([0, 2], np.int32)))],
    "scatter-max": [(lambda x, i: x.at[i].max(0.0), (X, np.array([0, 2], np.int32)))],
    "reduce_sum": [(lambda x: x.sum(axis=1), (X,)), (lambda x: x.sum(), (I,)), (lambda x: x.sum(0), (u8(3, 5),))],
    "reduce_prod": [(lambda x: x.prod(axis=0), (X,)), (lambda x: x.prod(), (i32(5, low=1, high=4),))],
    "reduce_max": [(lambda x: x.max(axis=1), (X,)), (lambda x: x.max(), (I,))],
    "reduce_min": [(lambda x: x.min(axis=0), (X,))],
    "reduce_and": [(lambda x: jnp.all(x, axis=1), (B,))],
    "reduce_or": [(lambda x: jnp.any(x, axis=0), (B,))],
    "reduce_xor": [(lambda x: lax.reduce_xor(x, (0,)), (I,)), (lambda x: lax.reduce_xor(x, (1,)), (B,))],
    "argmax": [(lambda x: jnp.argmax(x, axis=1), (X,)), (lambda x: jnp.argmax(x), (I,))],
    "argmin": [(lambda x: jnp.argmin(x, axis=0), (X,))],
    "cumsum": [(lambda x: jnp.cumsum(x, axis=1), (X,)), (lambda x: lax.cumsum(x, axis=0, reverse=True), (I,))],
    "cumprod": [(lambda x: jnp.cumprod(x, axis=0), (X,))],
    "cummax": [(lambda x: lax.cummax(x, axis=1), (X,)), (lambda x: lax.cummax(x, axis=0, reverse=True), (I,))],
    "cummin": [(lambda x: lax.cummin(x, axis=1), (X,))],
    "cumlogsumexp": [(lambda x: lax.cumlogsumexp(x, axis=1), (X,))],
    "reduce_window_sum": [(lambda x: lax.reduce_window(x, 0.0, lax.add, (2, 2), (1, 1), "SAME"), (X,)),
                          (lambda x: lax.reduce_window(x, 0, lax.add, (2, 1), (2, 1), ((1, 0), (0, 1)),
                                                       base_dilation=(2, 1), window_dilation=(1, 1)), (I,))],
    "reduce_window_max": [(lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (2, 2), (1, 2), "VALID"), (X,)),
                          (lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (2, 2), (1, 1), "SAME",
                                                       window_dilation=(1, 2)), (X,))],
    "reduce_window_min": [(lambda x: lax.reduce_window(x, jnp.iinfo(jnp.int32).max, lax.min, (3,), (1,), "SAME"), (I[0],))],
    "select_and_scatter_add": [(jax.grad(lambda x: jnp.sum(lax.reduce_window(x, -jnp.inf, lax.max, (2, 2), (1, 1), "SAME") ** 2)), (f32(4, 5),)),
                               (jax.grad(lambda x: jnp.sum(lax.reduce_window(x, -jnp.inf, lax.max, (2, 2), (2, 2), "VALID"))), (f32(4, 6),))],
    "conv_general_dilated": [
        (lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME"), (f32(2, 3, 6, 5), f32(4, 3, 3, 2))),
        (lambda x, w: lax.conv_general_dilated(x, w, (2, 1), ((1, 0), (2, 1)), lhs_dilation=(1, 2), rhs_dilation=(2, 1),
                                               dimension_numbers=("NHWC", "HWIO", "NHWC")), (f32(2, 7, 5, 3), f32(2, 2, 3, 4))),
        (lambda x, w: lax.conv_general_dilated(x, w, (1,), "VALID", feature_group_count=2), (f32(2, 4, 9), f32(6, 2, 3))),
        (lambda x: jnp.convolve(x[0], x[1], mode="full"), (X,)),
        (jax.grad(lambda w, x: jnp.sum(lax.conv_general_dilated(x, w, (1,), "SAME", feature_group_count=2) ** 2)),
         (f32(4, 1, 3), f32(3, 2, 7))),
        (lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "VALID"), (i32(1, 2, 4, 4, low=-5, high=5), i32(3, 2, 2, 2, low=-3, high=3)))],
    "fft": [(jnp.fft.fft, (X,)), (jnp.fft.ifft, ((X + 1j * POS).astype(np.complex64),)), (jnp.fft.rfft2, (X,)),
            (lambda x: jnp.fft.irfft(x, n=6), ((X + 1j * POS).astype(np.complex64),))],
    "lu": [(lambda x: jax.scipy.linalg.lu_factor(x), (f32(2, 4, 4),)), (lambda x: jnp.linalg.det(x), (X[:3, :3],)),
           (lambda x: jax.scipy.linalg.lu(x), (f32(4, 3),))],
    "lu_pivots_to_permutation": [(lambda p: lax.linalg.lu_pivots_to_permutation(p, 5),
                                  (np.array([[2, 2, 4], [0, 3, 3]], np.int32),))],
    "cholesky": [(lambda x: jnp.linalg.cholesky(x @ x.T + 3 * jnp.eye(3)), (X,)), (jnp.linalg.cholesky, (-np.eye(2, dtype=np.float32),))],
    "triangular_solve": [(lambda a, b: jax.scipy.linalg.solve_triangular(a @ a.T + 3 * jnp.eye(3), b, lower=lower, trans=trans), (X, f32(3, 2)))
                         for lower in (True, False) for trans in (0, 1)]
                        + [(lambda a, b: lax.linalg.triangular_solve(a + 3 * jnp.eye(3), b, left_side=False, lower=True), (f32(3, 3), f32(2, 3)))]
                        + [(lambda a, b: lax.linalg.triangular_solve(a, b, left_side=True, lower=False),  # a zero pivot: inf, NaN
                            (np.array([[1, 2], [0, 0]], np.float32), f32(2, 2)))],
    "svd": [(lambda x: jnp.linalg.svd(x, compute_uv=False), (X,)),
            (lambda x: (lambda u, s, vt: (jnp.abs(u), s, jnp.abs(vt), (u * s) @ vt))(*jnp.linalg.svd(x, full_matrices=False)), (X,))],
    "eigh": [(lambda x: (lambda w, v: (w, jnp.abs(v)))(*jnp.linalg.eigh(x + x.T)), (X[:3, :3] * 2,))],
    "qr": [(lambda x: jnp.linalg.qr(x), (X,)), (lambda x: jnp.linalg.qr(x, mode="complete"), (f32(5, 3),)),
           (lambda x: jax.scipy.linalg.qr(x, pivoting=True), (f32(4, 4),))],
    "custom_linear_solve": [(lambda a, b: jnp.linalg.solve(a + 4 * jnp.eye(3), b), (X[:, :3], f32(3))),
                            (jnp.linalg.inv, (X[:, :3] + 4 * np.eye(3, dtype=np.float32),))],
    "random_seed": [(lambda s: jax.random.key_data(jax.random.key(s)), (np.int32(7),)),
                    (lambda s: jax.random.key_data(jax.vmap(jax.random.key)(s)), (np.arange(3, dtype=np.int32),))],
    "random_split": [(lambda k: jax.random.split(k, 3), (np.array([0, 42], np.uint32),)),
                     (lambda: jax.random.key_data(jax.random.split(jax.random.key(5), (2, 2))), ())],
    "random_bits": [(lambda k: jax.random.bits(k, (5,), jnp.uint8), (np.array([1, 2], np.uint32),)),
                    (lambda k: jax.random.uniform(k, (3, 4)), (np.array([0, 42], np.uint32),)),
                    (lambda: jax.random.normal(jax.random.PRNGKey(0), (7,)), ()),
                    (lambda: jax.random.randint(jax.random.key(3), (6,), 0, 100), ())],
    "random_fold_in": [(lambda k: jax.random.fold_in(k, 17), (np.array([3, 4], np.uint32),))],
    "random_wrap": [(lambda k: jax.random.bernoulli(k, 0.3, (8,)), (np.array([9, 9], np.uint32),))],
    "random_unwrap": [(lambda k: jax.random.split(k), (np.array([9, 9], np.uint32),))],
    "threefry2x32": [(lambda k, c: jax.extend.random.threefry_2x32(k, c), (np.array([1, 2], np.uint32), np.arange(10, dtype=np.uint32)))],
    "iota_2x32_shape": [(lambda k: jax.random.bits(k, (2, 3)), (np.array([1, 2], np.uint32),))],
    "platform_index": [(lambda x: jnp.diag(x), (X[:, :3],)), (jnp.diag, (f32(4),))],
    "dot_general": [(jnp.matmul, (X, f32(4, 5))), (jnp.matmul, (f32(2, 3, 4), f32(2, 4, 5))),
                    (jnp.dot, (I, i32(4, 2))), (lambda a, b: jnp.einsum("ijk,kj->i", a, b), (f32(2, 3, 4), f32(4, 3))),
                    (jnp.vdot, (f32(6), f32(6)))],
    "sort": [(lambda x: lax.sort(x), (np.array([np.nan, -0.0, 1.0, 0.0, -np.nan, -np.inf, -0.0], np.float32),)),
             (lambda x, y: lax.sort((x, y), num_keys=1), (np.array([1, 0, 1, 0, 1], np.int32), np.arange(5.0, dtype=np.float32))),
             (lambda x: jnp.sort(x), (np.array([1 + 2j, 1 - 1j, -3 + 0j, 1 + 2j], np.complex64),)),
             (lambda x: jnp.argsort(x, stable=True), (np.array([2.0, 1.0, 2.0, 1.0, 0.0, 2.0], np.float32),)),(lambda x: jnp.sort(x, axis=1), (X,)), (lambda x: jnp.argsort(x, axis=0), (X,)),
             (lambda x, y: lax.sort((x, y), num_keys=2), (i32(8, low=0, high=3), f32(8)))],
    "top_k": [(lambda x: lax.top_k(x, 2), (f32(3, 5),)), (lambda x: lax.top_k(x, 2, axis=0), (f32(3, 4),)),
              (lambda x: lax.top_k(x, 3), (np.array([1, 3, 3, 0, 3], np.uint8),))],
    "jit": [(lambda x: jax.jit(lambda y: y * 2 + 1)(x), (X,))],
    "custom_jvp_call": [(jax.nn.relu, (X,)), (jax.nn.softplus, (X,))],
    "custom_vjp_call": [],
    "remat2": [(lambda x: jax.checkpoint(lambda y: jnp.sin(y) * y)(x), (X,))],
    "cond": [(lambda x: lax.cond(x.sum() > 0, lambda y: y * 2, lambda y: y - 1, x), (X,)),
             (lambda x, i: lax.switch(i, [lambda y: y, lambda y: -y, lambda y: y * 3], x), (X, np.int32(7)))],
    "while": [(lambda x: lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] * 1.5), (0, x))[1], (X,)),
              (lambda n: lax.fori_loop(0, n, lambda i, acc: acc + i, 0), (np.int32(10),))],
    "scan": [(lambda x: lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(4), x), (X,)),
             (lambda x: lax.scan(lambda c, r: (c * 2, r + c), 1.0, x, reverse=True), (f32(5),)),
             (lambda x: lax.scan(lambda c, r: (c, r), 0.0, x), (np.zeros((0, 3), np.float32),))],
    "debug_callback": [],
    "debug_print": [],
}


@jax.custom_vjp
def _custom_sin(x):
    return jnp.sin(x)


_custom_sin.defvjp(lambda x: (jnp.sin(x), x), lambda res, g: (g * jnp.cos(res),))
CASES["custom_vjp_call"] = [(_custom_sin, (X,))]


def _callback_case(x):
    jax.debug.callback(lambda v: None, x)
    return x + 1


def _print_case(x):
    jax.debug.print("value {}", x.sum())
    return x * 2


CASES["debug_callback"] = [(_callback_case, (X,))]
CASES["debug_print"] = [(_print_case, (X,))]

PARAMS = [pytest.param(fn, args, id=f"{name}-{k}") for name, cases in CASES.items() for k, (fn, args) in enumerate(cases)]


def _primitives_in(jaxpr) -> set[str]:
    """Every primitive the evaluator meets running ``jaxpr``: in sub-graphs, and in JAX's definitions of key ops."""
    found = set()
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive.name)
        for sub in jcore.jaxprs_in_params(eqn.params):
            found |= _primitives_in(sub)
        rule = PHYSICAL_RULES.get(eqn.primitive.name)
        if rule is not None:
            avals = [atom.aval for atom in eqn.invars]
            templates = [js.template(*physical_shape_dtype(aval)) for aval in avals]
            found |= _primitives_in(js.trace(rule(eqn.params, avals), *templates).jaxpr)
    return found


def _assert_same(ours, theirs, atol=2e-6):
    ours_leaves, ours_tree = jax.tree_util.tree_flatten(ours)
    their_leaves, their_tree = jax.tree_util.tree_flatten(theirs)
    assert ours_tree == their_tree
    for mine, ref in zip(ours_leaves, their_leaves):
        ref = np.asarray(ref)
        assert isinstance(mine, np.ndarray)
        assert mine.dtype == ref.dtype, f"dtype {mine.dtype} != XLA's {ref.dtype}"
        assert mine.shape == ref.shape
        if ref.dtype.kind in "fc":
            np.testing.assert_allclose(mine, ref, rtol=2e-5, atol=atol, equal_nan=True)
        else:
            np.testing.assert_array_equal(mine, ref)


@pytest.mark.parametrize(("fn", "args"), PARAMS)
def test_primitive_matches_xla(fn, args):
    ours = js.jit(fn, compiler="evaluator")(*args)
    _assert_same(ours, jax.jit(fn)(*args))


def test_every_table_entry_has_a_case_that_uses_it():
    missing = [name for name in PRIMITIVES if not CASES.get(name)]
    assert not missing, f"table entries without a test case: {missing}"
    unused = []
    for name, cases in CASES.items():
        if not any(name in _primitives_in(jax.make_jaxpr(fn)(*args).jaxpr) for fn, args in cases):
            unused.append(name)
    assert not unused, f"cases that never exercise their primitive: {unused}"


@pytest.mark.parametrize("shape_a,shape_b", [((3, 1), (1, 4)), ((), (2, 3)), ((5,), (2, 5)), ((1, 1), (1,))])
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.int8, np.uint16, np.bool_])
def test_broadcasting_edges_and_dtypes(shape_a, shape_b, dtype):
    a = rng.integers(0, 3, size=shape_a).astype(dtype)
    b = rng.integers(1, 3, size=shape_b).astype(dtype)

    def fn(x, y):
        if dtype == np.bool_:
            return x & y, x | y, x == y
        return x + y, x * y, jnp.maximum(x, y), x == y

    _assert_same(js.jit(fn, compiler="evaluator")(a, b), jax.jit(fn)(a, b))


def test_random_elementwise_chains_match_xla():
    ops = [jnp.sin, jnp.tanh, jnp.abs, lambda v: v * 2 - 1, jnp.exp2, jax.nn.sigmoid, jnp.cumsum]

    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(
        x=hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=5),
                     elements=st.floats(-3, 3, width=32)),
        chain=st.lists(st.integers(0, len(ops) - 1), min_size=1, max_size=5),
    )
    def check(x, chain):
        def fn(v):
            for k in chain:
                v = ops[k](v)
            return v

        # cumsum's summation order differs from XLA's; sin/tanh of the sums amplify float32 rounding
        _assert_same(js.jit(fn, compiler="evaluator")(x), jax.jit(fn)(x), atol=1e-4)

    check()
