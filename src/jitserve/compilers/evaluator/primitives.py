"""The evaluator's table: JAX primitive name -> numpy implementation.

Adding a primitive is one entry in :data:`PRIMITIVES`. Each implementation
takes the node's operands as numpy arrays and, as keywords, every parameter
of the primitive that can change the values it computes; it returns an
array, or a list of arrays for primitives with several results. Results are
computed in the operands' dtype; the interpreter casts them to the exact
dtype JAX inferred. :func:`bind_params` checks, when an interpreter is
built, that an implementation names every parameter the node carries (bar
the few in :data:`VALUE_NEUTRAL_PARAMS`): a parameter nobody handles is a
``NotImplementedError`` naming it, never silently dropped.

Control and call primitives receive their sub-graphs already wrapped as
interpreters (see :data:`SUBGRAPH_PARAMS`), callable as ``run_flat(values)``.
PRNG key primitives get, in the parameter ``physical``, an interpreter of
JAX's own definition of the operation on the keys' uint32 data (see
:data:`PHYSICAL_RULES`), so ``jax.random`` is bit-exact with XLA; the one
primitive those definitions bind, ``threefry2x32``, is implemented here.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import scipy.linalg as sla
import scipy.special as special
from jax import lax
from numpy.lib.stride_tricks import sliding_window_view

from ..semantics import gather_fill, is_float, max_identity, min_identity

Impl = Callable[..., Any]

# Parameters that hold sub-graphs, per primitive; the interpreter replaces them by interpreters.
SUBGRAPH_PARAMS: dict[str, tuple[str, ...]] = {
    "jit": ("jaxpr",),
    "custom_jvp_call": ("call_jaxpr",),
    "custom_vjp_call": ("call_jaxpr",),
    "remat2": ("jaxpr",),
    "cond": ("branches",),
    "while": ("cond_jaxpr", "body_jaxpr"),
    "scan": ("jaxpr",),
    "custom_linear_solve": ("jaxprs",),
    "scatter": ("update_jaxpr",),
}

MULTIPLE_RESULTS = frozenset({*SUBGRAPH_PARAMS, "sort", "split", "top_k", "optimization_barrier", "debug_callback",
                              "debug_print", "threefry2x32", "iota_2x32_shape", "lu", "svd", "eigh",
                              "qr"}) - {"scatter"}

# Parameters that steer placement, precision hints or typing, never the values numpy computes (numpy
# always computes at full precision, on one host device, with the dtype the interpreter casts to).
VALUE_NEUTRAL_PARAMS = frozenset({"sharding", "out_sharding", "precision", "accuracy", "indices_are_sorted",
                                  "unique_indices", "weak_type", "unroll"})


@functools.cache
def _keyword_names(impl: Impl) -> frozenset[str]:
    if isinstance(impl, np.ufunc):
        return frozenset()
    return frozenset(p.name for p in inspect.signature(impl).parameters.values()
                     if p.kind is inspect.Parameter.KEYWORD_ONLY)


def bind_params(primitive: str, impl: Impl, params: dict[str, Any]) -> dict[str, Any]:
    """The parameters to pass ``impl``; one it does not name (and that may change values) is an error."""
    names = _keyword_names(impl)
    for name, value in params.items():
        if name not in names and name not in VALUE_NEUTRAL_PARAMS:
            raise NotImplementedError(
                f"the evaluator's implementation of primitive {primitive!r} does not handle its parameter "
                f"{name!r} (= {value!r}); extend it in jitserve/compilers/evaluator/primitives.py")
    return {name: value for name, value in params.items() if name in names}


def _is_int(x: np.ndarray) -> bool:
    return x.dtype.kind in "iu"


def _div(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    if not _is_int(x):
        return np.divide(x, y)
    safe = np.where(y == 0, 1, y)
    quotient = np.abs(x) // np.abs(safe) * np.where((x < 0) != (safe < 0), -1, 1).astype(x.dtype)
    return np.where(y == 0, -1, quotient).astype(x.dtype)  # XLA: x / 0 == -1 for integers


def _rem(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    if _is_int(x):
        safe = np.where(y == 0, 1, y)
        return np.where(y == 0, x, np.fmod(x, safe))  # XLA: x % 0 == x for integers
    return np.fmod(x, y)


def _pow(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.power(x, y.astype(x.dtype) if _is_int(y) and not _is_int(x) else y)


def _integer_pow(x: np.ndarray, *, y: int) -> np.ndarray:
    if y >= 0:
        return np.power(x, y, dtype=x.dtype)
    return np.reciprocal(np.power(x, -y, dtype=x.dtype))


def _round(x: np.ndarray, *, rounding_method: Any = 0) -> np.ndarray:
    if int(rounding_method) == int(lax.RoundingMethod.TO_NEAREST_EVEN):
        return np.round(x)
    return np.copysign(np.floor(np.abs(x) + x.dtype.type(0.5)), x)


def _zero_kept(fn: Impl) -> Impl:
    """An odd function whose value at -0 is -0 in XLA, where numpy's or scipy's gives +0."""
    return lambda x: np.where(x == 0, x, fn(x))


def _bits(x: np.ndarray) -> int:
    return x.dtype.itemsize * 8


def _unsigned(x: np.ndarray) -> np.ndarray:
    return x.view(np.dtype(f"uint{_bits(x)}"))


def _shift_left(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    in_range = (y >= 0) & (y < _bits(x))
    return np.where(in_range, np.left_shift(x, np.where(in_range, y, 0)), 0).astype(x.dtype)


def _shift_right_logical(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    in_range = (y >= 0) & (y < _bits(x))
    shifted = np.right_shift(_unsigned(x), np.where(in_range, y, 0).astype(_unsigned(x).dtype))
    return np.where(in_range, shifted.view(x.dtype), 0).astype(x.dtype)


def _shift_right_arithmetic(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Fills with the top bit, of unsigned types too (XLA's shift on the signed view); XLA reads the amount
    as unsigned, so a negative one is too large and fills the whole value."""
    bits = _bits(x)
    signed = x.view(np.dtype(f"int{bits}"))
    return np.right_shift(signed, np.where((y < 0) | (y >= bits), bits - 1, y).astype(signed.dtype)).view(x.dtype)


def _clz(x: np.ndarray) -> np.ndarray:
    value = _unsigned(x).astype(np.uint64)
    count = np.zeros(x.shape, np.int64)
    for bit in range(_bits(x) - 1, -1, -1):
        seen = count < (_bits(x) - 1 - bit)
        count = np.where(seen | ((value >> np.uint64(bit)) & np.uint64(1)).astype(bool), count, count + 1)
    return count.astype(x.dtype)


def _logical(fn_bool: Callable[..., Any], fn_int: Callable[..., Any]) -> Impl:
    return lambda *xs: (fn_bool if xs[0].dtype == np.bool_ else fn_int)(*xs)


def _convert(x: np.ndarray, *, new_dtype: Any) -> np.ndarray:
    new_dtype = np.dtype(new_dtype)
    if new_dtype.kind in "iu" and x.dtype.kind == "f":
        return _float_to_int(x, new_dtype)
    if new_dtype == np.bool_:
        return x != 0
    return x.astype(new_dtype)


def _float_to_int(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """XLA's conversion: toward zero, saturating at the integer type's limits, NaN to 0. The limits are
    compared in the float type, where the largest integer usually rounds up to the first value that does not
    fit (2**31 for int32 in float32): clipping to it and casting would wrap to the smallest integer."""
    info = np.iinfo(dtype)
    whole = np.trunc(x)
    with np.errstate(over="ignore"):  # a limit beyond the float type's range is an infinity: still a bound
        high, low = whole >= x.dtype.type(info.max), whole <= x.dtype.type(info.min)
    fits = np.where(high | low | np.isnan(whole), 0, whole).astype(dtype)
    return np.where(high, dtype.type(info.max), np.where(low, dtype.type(info.min), fits))


def _iota(*, dtype: Any, shape: tuple[int, ...], dimension: int) -> np.ndarray:
    axis_shape = [1] * len(shape)
    axis_shape[dimension] = shape[dimension]
    return np.broadcast_to(np.arange(shape[dimension], dtype=dtype).reshape(axis_shape), shape).copy()


def _broadcast_in_dim(x: np.ndarray, *dyn: Any, shape: tuple[int, ...],
                      broadcast_dimensions: tuple[int, ...]) -> np.ndarray:
    expanded = [1] * len(shape)
    for source, target in enumerate(broadcast_dimensions):
        expanded[target] = x.shape[source]
    if x.size == math.prod(shape):  # only unit axes are added: a reshape is enough
        return x.reshape(shape)
    return np.broadcast_to(x.reshape(expanded), shape)


def _reshape(x: np.ndarray, *dyn: Any, new_sizes: tuple[int, ...], dimensions: Any = None) -> np.ndarray:
    if dimensions is not None:
        x = np.transpose(x, dimensions)
    return np.reshape(x, new_sizes)


def _slice(x: np.ndarray, *, start_indices: tuple[int, ...], limit_indices: tuple[int, ...],
           strides: tuple[int, ...] | None = None) -> np.ndarray:
    steps = strides or (1,) * x.ndim
    return x[tuple(slice(s, e, st) for s, e, st in zip(start_indices, limit_indices, steps))]


def _clamped_starts(shape: tuple[int, ...], sizes: tuple[int, ...], starts: tuple[Any, ...]) -> list[int]:
    return [int(np.clip(int(s), 0, dim - size)) for s, dim, size in zip(starts, shape, sizes)]


def _dynamic_slice(x: np.ndarray, *starts: Any, slice_sizes: tuple[int, ...]) -> np.ndarray:
    begin = _clamped_starts(x.shape, slice_sizes, starts)
    return x[tuple(slice(b, b + n) for b, n in zip(begin, slice_sizes))]


def _dynamic_update_slice(x: np.ndarray, update: np.ndarray, *starts: Any) -> np.ndarray:
    begin = _clamped_starts(x.shape, update.shape, starts)
    out = x.copy()
    out[tuple(slice(b, b + n) for b, n in zip(begin, update.shape))] = update
    return out


def _pad(x: np.ndarray, value: np.ndarray, *, padding_config: tuple[tuple[int, int, int], ...]) -> np.ndarray:
    interior_shape = [d + max(d - 1, 0) * interior for d, (_, _, interior) in zip(x.shape, padding_config)]
    inner = np.full(interior_shape, value, x.dtype)
    inner[tuple(slice(None, None, interior + 1) for _, _, interior in padding_config)] = x
    widths = [(max(lo, 0), max(hi, 0)) for lo, hi, _ in padding_config]
    padded = np.pad(inner, widths, constant_values=value)
    crop = tuple(slice(-lo if lo < 0 else 0, padded.shape[i] + hi if hi < 0 else None)
                 for i, (lo, hi, _) in enumerate(padding_config))
    return padded[crop]


def _reduction(ufunc: np.ufunc, keep_dtype: bool = True) -> Impl:
    def reduce(x: np.ndarray, *, axes: tuple[int, ...]) -> Any:
        return ufunc.reduce(x, axis=axes, dtype=x.dtype) if keep_dtype else ufunc.reduce(x, axis=axes)
    return reduce


def _extremum(ufunc: np.ufunc, identity: Callable[[np.dtype], Any]) -> Impl:
    """``reduce_max`` / ``reduce_min``: over no elements XLA gives the identity (-inf for a float max, the
    integer type's least value, ...) where numpy's reduction raises."""
    def reduce(x: np.ndarray, *, axes: tuple[int, ...]) -> Any:
        if x.size == 0:
            return ufunc.reduce(x, axis=axes, initial=identity(x.dtype))
        return ufunc.reduce(x, axis=axes)
    return reduce


def _reduce_xor(x: np.ndarray, *, axes: tuple[int, ...]) -> np.ndarray:
    if x.dtype == np.bool_:
        return np.logical_xor.reduce(x, axis=tuple(axes))
    return np.bitwise_xor.reduce(x, axis=tuple(axes))


def _arg_reduction(fn: Callable[..., Any]) -> Impl:
    def reduce(x: np.ndarray, *, axes: tuple[int, ...], index_dtype: Any) -> np.ndarray:
        return fn(x, axis=axes[0]).astype(index_dtype)
    return reduce


def _cumulative(accumulate: Callable[..., Any]) -> Impl:
    def scan(x: np.ndarray, *, axis: int, reverse: bool = False) -> np.ndarray:
        if reverse:
            return np.flip(accumulate(np.flip(x, axis), axis=axis, dtype=x.dtype), axis)
        return accumulate(x, axis=axis, dtype=x.dtype)
    return scan


def _dot_general(lhs: np.ndarray, rhs: np.ndarray, *, dimension_numbers: Any,
                 preferred_element_type: Any = None) -> np.ndarray:
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    out_dtype = np.dtype(preferred_element_type) if preferred_element_type is not None else lhs.dtype
    lhs_free = [d for d in range(lhs.ndim) if d not in lhs_contract and d not in lhs_batch]
    rhs_free = [d for d in range(rhs.ndim) if d not in rhs_contract and d not in rhs_batch]
    batch_shape = [lhs.shape[d] for d in lhs_batch]
    size = lambda shape, dims: int(np.prod([shape[d] for d in dims], dtype=np.int64))  # noqa: E731
    a = np.transpose(lhs, [*lhs_batch, *lhs_free, *lhs_contract]).reshape(
        size(lhs.shape, lhs_batch), size(lhs.shape, lhs_free), size(lhs.shape, lhs_contract))
    b = np.transpose(rhs, [*rhs_batch, *rhs_contract, *rhs_free]).reshape(
        size(rhs.shape, rhs_batch), size(rhs.shape, rhs_contract), size(rhs.shape, rhs_free))
    compute = out_dtype if out_dtype != np.bool_ else np.int32
    product = np.matmul(a.astype(compute, copy=False), b.astype(compute, copy=False))
    shape = [*batch_shape, *(lhs.shape[d] for d in lhs_free), *(rhs.shape[d] for d in rhs_free)]
    return product.reshape(shape).astype(out_dtype, copy=False)


def _sort(*operands: np.ndarray, dimension: int, num_keys: int, is_stable: bool) -> list[np.ndarray]:
    """Always stable (a stable order is one of the orders an unstable sort may give)."""
    moved = [np.moveaxis(x, dimension, -1) for x in operands]
    keys = moved[:num_keys]
    ranks = [rank for key in keys for rank in _sort_ranks(key)]
    order = (np.argsort(ranks[0], axis=-1, kind="stable") if len(ranks) == 1
             else np.lexsort(ranks[::-1], axis=-1))
    return [np.moveaxis(np.take_along_axis(x, order, axis=-1), -1, dimension) for x in moved]


def _top_k(x: np.ndarray, *, k: int, axis: int) -> list[np.ndarray]:
    """The k largest along ``axis`` in IEEE total order (-NaN lowest, -0 below +0, NaN highest), largest first;
    equal values in index order (as XLA's TopK, which unlike sort tells the zeros and NaNs apart)."""
    moved = np.moveaxis(x, axis, -1)
    n = moved.shape[-1]
    ascending = np.argsort(np.flip(_total_order(moved), -1), axis=-1, kind="stable")
    order = (n - 1 - np.flip(ascending, -1))[..., :k]
    values = np.take_along_axis(moved, order, axis=-1)
    return [np.moveaxis(values, -1, axis), np.moveaxis(order.astype(np.int32), -1, axis)]


def _split(x: np.ndarray, *, sizes: tuple[int, ...], axis: int) -> list[np.ndarray]:
    return np.split(x, np.cumsum(sizes)[:-1], axis=axis)


def _select_n(which: np.ndarray, *cases: np.ndarray) -> np.ndarray:
    if len(cases) == 1:
        return cases[0]
    if which.dtype == np.bool_:
        return np.where(which, cases[1], cases[0])
    return np.choose(which, cases)


def _clamp(low: np.ndarray, x: np.ndarray, high: np.ndarray) -> np.ndarray:
    return np.minimum(np.maximum(x, low), high)


def _window_starts(operand_shape: tuple[int, ...], indices: np.ndarray, index_map: tuple[int, ...],
                   batching: tuple[tuple[int, int], ...], sizes: tuple[int, ...], clip: bool
                   ) -> tuple[list[np.ndarray | int], np.ndarray]:
    """Per operand axis, the start of each window (over the index batch), and which windows are in bounds."""
    batch_shape = indices.shape[:-1]
    starts: list[np.ndarray | int] = [0] * len(operand_shape)
    in_bounds = np.ones(batch_shape, bool)
    for k, axis in enumerate(index_map):
        start = indices[..., k].astype(np.int64)
        limit = operand_shape[axis] - sizes[axis]
        in_bounds &= (start >= 0) & (start <= limit)
        starts[axis] = np.clip(start, 0, limit) if clip else start
    for operand_axis, index_axis in batching:
        shape = [1] * len(batch_shape)
        shape[index_axis] = batch_shape[index_axis]
        starts[operand_axis] = np.arange(batch_shape[index_axis]).reshape(shape)
    return starts, in_bounds


def _window_index(starts: list[np.ndarray | int], window_axes: list[int], window_shape: list[int],
                  batch_rank: int) -> tuple[np.ndarray, ...]:
    """Advanced-index arrays shaped (batch..., window...) addressing every element of every window."""
    index = []
    window_rank = len(window_axes)
    for axis, start in enumerate(starts):
        start = np.asarray(start).reshape(np.shape(start) + (1,) * window_rank)
        if axis in window_axes:
            position = window_axes.index(axis)
            shape = [1] * (batch_rank + window_rank)
            shape[batch_rank + position] = window_shape[position]
            start = start + np.arange(window_shape[position]).reshape(shape)
        index.append(start)
    return tuple(np.broadcast_arrays(*index))


def _gather(operand: np.ndarray, indices: np.ndarray, *, dimension_numbers: Any, slice_sizes: tuple[int, ...],
            mode: Any, fill_value: Any = None) -> np.ndarray:
    dn = dimension_numbers
    fill = "FILL" in str(mode)
    batching = tuple(zip(dn.operand_batching_dims, dn.start_indices_batching_dims))
    starts, in_bounds = _window_starts(operand.shape, indices, dn.start_index_map, batching, slice_sizes, clip=True)
    window_axes = [d for d in range(operand.ndim) if d not in dn.collapsed_slice_dims
                   and d not in dn.operand_batching_dims]
    window_shape = [slice_sizes[d] for d in window_axes]
    batch_rank = indices.ndim - 1
    gathered = operand[_window_index(starts, window_axes, window_shape, batch_rank)]
    if fill:
        mask = in_bounds.reshape(in_bounds.shape + (1,) * len(window_axes))
        gathered = np.where(mask, gathered, np.asarray(gather_fill(operand.dtype, fill_value), operand.dtype))
    # (batch..., window...) -> window axes at offset_dims, batch axes in the remaining positions
    out_rank = batch_rank + len(window_axes)
    batch_positions = [p for p in range(out_rank) if p not in dn.offset_dims]
    order = [0] * out_rank
    for source, target in enumerate(batch_positions + list(dn.offset_dims)):
        order[target] = source
    return np.transpose(gathered, order)


def _scatter_with(combine: Callable[..., Any] | None) -> Impl:
    """A scatter combining with ``combine`` (add, mul, ... its ``update_jaxpr`` says the same), or for ``scatter``
    itself: replacing, or applying its ``update_jaxpr`` (``x.at[i].apply(f)``) when it has one."""
    def scatter(operand: np.ndarray, indices: np.ndarray, updates: np.ndarray, *, dimension_numbers: Any,
                mode: Any, update_jaxpr: Any, update_consts: Any) -> np.ndarray:
        dn = dimension_numbers
        window_axes = [d for d in range(operand.ndim) if d not in dn.inserted_window_dims
                       and d not in dn.operand_batching_dims]
        scatter_axes = [d for d in range(updates.ndim) if d not in dn.update_window_dims]
        updates = np.transpose(updates, [*scatter_axes, *dn.update_window_dims])
        window_shape = list(updates.shape[len(scatter_axes):])
        sizes = [1] * operand.ndim
        for axis, size in zip(window_axes, window_shape):
            sizes[axis] = size
        batching = tuple(zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims))
        clip = "CLIP" in str(mode)
        starts, in_bounds = _window_starts(operand.shape, indices, dn.scatter_dims_to_operand_dims, batching,
                                           tuple(sizes), clip=clip)
        index = _window_index(starts, window_axes, window_shape, len(scatter_axes))
        if clip:  # every window lands, moved inside the operand
            keep = np.ones(updates.shape, bool)
        else:  # a window that does not fit is dropped whole
            keep = np.broadcast_to(in_bounds.reshape(in_bounds.shape + (1,) * len(window_shape)), updates.shape)
        out = operand.copy()
        chosen = tuple(i[keep] for i in index)
        if combine is None and update_jaxpr is None:
            out[chosen] = updates[keep]
        elif combine is None:  # the update function is scalar: element by element, in order, as XLA combines
            for position, update in zip(zip(*chosen), updates[keep]):
                out[position] = update_jaxpr.run_flat([out[position], update])[0]
        else:
            combine(out, chosen, updates[keep])
        return out
    return scatter


def _total_order(x: np.ndarray) -> np.ndarray:
    """Integer keys ordering floats totally as XLA does: -NaN < -inf < ... < -0 < +0 < ... < inf < NaN."""
    if not is_float(x.dtype):
        return x
    signed = np.ascontiguousarray(x).view(np.dtype(f"int{_bits(x)}")).reshape(np.shape(x))  # 0-d stays 0-d
    magnitude = np.array(np.iinfo(signed.dtype).max, signed.dtype)
    return np.where(signed < 0, signed ^ magnitude, signed)


def _sort_ranks(key: np.ndarray) -> list[np.ndarray]:
    """What ``lax.sort`` compares: the total order with -0.0 == 0.0 and every NaN alike; complex as (real, imag)."""
    if key.dtype.kind == "c":
        return [*_sort_ranks(key.real), *_sort_ranks(key.imag)]
    if is_float(key.dtype):
        key = np.where(np.isnan(key), np.array(np.nan, key.dtype), np.where(key == 0, np.zeros((), key.dtype), key))
    return [_total_order(key)]


def _total_order_compare(compare: np.ufunc) -> Impl:
    return lambda x, y: compare(_total_order(x), _total_order(y))


def _mul(x: np.ndarray, y: np.ndarray, *, out_dtype: Any = None) -> np.ndarray:
    if out_dtype is None:
        return np.multiply(x, y)
    return np.multiply(x.astype(out_dtype), y.astype(out_dtype))


def _bitcast_convert_type(x: np.ndarray, *, new_dtype: Any) -> np.ndarray:
    """As XLA: to a narrower type adds a last axis of the size ratio; to a wider one consumes it."""
    new_dtype = np.dtype(new_dtype)
    x = np.ascontiguousarray(x)
    if new_dtype.itemsize < x.dtype.itemsize:
        return x[..., None].view(new_dtype)
    if new_dtype.itemsize > x.dtype.itemsize:
        return x.view(new_dtype)[..., 0]
    return x.view(new_dtype)


def _reduce_precision(x: np.ndarray, *, exponent_bits: int, mantissa_bits: int) -> np.ndarray:
    """Round to ``mantissa_bits`` (to nearest even) and saturate to ``exponent_bits``, as XLA does, in integer bits."""
    info = jax.numpy.finfo(x.dtype)
    source_mantissa, source_exponent, bits = int(info.nmant), int(info.nexp), _bits(x)
    unsigned = np.dtype(f"uint{bits}").type
    value = np.ascontiguousarray(x).view(unsigned)
    one = unsigned(1)
    if mantissa_bits < source_mantissa:
        shift = unsigned(source_mantissa - mantissa_bits)
        last_bit_mask = one << shift
        bias = (last_bit_mask >> one) - one
        rounding = ((value & last_bit_mask) >> shift) + bias
        value = (value + rounding) & ~(last_bit_mask - one)
    if exponent_bits < source_exponent:
        sign_mask = one << unsigned(bits - 1)
        exponent_mask = ((one << unsigned(source_exponent)) - one) << unsigned(source_mantissa)
        exponent_bias = (1 << (source_exponent - 1)) - 1
        reduced_bias = (1 << (exponent_bits - 1)) - 1
        exponent = value & exponent_mask
        overflows = exponent > unsigned((exponent_bias + reduced_bias) << source_mantissa)
        underflows = exponent <= unsigned((exponent_bias - reduced_bias) << source_mantissa)
        signed_zero = value & sign_mask
        value = np.where(overflows, signed_zero | exponent_mask, np.where(underflows, signed_zero, value))
    result = np.asarray(value, unsigned).view(x.dtype)
    return np.where(np.isnan(x), x, result) if mantissa_bits < source_mantissa else result


def _windows(x: np.ndarray, fill: Any, window_dimensions: tuple[int, ...], window_strides: tuple[int, ...],
             padding: tuple[tuple[int, int], ...], base_dilation: tuple[int, ...], window_dilation: tuple[int, ...]
             ) -> np.ndarray:
    """Every window of ``x`` (dilated, padded with ``fill``) as a view shaped (out..., window...)."""
    config = tuple((lo, hi, d - 1) for (lo, hi), d in zip(padding, base_dilation))
    padded = _pad(x, np.asarray(fill, x.dtype), padding_config=config)
    extent = tuple((w - 1) * d + 1 for w, d in zip(window_dimensions, window_dilation))
    if any(size < span for size, span in zip(padded.shape, extent)):  # no window fits along some axis
        out = tuple(max(0, (size - span) // stride + 1)
                    for size, span, stride in zip(padded.shape, extent, window_strides))
        return np.empty(out + tuple(window_dimensions), x.dtype)
    view = sliding_window_view(padded, extent)
    strided = tuple(slice(None, None, s) for s in window_strides)
    return view[strided + tuple(slice(None, None, d) for d in window_dilation)]


def _reduce_window(reduce: Callable[..., Any], identity: Callable[[np.dtype], Any]) -> Impl:
    def impl(x: np.ndarray, *, window_dimensions: tuple[int, ...], window_strides: tuple[int, ...],
             padding: tuple[tuple[int, int], ...], base_dilation: tuple[int, ...], window_dilation: tuple[int, ...]
             ) -> np.ndarray:
        view = _windows(x, identity(x.dtype), window_dimensions, window_strides, padding, base_dilation,
                        window_dilation)
        return reduce(view, axis=tuple(range(x.ndim, 2 * x.ndim)))
    return impl


def _select_and_scatter_add(source: np.ndarray, operand: np.ndarray, *, select_prim: Any,
                            window_dimensions: tuple[int, ...], window_strides: tuple[int, ...],
                            padding: tuple[tuple[int, int], ...]) -> np.ndarray:
    """The gradient of a max (or min) pool: each window's source value goes to the element it selects. As
    XLA does, a window is scanned in order and its current choice kept while ``choice >= candidate`` (``<=``
    for min): the first of equal values wins, and a NaN is chosen only where nothing follows it."""
    pick_max = select_prim is lax.ge_p
    if not pick_max and select_prim is not lax.le_p:
        raise NotImplementedError(f"select_and_scatter_add with select_prim {select_prim}")
    fill = max_identity(operand.dtype) if pick_max else min_identity(operand.dtype)
    keep = np.greater_equal if pick_max else np.less_equal
    ones = (1,) * operand.ndim
    view = _windows(operand, fill, window_dimensions, window_strides, padding, ones, ones)
    out_shape = view.shape[:operand.ndim]
    flat = view.reshape(*out_shape, math.prod(window_dimensions))
    best, chosen = flat[..., 0], np.zeros(out_shape, np.intp)
    for number in range(1, flat.shape[-1]):
        switch = ~keep(best, flat[..., number])
        best = np.where(switch, flat[..., number], best)
        chosen[switch] = number
    offsets = np.unravel_index(chosen, window_dimensions)
    positions = tuple(np.arange(n).reshape([-1 if a == axis else 1 for a in range(len(out_shape))]) * s + o
                      for axis, (n, s, o) in enumerate(zip(out_shape, window_strides, offsets)))
    padded_shape = tuple(d + lo + hi for d, (lo, hi) in zip(operand.shape, padding))
    out = np.zeros(padded_shape, source.dtype)
    np.add.at(out, tuple(np.broadcast_arrays(*positions)), source)
    return out[tuple(slice(lo, lo + d) for d, (lo, _) in zip(operand.shape, padding))]


def _accumulator(dtype: np.dtype) -> np.dtype:
    """Where numpy should sum products of ``dtype``: float32 for narrower floats, int64 for integers."""
    if is_float(dtype):
        return np.dtype(np.float32) if dtype.itemsize < 4 else dtype
    if dtype.kind in "iub":
        return np.dtype(np.int64) if dtype.kind != "u" else np.dtype(np.uint64)
    return dtype


def _conv_general_dilated(lhs: np.ndarray, rhs: np.ndarray, *, window_strides: tuple[int, ...],
                          padding: tuple[tuple[int, int], ...], lhs_dilation: tuple[int, ...],
                          rhs_dilation: tuple[int, ...], dimension_numbers: Any, feature_group_count: int,
                          batch_group_count: int, preferred_element_type: Any) -> np.ndarray:
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    out_dtype = np.dtype(preferred_element_type) if preferred_element_type is not None else lhs.dtype
    compute = _accumulator(np.result_type(lhs.dtype, out_dtype) if is_float(out_dtype) else lhs.dtype)
    x = np.transpose(lhs, lhs_spec).astype(compute)   # (N, C, spatial...)
    w = np.transpose(rhs, rhs_spec).astype(compute)   # (O, I, kernel...)
    spatial = x.ndim - 2
    view = _windows(x, 0, (1, 1, *w.shape[2:]), (1, 1, *window_strides), ((0, 0), (0, 0), *padding),
                    (1, 1, *lhs_dilation), (1, 1, *rhs_dilation))
    # view: (N, C, out spatial..., 1, 1, kernel...) -> contract C and kernel with w's I and kernel
    view = view.reshape(*view.shape[:x.ndim], *view.shape[x.ndim + 2:])
    contract = ([1, *range(x.ndim, x.ndim + spatial)], [1, *range(2, 2 + spatial)])

    def convolve(v: np.ndarray, k: np.ndarray) -> np.ndarray:
        return np.moveaxis(np.tensordot(v, k, axes=contract), -1, 1)

    if batch_group_count > 1:
        n, o = x.shape[0] // batch_group_count, w.shape[0] // batch_group_count
        parts = [convolve(view[g * n:(g + 1) * n], w[g * o:(g + 1) * o]) for g in range(batch_group_count)]
    else:
        c, o = w.shape[1], w.shape[0] // feature_group_count
        parts = [convolve(view[:, g * c:(g + 1) * c], w[g * o:(g + 1) * o]) for g in range(feature_group_count)]
    out = np.concatenate(parts, axis=1)   # (N, O, out spatial...)
    return np.transpose(out, np.argsort(out_spec)).astype(out_dtype)


FFT_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "FFT": np.fft.fftn, "IFFT": np.fft.ifftn, "RFFT": np.fft.rfftn, "IRFFT": np.fft.irfftn,
}


def _fft(x: np.ndarray, *, fft_type: Any, fft_lengths: tuple[int, ...]) -> np.ndarray:
    if x.size == 0:  # numpy refuses a transform of no points; XLA's result is as empty
        result = jax.eval_shape(functools.partial(lax.fft, fft_type=fft_type, fft_lengths=fft_lengths), x)
        return np.zeros(result.shape, result.dtype)
    axes = tuple(range(x.ndim - len(fft_lengths), x.ndim))
    return FFT_FUNCTIONS[lax.FftType(fft_type).name](x, s=fft_lengths, axes=axes)


def _lapack_dtype(x: np.ndarray) -> np.ndarray:
    """LAPACK has no half precision: those go through float32 (the interpreter casts the results back)."""
    return x.astype(np.float32) if is_float(x.dtype) and x.dtype.itemsize < 4 else x


def _per_matrix(x: np.ndarray) -> Any:
    return np.ndindex(*x.shape[:-2])


def _lu(x: np.ndarray) -> list[np.ndarray]:
    x = _lapack_dtype(x)
    *batch, m, n = x.shape
    lu = np.empty_like(x)
    pivots = np.empty((*batch, min(m, n)), np.int32)
    for index in _per_matrix(x):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sla.LinAlgWarning)  # singular: XLA returns the factors as they are
            lu[index], pivots[index] = sla.lu_factor(x[index], check_finite=False)
    return [lu, pivots, _lu_pivots_to_permutation(pivots, permutation_size=m)]


def _lu_pivots_to_permutation(pivots: np.ndarray, *, permutation_size: int) -> np.ndarray:
    """The row order that LAPACK's swaps (row i with row pivots[i], in turn) make of 0, 1, ..."""
    permutation = np.empty((*pivots.shape[:-1], permutation_size), np.int32)
    for index in np.ndindex(*pivots.shape[:-1]):
        order = np.arange(permutation_size, dtype=np.int32)
        for row, pivot in enumerate(pivots[index]):
            order[[row, pivot]] = order[[pivot, row]]
        permutation[index] = order
    return permutation


def _cholesky(x: np.ndarray, *, symmetrize_input: bool = False) -> np.ndarray:
    """Lower factor; a matrix that is not positive definite gives NaNs, as with XLA."""
    x = _lapack_dtype(x)
    if symmetrize_input:
        x = (x + np.conj(np.swapaxes(x, -1, -2))) / 2
    out = np.empty_like(x)
    for index in _per_matrix(x):
        try:
            out[index] = np.linalg.cholesky(x[index])
        except np.linalg.LinAlgError:
            out[index] = np.nan
    return out


def _triangular_solve(a: np.ndarray, b: np.ndarray, *, left_side: bool, lower: bool, transpose_a: bool,
                      conjugate_a: bool, unit_diagonal: bool) -> np.ndarray:
    """Solve op(a) x = b (``left_side``) or x op(a) = b by BLAS's trsm, which as XLA divides by a zero on the
    diagonal (inf and NaN) where scipy's ``solve_triangular`` raises."""
    a, b = _lapack_dtype(a), _lapack_dtype(b)
    dtype = np.result_type(a, b)
    out = np.empty(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + b.shape[-2:], dtype)
    if conjugate_a and not transpose_a:
        a = np.conj(a)
    trsm = sla.blas.get_blas_funcs("trsm", dtype=dtype)
    for index in np.ndindex(*out.shape[:-2]):
        matrix = a[index[len(index) - (a.ndim - 2):]] if a.ndim > 2 else a
        rhs = b[index[len(index) - (b.ndim - 2):]] if b.ndim > 2 else b
        out[index] = trsm(1.0, matrix, rhs.astype(dtype), side=0 if left_side else 1, lower=int(lower),
                          trans_a=(2 if conjugate_a else 1) if transpose_a else 0, diag=int(unit_diagonal))
    return out


def _no_subset(primitive: str, subset_by_index: Any, size: int) -> None:
    if subset_by_index is not None and tuple(subset_by_index) != (0, size):
        raise NotImplementedError(f"{primitive} with subset_by_index={subset_by_index}")


def _svd(x: np.ndarray, *, full_matrices: bool, compute_uv: bool, subset_by_index: Any, algorithm: Any
         ) -> list[np.ndarray]:
    """Singular values (descending), then u and vt when asked: the results of XLA's svd, in its order."""
    _no_subset("svd", subset_by_index, min(x.shape[-2:]))
    x = _lapack_dtype(x)
    if not compute_uv:
        return [np.linalg.svd(x, compute_uv=False)]
    u, s, vt = np.linalg.svd(x, full_matrices=full_matrices)
    return [s, u, vt]


def _eigh(x: np.ndarray, *, lower: bool, sort_eigenvalues: bool, subset_by_index: Any, algorithm: Any
          ) -> list[np.ndarray]:
    """Eigenvectors, then eigenvalues (ascending either way: LAPACK sorts them)."""
    _no_subset("eigh", subset_by_index, x.shape[-1])
    values, vectors = np.linalg.eigh(_lapack_dtype(x), UPLO="L" if lower else "U")
    return [vectors, values]


def _qr(x: np.ndarray, *, full_matrices: bool, pivoting: bool, use_magma: Any) -> list[np.ndarray]:
    x = _lapack_dtype(x)
    mode = "full" if full_matrices else "economic"
    if not pivoting:
        q, r = np.linalg.qr(x, mode="complete" if full_matrices else "reduced")
        return [q, r]
    results = [sla.qr(x[index], mode=mode, pivoting=True) for index in _per_matrix(x)]
    batch = x.shape[:-2]
    return [np.stack([part[k] for part in results]).reshape(*batch, *results[0][k].shape) if results
            else np.empty((*batch, 0, 0), x.dtype) for k in range(3)]


def _custom_linear_solve(*operands: Any, const_lengths: Any, jaxprs: tuple[Any, ...]) -> list[Any]:
    """The solve function applied to the right-hand side (the other functions serve differentiation)."""
    ends = np.cumsum([0, *const_lengths])
    solve_consts = operands[ends[2]:ends[3]]
    return jaxprs[2].run_flat([*solve_consts, *operands[ends[-1]:]])


def _threefry2x32(key1: np.ndarray, key2: np.ndarray, x1: np.ndarray, x2: np.ndarray) -> list[np.ndarray]:
    """The Threefry-2x32 hash (20 rounds), as JAX's own lowering of this primitive computes it."""
    k1, k2, c1, c2 = np.broadcast_arrays(*(np.asarray(v, np.uint32) for v in (key1, key2, x1, x2)))
    keys = [k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA)]
    x = [c1 + keys[0], c2 + keys[1]]
    rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
    for group in range(5):
        for r in rotations[group % 2]:
            x[0] = x[0] + x[1]
            x[1] = (x[1] << np.uint32(r)) | (x[1] >> np.uint32(32 - r))
            x[1] = x[0] ^ x[1]
        x[0] = x[0] + keys[(group + 1) % 3]
        x[1] = x[1] + keys[(group + 2) % 3] + np.uint32(group + 1)
    return x


def physical_shape_dtype(aval: Any) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype of a value as the evaluator holds it: a PRNG key is its uint32 data."""
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
        return (*aval.shape, *_key_implementation(aval).key_shape), np.dtype(np.uint32)
    return tuple(aval.shape), np.dtype(aval.dtype)


def _iota_2x32_shape(*, shape: tuple[int, ...]) -> list[np.ndarray]:
    """The row-major position of each element as a uint64 split into high and low uint32 halves."""
    counts = np.arange(math.prod(shape), dtype=np.uint64).reshape(shape)
    return [(counts >> np.uint64(32)).astype(np.uint32), counts.astype(np.uint32)]


def _key_implementation(aval: Any) -> Any:
    """The PRNG implementation of a key-typed value (JAX keeps it on the key dtype, as ``_impl``)."""
    return aval.dtype._impl


def _keywise(fn: Callable[..., Any], rank: int, in_axes: Any = 0) -> Callable[..., Any]:
    """``fn`` of one key (or seed) mapped over ``rank`` leading axes."""
    for _ in range(rank):
        fn = jax.vmap(fn, in_axes=in_axes)
    return fn


def _fold_in_rule(params: dict[str, Any], avals: list[Any]) -> Callable[..., Any]:
    keys, messages = avals
    fold_in = _key_implementation(keys).fold_in
    if messages.shape == ():
        return _keywise(fold_in, len(keys.shape), (0, None))
    if messages.shape != keys.shape:
        raise NotImplementedError(f"random_fold_in of keys {keys.shape} with messages {messages.shape}")
    return _keywise(fold_in, len(keys.shape))


# PRNG key primitives -> (params, operand avals) -> JAX's definition of the primitive on the keys' uint32 data.
PHYSICAL_RULES: dict[str, Callable[[dict[str, Any], list[Any]], Callable[..., Any]]] = {
    "random_seed": lambda params, avals: _keywise(params["impl"].seed, len(avals[0].shape)),
    "random_split": lambda params, avals: _keywise(
        lambda key: _key_implementation(avals[0]).split(key, params["shape"]), len(avals[0].shape)),
    "random_bits": lambda params, avals: _keywise(
        lambda key: _key_implementation(avals[0]).random_bits(key, params["bit_width"], params["shape"]),
        len(avals[0].shape)),
    "random_fold_in": _fold_in_rule,
}


def _random_seed(seeds: np.ndarray, *, impl: Any, physical: Any) -> np.ndarray:
    return physical.run_flat([seeds])[0]


def _random_split(keys: np.ndarray, *, shape: tuple[int, ...], physical: Any) -> np.ndarray:
    return physical.run_flat([keys])[0]


def _random_bits(keys: np.ndarray, *, bit_width: int, shape: tuple[int, ...], physical: Any) -> np.ndarray:
    return physical.run_flat([keys])[0]


def _random_fold_in(keys: np.ndarray, messages: np.ndarray, *, physical: Any) -> np.ndarray:
    return physical.run_flat([keys, messages])[0]


def _random_wrap(data: np.ndarray, *, impl: Any) -> np.ndarray:
    """Keys are their uint32 data in the evaluator: wrapping and unwrapping change nothing."""
    return data


def _platform_index(*, platforms: tuple[Any, ...]) -> np.ndarray:
    """The branch for the platform numpy stands for, the CPU (else the default branch)."""
    for position, names in enumerate(platforms):
        if names is not None and "cpu" in names:
            return np.asarray(position, np.int32)
    for position, names in enumerate(platforms):
        if names is None:
            return np.asarray(position, np.int32)
    raise NotImplementedError(f"no branch for platform 'cpu' among {platforms}")


def _jit(*operands: Any, jaxpr: Any, name: str, inline: bool, keep_unused: bool, donated_invars: Any,
         in_shardings: Any, out_shardings: Any, in_layouts: Any, out_layouts: Any, ctx_mesh: Any,
         compiler_options_kvs: Any) -> list[Any]:
    """A nested jit: its body (the rest is placement and compiler bookkeeping)."""
    return jaxpr.run_flat(list(operands))


def _custom_jvp_call(*operands: Any, call_jaxpr: Any, jvp_jaxpr_fun: Any, num_consts: int,
                     symbolic_zeros: bool) -> list[Any]:
    """The primal function; the custom derivative rule matters only to ``jax.grad`` at trace time."""
    return call_jaxpr.run_flat(list(operands))


def _custom_vjp_call(*operands: Any, call_jaxpr: Any, fwd_jaxpr_thunk: Any, bwd: Any, num_consts: int,
                     out_trees: Any, symbolic_zeros: bool) -> list[Any]:
    return call_jaxpr.run_flat(list(operands))


def _remat(*operands: Any, jaxpr: Any, prevent_cse: bool, differentiated: bool, policy: Any) -> list[Any]:
    """``jax.checkpoint``: rematerialisation is a memory policy for gradients; the values are the body's."""
    return jaxpr.run_flat(list(operands))


def _cond(index: np.ndarray, *operands: Any, branches: tuple[Any, ...], branches_platforms: Any = None) -> list[Any]:
    branch = branches[int(np.clip(int(index), 0, len(branches) - 1))]
    return branch.run_flat(list(operands))


def _while(*operands: Any, cond_jaxpr: Any, body_jaxpr: Any, cond_nconsts: int, body_nconsts: int) -> list[Any]:
    cond_consts = list(operands[:cond_nconsts])
    body_consts = list(operands[cond_nconsts:cond_nconsts + body_nconsts])
    carry = list(operands[cond_nconsts + body_nconsts:])
    while bool(cond_jaxpr.run_flat([*cond_consts, *carry])[0]):
        carry = body_jaxpr.run_flat([*body_consts, *carry])
    return carry


def _scan(*operands: Any, jaxpr: Any, num_consts: int, num_carry: int, length: int, reverse: bool) -> list[Any]:
    consts = list(operands[:num_consts])
    carry = list(operands[num_consts:num_consts + num_carry])
    xs = operands[num_consts + num_carry:]
    steps = range(length - 1, -1, -1) if reverse else range(length)
    ys: list[list[Any]] = []
    for step in steps:
        out = jaxpr.run_flat([*consts, *carry, *(x[step] for x in xs)])
        carry, y = out[:num_carry], out[num_carry:]
        ys.append(y)
    if reverse:
        ys.reverse()
    stacked = []
    for k, template in enumerate(jaxpr.output_templates[num_carry:]):
        stacked.append(np.stack([y[k] for y in ys]) if ys else np.empty((0, *template.shape), template.dtype))
    return [*carry, *stacked]


def _debug_callback(*operands: Any, callback: Callable[..., Any], effect: Any, partitioned: bool) -> list[Any]:
    callback(*operands)
    return []


def _debug_print(*operands: Any, fmt: str, in_tree: Any, static_args: Any, has_placeholders: bool, ordered: bool,
                 partitioned: bool, np_printoptions: Any, logging_record: Any) -> list[Any]:
    """``jax.debug.print`` formatted as JAX formats it on the host (``ordered``: the evaluator runs in order)."""
    flat = list(operands)
    for position, value in sorted(dict(static_args).items()):
        flat.insert(position, value)
    args, kwargs = jax.tree_util.tree_unflatten(in_tree, flat)
    if has_placeholders:
        with np.printoptions(**dict(np_printoptions)):
            message = fmt.format(*args, **kwargs)
    else:
        message = " ".join((fmt, *(str(a) for a in args)))
    if logging_record:
        record = copy.copy(logging_record)
        record.msg = message
        logging.getLogger("jax._src.debugging").handle(record)
    else:
        print(message)
    return []


PRIMITIVES: dict[str, Impl] = {
    # elementwise, one operand
    "neg": np.negative,
    "sign": _zero_kept(np.sign),
    "floor": np.floor,
    "ceil": np.ceil,
    "round": _round,
    "is_finite": np.isfinite,
    "exp": np.exp,
    "exp2": np.exp2,
    "log": np.log,
    "log1p": np.log1p,
    "expm1": np.expm1,
    "tanh": np.tanh,
    "logistic": special.expit,
    "sin": np.sin,
    "cos": np.cos,
    "tan": np.tan,
    "asin": np.arcsin,
    "acos": np.arccos,
    "atan": np.arctan,
    "sinh": np.sinh,
    "cosh": np.cosh,
    "asinh": np.arcsinh,
    "acosh": np.arccosh,
    "atanh": np.arctanh,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: np.reciprocal(np.sqrt(x)),
    "cbrt": np.cbrt,
    "abs": np.abs,
    "square": np.square,
    "not": _logical(np.logical_not, np.invert),
    "erf": special.erf,
    "erfc": special.erfc,
    "erf_inv": _zero_kept(special.erfinv),
    "lgamma": lambda x: np.where(x == -np.inf, np.inf, special.gammaln(x)),  # XLA: lgamma(-inf) = inf
    "digamma": lambda x: np.where(x == 0, np.nan, special.digamma(x)),  # XLA: NaN at the pole 0 (scipy: -+inf)
    "igamma": special.gammainc,
    "igammac": special.gammaincc,
    "bessel_i0e": special.i0e,
    "bessel_i1e": special.i1e,
    "polygamma": lambda m, x: special.polygamma(m.astype(np.int64), x),
    "zeta": special.zeta,
    "regularized_incomplete_beta": special.betainc,
    "integer_pow": _integer_pow,
    "real": np.real,
    "imag": np.imag,
    "conj": lambda x, *, input_dtype: np.conj(x),
    "population_count": lambda x: np.bitwise_count(_unsigned(x)).astype(x.dtype),
    "clz": _clz,
    "copy": np.copy,
    "reduce_precision": _reduce_precision,
    "stop_gradient": lambda x: x,
    "optimization_barrier": lambda *xs: list(xs),
    # elementwise, two operands
    "add": np.add,
    "sub": np.subtract,
    "mul": _mul,
    "add_any": np.add,
    "div": _div,
    "rem": _rem,
    "pow": _pow,
    "max": np.maximum,  # XLA orders -0 below +0; numpy keeps its second operand of a tie (see docs/compilers.md)
    "min": np.minimum,
    "atan2": np.arctan2,
    "nextafter": np.nextafter,
    "complex": lambda x, y: x + 1j * y,
    "and": _logical(np.logical_and, np.bitwise_and),
    "or": _logical(np.logical_or, np.bitwise_or),
    "xor": _logical(np.logical_xor, np.bitwise_xor),
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "lt_to": _total_order_compare(np.less),
    "le_to": _total_order_compare(np.less_equal),
    "shift_left": _shift_left,
    "shift_right_logical": _shift_right_logical,
    "shift_right_arithmetic": _shift_right_arithmetic,
    "select_n": _select_n,
    "clamp": _clamp,
    # types and shapes
    "convert_element_type": _convert,
    "bitcast_convert_type": _bitcast_convert_type,
    "iota": _iota,
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "squeeze": lambda x, *, dimensions: np.squeeze(x, tuple(dimensions)),
    "transpose": lambda x, *, permutation: np.transpose(x, permutation),
    "rev": lambda x, *, dimensions: np.flip(x, tuple(dimensions)),
    "slice": _slice,
    "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update_slice,
    "concatenate": lambda *xs, dimension: np.concatenate(xs, axis=dimension),
    "stack": lambda *xs, axis: np.stack(xs, axis=axis),
    "tile": lambda x, *, reps: np.tile(x, reps),
    "pad": _pad,
    "split": _split,
    "gather": _gather,
    "scatter": _scatter_with(None),
    "scatter-add": _scatter_with(lambda out, at, v: np.add.at(out, at, v)),
    "scatter-mul": _scatter_with(lambda out, at, v: np.multiply.at(out, at, v)),
    "scatter-min": _scatter_with(lambda out, at, v: np.minimum.at(out, at, v)),
    "scatter-max": _scatter_with(lambda out, at, v: np.maximum.at(out, at, v)),
    # reductions and scans
    "reduce_sum": _reduction(np.add),
    "reduce_prod": _reduction(np.multiply),
    "reduce_max": _extremum(np.maximum, max_identity),
    "reduce_min": _extremum(np.minimum, min_identity),
    "reduce_and": _reduction(np.logical_and, keep_dtype=False),
    "reduce_or": _reduction(np.logical_or, keep_dtype=False),
    "reduce_xor": _reduce_xor,
    "argmax": _arg_reduction(np.argmax),
    "argmin": _arg_reduction(np.argmin),
    "cumsum": _cumulative(np.cumsum),
    "cumprod": _cumulative(np.cumprod),
    "cummax": _cumulative(lambda x, axis, dtype: np.maximum.accumulate(x, axis=axis)),
    "cummin": _cumulative(lambda x, axis, dtype: np.minimum.accumulate(x, axis=axis)),
    "cumlogsumexp": _cumulative(lambda x, axis, dtype: np.logaddexp.accumulate(x, axis=axis)),
    "reduce_window_sum": _reduce_window(np.sum, lambda dtype: 0),
    "reduce_window_max": _reduce_window(np.max, max_identity),
    "reduce_window_min": _reduce_window(np.min, min_identity),
    "select_and_scatter_add": _select_and_scatter_add,
    "dot_general": _dot_general,
    "conv_general_dilated": _conv_general_dilated,
    "fft": _fft,
    # linear algebra (LAPACK through numpy / scipy)
    "lu": _lu,
    "lu_pivots_to_permutation": _lu_pivots_to_permutation,
    "cholesky": _cholesky,
    "triangular_solve": _triangular_solve,
    "svd": _svd,
    "eigh": _eigh,
    "qr": _qr,
    "custom_linear_solve": _custom_linear_solve,
    # random numbers: keys are their uint32 data; JAX's own definitions run on it
    "random_seed": _random_seed,
    "random_split": _random_split,
    "random_bits": _random_bits,
    "random_fold_in": _random_fold_in,
    "random_wrap": _random_wrap,
    "random_unwrap": lambda keys: keys,
    "threefry2x32": _threefry2x32,
    "iota_2x32_shape": _iota_2x32_shape,
    "platform_index": _platform_index,
    "sort": _sort,
    "top_k": _top_k,
    # calls and control flow, by recursion into their sub-graphs
    "jit": _jit,
    "custom_jvp_call": _custom_jvp_call,
    "custom_vjp_call": _custom_vjp_call,
    "remat2": _remat,
    "cond": _cond,
    "while": _while,
    "scan": _scan,
    "debug_callback": _debug_callback,
    "debug_print": _debug_print,
}
