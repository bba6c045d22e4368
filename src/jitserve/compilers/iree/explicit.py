"""Make explicit what IREE's lowering of StableHLO loses, before jitserve hands a definition to IREE.

StableHLO gives gathers clamped start indices and scatters that skip an
out-of-range update; JAX relies on both (``x[i]``, ``x.at[i].set``, the
``mode=`` of ``take`` and ``.at``). IREE's lowering keeps neither: it reads and
writes outside the array (garbage, another buffer's memory, or SIGSEGV). It
also sorts unstably whatever ``is_stable`` says. :func:`explicit` re-traces a
definition with each of those nodes rewritten into plain operations whose
meaning survives any lowering:

- a gather clamps its start indices itself (and masks the windows that were
  out of range where the mode is ``fill``);
- a scatter sends an out-of-range update window into a scratch margin added
  to the operand and sliced off afterwards, so it touches nothing, and is
  put in the one form IREE compiles: points named by index columns of the
  leading axes, windows over the trailing ones. ``jax.vmap`` of
  ``dynamic_update_slice`` (a KV cache written at each slot's position)
  gives a batching axis and windows on indexed axes, which IREE 3.x refused;
- an in-place write (an update slice, a scatter) into an argument, or into
  a view of one, writes a copy unless the argument is donated: IREE wrote
  the caller's buffer when one such write was all that used it
  (iree-org/iree#16168), so a serving's weights changed at every call;
- a stable sort gets the position of each element as its last key, so that
  every order it may produce is the stable one; and every sort sorts a copy of
  its operands (IREE sorted in the operand's own buffer under other readers);
- a float to integer conversion saturates and sends NaN to 0 explicitly, as
  XLA does (IREE's conversion of out-of-range values is undefined);
- ``atan2`` takes its zeros, infinities and signs from C99's table, as XLA's
  does (IREE's gives NaN at (0, 0) and at two infinities, and +pi for -0);
- ``pow`` gets only ``|x|`` from IREE (which computes exp(y log x): NaN for
  any negative base, and for 0 ** 0) and the sign, the NaNs and C99's exact
  cases explicitly; ``cbrt`` keeps infinities, ``digamma`` is NaN at 0, and
  ``sin`` / ``tan`` keep -0;
- ``top_k`` ranks by IEEE total order along the reversed axis (IREE ranks NaN
  lowest and gives ties the highest index first; XLA ranks NaN highest, the
  lowest index first);
- a dot or convolution of 16-bit floats accumulates in float32 and rounds
  once, as XLA's CPU does (IREE accumulates in the 16-bit type); a dot over
  an axis of length 0 is zeros (IREE does not compile it);
- the gradient of a max or min pool chooses within each window by slices and
  selects, and puts each choice back by padding (IREE compiles
  ``select_and_scatter`` only for windows that neither overlap nor are padded);
- an FFT is taken one axis at a time, lengths that are not powers of two by
  Bluestein's algorithm (IREE lowers one axis of a power-of-two length);
- LU with partial pivoting, Cholesky and triangular solves (and so
  ``jnp.linalg.solve``, ``inv``, ``det``, ``cho_solve``) are loops of plain
  operations, as LAPACK's unblocked routines go.

Still IREE's own, and documented rather than rewritten: float32 ``sin``,
``cos`` and ``tan`` lose accuracy from about 3e4 (a relative error of 1e-3
there, -inf or NaN near 1e30), and complex division, ``log`` and ``exp``
mishandle infinities, signed zeros and magnitudes whose squares overflow.

Nodes that IREE cannot compile at all (QR, SVD and eigendecompositions) raise a
:class:`CompileError` naming the ``jnp`` functions behind them and the
compilers that can, before IREE sees anything. Calls, custom derivatives and
checkpoints are inlined; loops and conditionals keep their structure with
their bodies rewritten.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from ...errors import CompileError
from .. import semantics

LINEAR_ALGEBRA = ("jitserve rewrites LU, Cholesky and triangular solves for IREE, not this; use compiler='xla' or "
                  "compiler='evaluator'")

# Primitives IREE has no lowering for (on CPU they become LAPACK custom calls) and jitserve does not rewrite:
# what users call to get them.
UNSUPPORTED: dict[str, str] = {
    "svd": "a singular value decomposition (jnp.linalg.svd, pinv, matrix_rank, norm(ord=2), cond)",
    "eigh": "a symmetric eigendecomposition (jnp.linalg.eigh, eigvalsh)",
    "eig": "an eigendecomposition (jnp.linalg.eig, eigvals)",
    "qr": "a QR factorisation (jnp.linalg.qr, jax.scipy.linalg.qr)",
    "householder_product": "a Householder product (jnp.linalg.qr)",
    "schur": "a Schur decomposition (jax.scipy.linalg.schur, sqrtm)",
    "hessenberg": "a Hessenberg reduction (jax.scipy.linalg.hessenberg)",
    "tridiagonal": "a tridiagonal reduction (jax.scipy.linalg.eigh_tridiagonal)",
    "tridiagonal_solve": "a tridiagonal solve (jax.lax.linalg.tridiagonal_solve)",
}

UNROLLED_STEPS = 16  # the most steps of a factorisation or substitution loop that are unrolled (see _loop)

# Call-like primitives whose body is inlined: primitive -> the parameter holding the body.
INLINED: dict[str, str] = {
    "jit": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "remat2": "jaxpr",
    "closed_call": "call_jaxpr",
}


# What IREE may write in place, its first operand; and what may give its operand's buffer as its result.
WRITES_IN_PLACE = frozenset({"dynamic_update_slice", "scatter", "scatter-add", "scatter-mul", "scatter-min",
                             "scatter-max"})
VIEWS = frozenset({"reshape", "squeeze", "broadcast_in_dim", "convert_element_type", "bitcast_convert_type",
                   "reduce_precision", "copy", "optimization_barrier", "slice", "dynamic_slice", "transpose"})


def explicit(fn: Callable[..., Any], donated: Sequence[int] = ()) -> Callable[..., Any]:
    """``fn`` with the nodes above rewritten (same inputs, same outputs). Its arguments are the caller's to
    keep, but for those at positions ``donated``: IREE writes an input in place when one in-place operation
    (an update slice, a scatter) is all that uses it (iree-org/iree#16168), so such an operation on an
    input, or on a view of one, is given a copy of it first (XLA copies there too)."""
    def rewritten(*args: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        kept = {id(leaf) for position, arg in enumerate(args) if position not in donated
                for leaf in jax.tree_util.tree_leaves(arg)}
        flat = _evaluate(closed.jaxpr, closed.consts, jax.tree_util.tree_leaves(args), kept)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), flat)

    rewritten.__name__ = getattr(fn, "__name__", "fn")
    return rewritten


def _own_copy(x: Any) -> Any:
    """``x`` in a buffer of its own: a select on a predicate IREE cannot see through (an optimization
    barrier), which it can neither fold away nor run in the caller's buffer."""
    keep = lax.optimization_barrier(np.ones((), bool))
    return jnp.where(keep, x, jnp.zeros((), x.dtype))


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], kept: set[int] | None = None) -> list[Any]:
    """``jaxpr`` rewritten and traced; ``kept``: the ids of the values that are the caller's arrays (or views
    of them), which no operation may write in place (grown as views of them are made)."""
    kept = set() if kept is None else kept
    env: dict[Any, Any] = {}

    def read(atom: Any) -> Any:
        return atom.val if isinstance(atom, jcore.Literal) else env[atom]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in UNSUPPORTED:
            raise CompileError(f"compiler 'iree' cannot compile {UNSUPPORTED[name]}: IREE has no lowering for "
                               f"primitive {name!r}; {LINEAR_ALGEBRA}")
        values = [read(atom) for atom in eqn.invars]
        if name in WRITES_IN_PLACE and id(values[0]) in kept:
            values[0] = _own_copy(values[0])
        if name in INLINED:
            body = eqn.params[INLINED[name]]
            closed = body if isinstance(body, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(body, ())
            results = _evaluate(closed.jaxpr, closed.consts, values, kept)
        elif name in REWRITES:
            results = REWRITES[name](*values, **eqn.params)
        else:
            results = eqn.primitive.bind(*values, **_rewrite_bodies(eqn.params))
            if not eqn.primitive.multiple_results:
                results = [results]
        if name in VIEWS and any(id(value) in kept for value in values):
            kept.update(id(result) for result in results)
        for var, value in zip(eqn.outvars, results):
            if not isinstance(var, jcore.DropVar):
                env[var] = value
    return [read(atom) for atom in jaxpr.outvars]


def _rewrite_closed(closed: Any) -> Any:
    avals = [jax.ShapeDtypeStruct(aval.shape, aval.dtype) for aval in closed.in_avals]
    return jax.make_jaxpr(lambda *args: _evaluate(closed.jaxpr, closed.consts, args))(*avals)


def _rewrite_bodies(params: dict[str, Any]) -> dict[str, Any]:
    """Loop, branch and linear solve bodies (closed jaxprs, alone or in tuples) rewritten the same way."""
    rewritten = dict(params)
    for key, value in params.items():
        if isinstance(value, jcore.ClosedJaxpr):
            rewritten[key] = _rewrite_closed(value)
        elif isinstance(value, tuple) and any(isinstance(v, jcore.ClosedJaxpr) for v in value):
            bodies = [_rewrite_closed(v) if isinstance(v, jcore.ClosedJaxpr) else v for v in value]
            rewritten[key] = value._make(bodies) if hasattr(value, "_make") else tuple(bodies)  # keeps namedtuples
    return rewritten


def _as_index(indices: Any, operand_shape: Sequence[int]) -> Any:
    """The indices as int32 (int64 where a dimension needs it), saturating: no large index wraps into range."""
    target = np.dtype(np.int64 if max(operand_shape, default=0) >= np.iinfo(np.int32).max else np.int32)
    source, wanted = np.iinfo(indices.dtype.type), np.iinfo(target.type)
    low, high = max(source.min, wanted.min), min(source.max, wanted.max)
    if (low, high) != (source.min, source.max):
        indices = lax.clamp(np.array(low, indices.dtype), indices, np.array(high, indices.dtype))
    return indices.astype(target)


def _bounds(indices: Any, limits: Sequence[int]) -> tuple[Any, Any]:
    """The indices as a signed type and whether each index vector (last axis) lies within [0, limits]."""
    upper = np.asarray(limits, indices.dtype).reshape((1,) * (indices.ndim - 1) + (-1,))
    in_range = (indices >= 0) & (indices <= upper)
    return upper, jax.numpy.all(in_range, axis=-1)


def _gather(operand: Any, indices: Any, *, dimension_numbers: Any, slice_sizes: Sequence[int], mode: Any,
            fill_value: Any, indices_are_sorted: bool, unique_indices: bool) -> list[Any]:
    dn = dimension_numbers
    indices = _as_index(indices, operand.shape)
    upper, in_range = _bounds(indices, [operand.shape[a] - slice_sizes[a] for a in dn.start_index_map])
    clamped = lax.clamp(np.zeros((), indices.dtype), indices, np.broadcast_to(upper, indices.shape))
    out = lax.gather(operand, clamped, dn, tuple(slice_sizes), indices_are_sorted=indices_are_sorted,
                     unique_indices=unique_indices, mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    if lax.GatherScatterMode.from_any(mode) is not lax.GatherScatterMode.FILL_OR_DROP:
        return [out]
    batch_axes = tuple(axis for axis in range(out.ndim) if axis not in dn.offset_dims)
    keep = lax.broadcast_in_dim(in_range, out.shape, batch_axes)
    return [lax.select(keep, out, lax.full_like(out, semantics.gather_fill(operand.dtype, fill_value)))]


def _in_iree_form(primitive: Any, operand: Any, indices: Any, updates: Any, dn: lax.ScatterDimensionNumbers,
                  params: dict[str, Any]) -> Any:
    """A scatter of indices known to be in range, in the one form IREE compiles (``iree_linalg_ext.scatter``):
    points named by index columns of the leading axes, each with a window over all the trailing axes.
    ``jax.vmap`` of ``dynamic_update_slice`` (a KV cache written at each slot's position) gives others.
    So a batching axis becomes an index column of its position (as StableHLO's compatibility expander
    does); an indexed axis whose window spans it drops its column (always 0 here); and a window on an
    indexed axis, or on an axis before one, becomes points: a column of start + 0..size-1, one more axis
    of updates. The data written is the same; only the bookkeeping of where changes."""
    rank, last = operand.ndim, indices.ndim - 1
    columns = {axis: lax.slice_in_dim(indices, i, i + 1, axis=last)
               for i, axis in enumerate(dn.scatter_dims_to_operand_dims)}
    for operand_axis, indices_axis in zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims):
        columns[operand_axis] = lax.broadcasted_iota(indices.dtype, (*indices.shape[:-1], 1), indices_axis)
    windows = [a for a in range(rank) if a not in dn.inserted_window_dims and a not in dn.operand_batching_dims]
    batch = indices.ndim - 1  # the updates' axes that are not windows, first, then the windows in order
    updates = lax.transpose(updates, [*(d for d in range(updates.ndim) if d not in dn.update_window_dims),
                                      *dn.update_window_dims])
    whole = [a for i, a in enumerate(windows) if a in columns and updates.shape[batch + i] == operand.shape[a]]
    for axis in whole[:len(columns) - 1]:
        del columns[axis]
    deepest = max(columns)
    for axis in range(deepest):
        if axis not in columns and axis not in windows:  # inserted without a column: at 0
            columns[axis] = jnp.zeros((*indices.shape[:-1], 1), indices.dtype)
    pointwise = [a for a in windows if a <= deepest]
    if pointwise or list(columns) != sorted(columns) or dn.operand_batching_dims:
        # overlapping windows would give the same point twice, and the new columns break the order
        params = {**params, "indices_are_sorted": False, "unique_indices": params["unique_indices"] and not pointwise}
    for axis in pointwise:
        updates = jnp.moveaxis(updates, batch + windows.index(axis), batch)
        shape = (*updates.shape[:batch + 1], 1)
        columns = {a: lax.broadcast_in_dim(c, shape, (*range(batch), batch + 1)) for a, c in columns.items()}
        columns[axis] = columns.get(axis, 0) + lax.broadcasted_iota(indices.dtype, shape, batch)
        windows.remove(axis)
        batch += 1
    points = lax.ScatterDimensionNumbers(
        update_window_dims=tuple(range(batch, batch + len(windows))),
        inserted_window_dims=tuple(a for a in range(rank) if a not in windows),
        scatter_dims_to_operand_dims=tuple(sorted(columns)))
    return primitive.bind(operand, lax.concatenate([columns[a] for a in sorted(columns)], batch), updates,
                          dimension_numbers=points, mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS, **params)


def _scatter(primitive: Any) -> Callable[..., list[Any]]:
    def scatter(operand: Any, indices: Any, updates: Any, *, dimension_numbers: Any, mode: Any,
                **params: Any) -> list[Any]:
        dn = dimension_numbers
        if not dn.scatter_dims_to_operand_dims:
            if not dn.operand_batching_dims:
                return [primitive.bind(operand, indices, updates, dimension_numbers=dn, mode=mode, **params)]
            return [_in_iree_form(primitive, operand, indices, updates, dn, params)]
        window_axes = [a for a in range(operand.ndim)
                       if a not in dn.inserted_window_dims and a not in dn.operand_batching_dims]
        sizes = [1] * operand.ndim
        for axis, update_axis in zip(window_axes, dn.update_window_dims):
            sizes[axis] = updates.shape[update_axis]
        indices = _as_index(indices, [d + s for d, s in zip(operand.shape, sizes)])
        targets = dn.scatter_dims_to_operand_dims
        upper, in_range = _bounds(indices, [operand.shape[a] - sizes[a] for a in targets])
        if lax.GatherScatterMode.from_any(mode) is lax.GatherScatterMode.CLIP:
            safe = lax.clamp(np.zeros((), indices.dtype), indices, np.broadcast_to(upper, indices.shape))
            return [_in_iree_form(primitive, operand, safe, updates, dn, params)]
        # An out-of-range window goes to a margin past the end of the first scattered axis, sliced off after.
        first = targets[0]
        margin = [(0, sizes[first] if axis == first else 0, 0) for axis in range(operand.ndim)]
        widened = lax.pad(operand, np.zeros((), operand.dtype), margin)
        keep = in_range[..., None]
        parking = np.zeros(len(targets), indices.dtype)
        parking[0] = operand.shape[first]
        safe = lax.select(jax.numpy.broadcast_to(keep, indices.shape), indices,
                          jax.numpy.broadcast_to(parking, indices.shape))
        out = _in_iree_form(primitive, widened, safe, updates, dn, params)
        return [lax.slice(out, (0,) * operand.ndim, operand.shape)]
    return scatter


def _sort(*operands: Any, dimension: int, is_stable: bool, num_keys: int) -> list[Any]:
    """Stable: each element's position becomes the last key, so every order the sort may give is the stable one.
    (Gathering the other operands by the sorted positions instead would spare IREE's CUDA target, which cannot
    sort three operands or more, but IREE 3.x miscompiles that gather on the CPU.)"""
    # IREE sorts in its operand's buffer even where another operation reads the operand after (an argmax
    # beside a sort of the same logits read the sorted values): the sort gets a copy of its own, behind a
    # barrier that keeps IREE from sorting the original in place of the copy
    operands = tuple(lax.optimization_barrier(_own_copy(operand)) for operand in operands)
    if not is_stable:
        return lax.sort_p.bind(*operands, dimension=dimension, is_stable=False, num_keys=num_keys)
    position = lax.broadcasted_iota(np.int32, operands[0].shape, dimension)
    keyed = [*operands[:num_keys], position, *operands[num_keys:]]
    out = lax.sort_p.bind(*keyed, dimension=dimension, is_stable=True, num_keys=num_keys + 1)
    return [*out[:num_keys], *out[num_keys + 1:]]


def _convert(x: Any, *, new_dtype: Any, weak_type: bool, sharding: Any) -> list[Any]:
    bind = lambda value: lax.convert_element_type_p.bind(  # noqa: E731
        value, new_dtype=new_dtype, weak_type=weak_type, sharding=sharding)
    target = np.dtype(new_dtype)
    if not (jax.dtypes.issubdtype(x.dtype, np.floating) and jax.dtypes.issubdtype(target, np.integer)):
        return [bind(x)]
    info = np.iinfo(target)
    with np.errstate(over="ignore"):  # a limit beyond the float type's range becomes inf, as intended
        high, low = np.asarray(info.max, x.dtype), np.asarray(info.min, x.dtype)
    too_big, too_small = x >= high, x <= low
    safe = bind(lax.select(too_big | too_small | lax.ne(x, x), lax.full_like(x, 0), x))
    clipped_low = lax.select(too_small, lax.full_like(safe, info.min), safe)
    return [lax.select(too_big, lax.full_like(safe, info.max), clipped_low)]


def _atan2(y: Any, x: Any, **params: Any) -> list[Any]:
    """IREE's atan2 is right only for finite, non-zero arguments with ``y`` > 0 (it gives NaN at zeros and
    infinities, and +pi for y = -0, x < 0); the rest is C99's table, as XLA computes it, made explicit."""
    def angle(value: float) -> Any:
        return lax.full_like(y, value)

    magnitude = lax.abs(y)
    x_negative = jnp.signbit(x)  # -0 too: atan2(+-0, -0) is +-pi
    result = lax.atan2_p.bind(magnitude, x, **params)
    result = lax.select(x == 0, angle(np.pi / 2), result)
    result = lax.select(jnp.isinf(x), lax.select(x_negative, angle(np.pi), angle(0.0)), result)
    result = lax.select(jnp.isinf(magnitude), lax.select(
        jnp.isinf(x), lax.select(x_negative, angle(3 * np.pi / 4), angle(np.pi / 4)), angle(np.pi / 2)), result)
    result = lax.select(magnitude == 0, lax.select(x_negative, angle(np.pi), angle(0.0)), result)
    result = lax.select(jnp.isnan(x) | jnp.isnan(y), angle(np.nan), result)
    return [jnp.copysign(result, y)]


def _pow(x: Any, y: Any, **params: Any) -> list[Any]:
    """IREE computes ``x ** y`` as exp(y log x): NaN for every negative ``x`` (``(-3.0) ** y`` with y = 2.0
    too) and for 0 ** 0, inf ** 0 and 1 ** inf. Here it only gets ``|x|``; the sign (an odd integer power of a
    negative base), NaN (a negative base to a non-integer power) and the exact ones of C99's table, which
    XLA follows, are explicit."""
    if not jax.dtypes.issubdtype(x.dtype, np.floating):
        return [lax.pow_p.bind(x, y, **params)]
    if jax.dtypes.issubdtype(y.dtype, np.integer):
        integer, odd = lax.full_like(y, True, np.bool_), lax.rem(y, lax.full_like(y, 2)) != 0
    else:
        integer = (lax.floor(y) == y) & jnp.isfinite(y)
        odd = integer & (lax.rem(y, lax.full_like(y, 2)) != 0)
    one, nan = lax.full_like(x, 1), lax.full_like(x, np.nan)
    magnitude = lax.pow_p.bind(lax.abs(x), y, **params)
    result = lax.select(jnp.signbit(x) & odd, lax.neg(magnitude), magnitude)
    result = lax.select((x < 0) & jnp.isfinite(x) & ~integer & jnp.isfinite(y), nan, result)
    result = lax.select((lax.abs(x) == 1) & jnp.isinf(y), one, result)
    return [lax.select((y == 0) | (x == 1), one, result)]


def _cbrt(x: Any, **params: Any) -> list[Any]:
    """IREE's cube root of an infinity is NaN; it is the infinity."""
    return [lax.select(jnp.isinf(x), x, lax.cbrt_p.bind(x, **params))]


def _flip_negatives(bits: Any) -> Any:
    """A float's bits (as a signed integer) to a key in IEEE total order (-NaN < -inf < ... < -0 < +0 < ... <
    +inf < NaN): the magnitude bits of a negative value inverted. It is its own inverse."""
    width = bits.dtype.itemsize * 8
    sign = lax.shift_right_arithmetic(bits, lax.full_like(bits, width - 1))
    return lax.bitwise_xor(bits, lax.bitwise_and(sign, lax.full_like(bits, np.iinfo(bits.dtype).max)))


def _top_k(operand: Any, *, k: int, axis: int) -> list[Any]:
    """IREE's top_k ranks NaN below everything (XLA: above +inf) and gives equal values the highest index
    first (XLA: the lowest). Here it ranks a float's key in IEEE total order (an integer is its own key)
    along the reversed axis, so that IREE's order of ties is XLA's (the corpus's tie cases check it), maps
    the indices back and turns the keys back into values. Neither a sort nor a gather of the values: IREE
    cannot compile either next to a top_k over a row of 50,000 (a vocabulary's logits)."""
    floating = jax.dtypes.issubdtype(operand.dtype, np.floating)
    signed = np.dtype(f"int{operand.dtype.itemsize * 8}")
    key = _flip_negatives(lax.bitcast_convert_type(operand, signed)) if floating else operand
    top, reversed_indices = lax.top_k_p.bind(lax.rev(key, (axis,)), k=k, axis=axis)
    indices = lax.sub(lax.full_like(reversed_indices, operand.shape[axis] - 1), reversed_indices)
    return [lax.bitcast_convert_type(_flip_negatives(top), operand.dtype) if floating else top, indices]


def _digamma(x: Any, **params: Any) -> list[Any]:
    """IREE's digamma at the pole 0 is -inf; XLA's is NaN, as at the negative integers."""
    return [lax.select(x == 0, lax.full_like(x, np.nan), lax.digamma_p.bind(x, **params))]


def _odd(primitive: Any) -> Callable[..., list[Any]]:
    """An odd function (sin, tan) whose IREE lowering turns -0 into +0; XLA keeps -0."""
    return lambda x, **params: [lax.select(x == 0, x, primitive.bind(x, **params))]


def _wide_accumulator(primitive: Any) -> Callable[..., list[Any]]:
    """A dot or convolution of 16-bit floats: IREE accumulates in the 16-bit type (a 64 x 256 @ 256 x 64
    float16 matmul was 25 times further from exact than XLA's); XLA's CPU accumulates in float32 and rounds
    once. Asked here for a float32 result, rounded to the 16-bit type."""
    def run(lhs: Any, rhs: Any, *, preferred_element_type: Any, **params: Any) -> list[Any]:
        result_type = np.dtype(preferred_element_type or lhs.dtype)
        if not (jax.dtypes.issubdtype(result_type, np.floating) and result_type.itemsize == 2):
            return [primitive.bind(lhs, rhs, preferred_element_type=preferred_element_type, **params)]
        wide = primitive.bind(lhs, rhs, preferred_element_type=np.dtype(np.float32), **params)
        return [lax.convert_element_type(wide, result_type)]
    return run


def _select_and_scatter_add(source: Any, operand: Any, *, select_prim: Any, window_dimensions: Sequence[int],
                            window_strides: Sequence[int], padding: Sequence[tuple[int, int]]) -> list[Any]:
    """The gradient of a max (or min) pool. IREE compiles ``select_and_scatter`` only where windows neither
    overlap nor are padded (not a 3 x 3 pool of stride 1 or 2). Here each window's choice is made over its
    offsets in order (the first of equal values wins, as in XLA's scan of a window) on strided slices of the
    padded operand, and each offset's share of ``source`` is put back in place by an interior padding."""
    if source.size == 0:  # no window fits: nothing is selected
        return [lax.full(operand.shape, 0, source.dtype)]
    pick_max = select_prim is lax.ge_p
    keep = lax.ge if pick_max else lax.le
    fill = semantics.max_identity(operand.dtype) if pick_max else semantics.min_identity(operand.dtype)
    padded = lax.pad(operand, np.array(fill, operand.dtype), [(lo, hi, 0) for lo, hi in padding])
    out_shape = source.shape
    offsets = list(np.ndindex(*window_dimensions))
    candidates = [lax.slice(padded, offset, [o + (n - 1) * s + 1 for o, n, s in zip(offset, out_shape, window_strides)],
                            window_strides) for offset in offsets]
    best, chosen = candidates[0], lax.full(out_shape, 0, np.int32)
    for number, candidate in enumerate(candidates[1:], 1):
        switch = lax.bitwise_not(keep(best, candidate))
        best = lax.select(switch, candidate, best)
        chosen = lax.select(switch, lax.full(out_shape, number, np.int32), chosen)
    zero = np.zeros((), source.dtype)
    total = lax.full(padded.shape, zero, source.dtype)
    for number, offset in enumerate(offsets):
        share = lax.select(chosen == number, source, lax.full_like(source, zero))
        placement = [(o, size - o - ((n - 1) * s + 1), s - 1)
                     for o, size, n, s in zip(offset, padded.shape, out_shape, window_strides)]
        total = lax.add(total, lax.pad(share, zero, placement))
    return [lax.slice(total, [lo for lo, _ in padding], [lo + d for (lo, _), d in zip(padding, operand.shape)])]


def _power_of_two(length: int) -> bool:
    """Whether IREE lowers an FFT of ``length`` itself (0 and 1 included: nothing to transform)."""
    return length & (length - 1) == 0


def _chirp(length: int) -> np.ndarray:
    """exp(-i pi m^2 / length) for m < length, its phase reduced exactly (m^2 mod 2 length) in integers."""
    m = np.arange(length, dtype=np.int64)
    return np.exp(-1j * np.pi * ((m * m) % (2 * length)) / length)


def _fft_last_axis(x: Any, inverse: bool) -> Any:
    """A complex FFT (or inverse) along the last axis. IREE lowers a power-of-two length itself; any other
    length N goes through Bluestein's algorithm, its chirp convolution done by FFTs of the power of two
    M >= 2N - 1 (the chirp and the transform of its conjugate are constants computed in float64)."""
    length = x.shape[-1]
    if _power_of_two(length):
        return lax.fft(x, lax.FftType.IFFT if inverse else lax.FftType.FFT, (length,))
    if inverse:  # ifft(x) = conj(fft(conj(x))) / N
        return lax.conj(_fft_last_axis(lax.conj(x), False)) / np.array(length, x.real.dtype)
    padded = 1 << (2 * length - 2).bit_length()
    chirp = _chirp(length)
    kernel = np.zeros(padded, np.complex128)
    kernel[:length], kernel[padded - length + 1:] = chirp.conj(), chirp.conj()[1:][::-1]
    chirp, kernel = chirp.astype(x.dtype), np.fft.fft(kernel).astype(x.dtype)
    chirped = x * chirp
    margin = [(0, 0, 0)] * (x.ndim - 1) + [(0, padded - length, 0)]
    zero = np.zeros((), chirped.real.dtype)  # (iree-compile crashes padding a complex tensor)
    spread = lax.complex(lax.pad(lax.real(chirped), zero, margin), lax.pad(lax.imag(chirped), zero, margin))
    convolved = lax.fft(lax.fft(spread, lax.FftType.FFT, (padded,)) * kernel, lax.FftType.IFFT, (padded,))
    return lax.slice_in_dim(convolved, 0, length, axis=x.ndim - 1) * chirp


def _along(x: Any, axis: int, transform: Callable[[Any], Any]) -> Any:
    return jnp.moveaxis(transform(jnp.moveaxis(x, axis, -1)), -1, axis)


def _fft(x: Any, *, fft_type: Any, fft_lengths: Sequence[int]) -> list[Any]:
    """IREE lowers only a one-axis FFT of a power-of-two length in single precision (a 10-point FFT and
    ``fft2`` did not compile). Here each axis is transformed on its own, by :func:`_fft_last_axis`; a real
    transform of a length IREE cannot take is a complex one of the real input (RFFT: its first N // 2 + 1
    terms; IRFFT: of the Hermitian spectrum completed from them, its real part)."""
    if x.dtype not in (np.float32, np.complex64):
        raise CompileError(f"compiler 'iree' cannot compile an FFT of {x.dtype}: IREE lowers FFTs of float32 "
                           "and complex64 only; transform in single precision, or use compiler='xla' or "
                           "compiler='evaluator'")
    kind = lax.FftType(fft_type)
    *outer, last = range(x.ndim - len(fft_lengths), x.ndim)
    length = fft_lengths[-1]
    if kind in (lax.FftType.FFT, lax.FftType.IFFT):
        for axis in (*outer, last):
            x = _along(x, axis, lambda v: _fft_last_axis(v, kind is lax.FftType.IFFT))
        return [x]
    if kind is lax.FftType.RFFT:
        if _power_of_two(length):
            x = lax.fft(x, kind, (length,))
        else:
            spectrum = _fft_last_axis(lax.complex(x, lax.full_like(x, 0)), False)
            x = lax.slice_in_dim(spectrum, 0, length // 2 + 1, axis=last)
        for axis in outer:
            x = _along(x, axis, lambda v: _fft_last_axis(v, False))
        return [x]
    for axis in outer:
        x = _along(x, axis, lambda v: _fft_last_axis(v, True))
    if _power_of_two(length):
        return [lax.fft(x, kind, (length,))]
    mirrored = lax.conj(lax.rev(lax.slice_in_dim(x, 1, length - x.shape[last] + 1, axis=last), (last,)))
    return [lax.real(_fft_last_axis(lax.concatenate([x, mirrored], last), True))]


def _rows_and_columns(m: int, n: int) -> tuple[Any, Any]:
    return lax.broadcasted_iota(np.int32, (m, 1), 0), lax.broadcasted_iota(np.int32, (1, n), 1)


def _loop(count: int, step: Callable[[Any, Any], Any], start: Any) -> Any:
    """``step`` applied ``count`` times, unrolled up to UNROLLED_STEPS. IREE runs each turn of a loop as
    dispatches of its own (an 8 x 8 solve took 3.7 ms rolled, 0.23 ms unrolled), but an unrolled loop's
    compile grows fast with its steps (a 16 x 16 solve 8 s, a 64 x 64 one 24 s)."""
    if count == 0:
        return start
    return lax.fori_loop(0, count, step, start, unroll=count <= UNROLLED_STEPS)


def _row(x: Any, index: Any) -> Any:
    return lax.dynamic_index_in_dim(x, index, x.ndim - 2)


def _column(x: Any, index: Any) -> Any:
    return lax.dynamic_index_in_dim(x, index, x.ndim - 1)


def _lu(a: Any) -> list[Any]:
    """LU with partial pivoting, column by column as LAPACK's getf2: the pivot is the first row of largest
    magnitude (|re| + |im| for complex, as LAPACK's i?amax), a zero pivot scales nothing."""
    m, n = a.shape[-2:]
    rows, columns = _rows_and_columns(m, n)
    order = lax.broadcasted_iota(np.int32, (m,), 0)

    def step(j: Any, state: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
        lu, pivots, permutation = state
        column = _column(lu, j)[..., 0]
        magnitude = jnp.abs(column.real) + jnp.abs(column.imag) if jnp.iscomplexobj(a) else jnp.abs(column)
        pivot = jnp.argmax(jnp.where(order >= j, magnitude, -1), axis=-1).astype(np.int32)
        at_pivot = (order == pivot[..., None])
        pivot_row = jnp.sum(jnp.where(at_pivot[..., None], lu, 0), axis=-2, keepdims=True)
        lu = jnp.where(rows == j, pivot_row, jnp.where(at_pivot[..., None], _row(lu, j), lu))
        moved = jnp.sum(jnp.where(at_pivot, permutation, 0), axis=-1, keepdims=True)
        permutation = jnp.where(order == j, moved, jnp.where(at_pivot, _column(permutation, j), permutation))
        pivots = jnp.where(order[: pivots.shape[-1]] == j, pivot[..., None], pivots)
        diagonal = _column(pivot_row, j)
        below = _column(lu, j)
        multipliers = jnp.where(rows > j, jnp.where(diagonal == 0, below, below / diagonal), 0)
        lu = lu - multipliers * jnp.where(columns > j, pivot_row, 0)
        return jnp.where((rows > j) & (columns == j), multipliers, lu), pivots, permutation

    start = (a, jnp.zeros((*a.shape[:-2], min(m, n)), np.int32), jnp.broadcast_to(order, (*a.shape[:-2], m)))
    return list(_loop(min(m, n), step, start))


def _solve_lower_or_upper(a: Any, b: Any, lower: bool, unit_diagonal: bool) -> Any:
    """a x = b by substitution, row by row (from the top for a lower ``a``); the other triangle is ignored."""
    m = a.shape[-1]
    rows, columns = _rows_and_columns(m, m)
    strict = jnp.where(columns < rows if lower else columns > rows, a, 0)

    def step(i: Any, x: Any) -> Any:
        row = i if lower else m - 1 - i
        value = _row(b, row) - _row(strict, row) @ x
        if not unit_diagonal:
            value = value / _column(_row(a, row), row)
        return jnp.where(rows == row, value, x)

    return _loop(m, step, jnp.zeros(b.shape, jnp.result_type(a, b)))


def _triangular_solve(a: Any, b: Any, *, left_side: bool, lower: bool, transpose_a: bool, conjugate_a: bool,
                      unit_diagonal: bool) -> list[Any]:
    """op(a) x = b, or x op(a) = b (that is, op(a)^T x^T = b^T), with op(a) made explicit first."""
    a = jnp.conj(a) if conjugate_a else a
    a, lower = (jnp.swapaxes(a, -1, -2), not lower) if transpose_a else (a, lower)
    if left_side:
        return [_solve_lower_or_upper(a, b, lower, unit_diagonal)]
    flipped = _solve_lower_or_upper(jnp.swapaxes(a, -1, -2), jnp.swapaxes(b, -1, -2), not lower, unit_diagonal)
    return [jnp.swapaxes(flipped, -1, -2)]


def _cholesky(a: Any, *, symmetrize_input: bool = False) -> list[Any]:
    """The lower factor, column by column; a matrix that is not positive definite is NaN throughout, as
    XLA returns it (LAPACK's potrf fails on the first diagonal that is not positive)."""
    a = (a + jnp.conj(jnp.swapaxes(a, -1, -2))) / 2 if symmetrize_input else a
    n = a.shape[-1]
    rows, columns = _rows_and_columns(n, n)

    def step(j: Any, low: Any) -> Any:
        column = _column(a, j) - low @ jnp.conj(jnp.swapaxes(_row(low, j), -1, -2))
        diagonal = jnp.sqrt(_row(column, j).real).astype(a.dtype)
        return jnp.where((rows >= j) & (columns == j), jnp.where(rows == j, diagonal, column / diagonal), low)

    low = _loop(n, step, jnp.zeros_like(a))
    failed = jnp.any(~(jnp.diagonal(low, axis1=-2, axis2=-1).real > 0), axis=-1)[..., None, None]
    return [jnp.where(failed, jnp.full_like(low, np.nan), low)]


_WIDE_DOT = _wide_accumulator(lax.dot_general_p)


def _dot_general(lhs: Any, rhs: Any, *, dimension_numbers: Any, **params: Any) -> list[Any]:
    """A dot that contracts an axis of length 0 is zeros, which IREE does not compile (``x.T @ x`` for an
    ``x`` of no rows); any other goes on to the 16-bit accumulator above."""
    (lhs_contracting, _), _ = dimension_numbers
    if any(lhs.shape[axis] == 0 for axis in lhs_contracting):
        out = jax.eval_shape(lambda a, b: lax.dot_general_p.bind(a, b, dimension_numbers=dimension_numbers,
                                                                 **params), lhs, rhs)
        return [lax.full(out.shape, 0, out.dtype)]
    return _WIDE_DOT(lhs, rhs, dimension_numbers=dimension_numbers, **params)


REWRITES: dict[str, Callable[..., list[Any]]] = {
    "select_and_scatter_add": _select_and_scatter_add,
    "lu": _lu,
    "triangular_solve": _triangular_solve,
    "cholesky": _cholesky,
    "fft": _fft,
    "atan2": _atan2,
    "dot_general": _dot_general,
    "conv_general_dilated": _wide_accumulator(lax.conv_general_dilated_p),
    "sin": _odd(lax.sin_p),
    "tan": _odd(lax.tan_p),
    "cbrt": _cbrt,
    "digamma": _digamma,
    "pow": _pow,
    "top_k": _top_k,
    "convert_element_type": _convert,
    "gather": _gather,
    "scatter": _scatter(lax.scatter_p),
    "scatter-add": _scatter(lax.scatter_add_p),
    "scatter-mul": _scatter(lax.scatter_mul_p),
    "scatter-min": _scatter(lax.scatter_min_p),
    "scatter-max": _scatter(lax.scatter_max_p),
    "sort": _sort,
}

__all__ = ["UNSUPPORTED", "explicit"]
