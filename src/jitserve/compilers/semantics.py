"""XLA's semantics that more than one compiler must reproduce: what a ``fill`` gather puts out of range, and
the identities of max and min reductions. The evaluator's primitives and the rewrites that make IREE agree
with XLA (``iree/explicit.py``) both take them from here."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def is_float(dtype: np.dtype) -> bool:
    return bool(jax.dtypes.issubdtype(dtype, np.floating))


def gather_fill(dtype: np.dtype, fill_value: Any) -> Any:
    """What JAX's ``fill`` gather mode puts in out-of-range windows when no ``fill_value`` is given:
    NaN for inexact types, True for bool, the minimum of signed and the maximum of unsigned integers."""
    if fill_value is not None:
        return fill_value
    if jax.dtypes.issubdtype(dtype, np.inexact):
        return np.nan
    if dtype == np.bool_:
        return True
    return np.iinfo(dtype).min if jax.dtypes.issubdtype(dtype, np.signedinteger) else np.iinfo(dtype).max


def max_identity(dtype: np.dtype) -> Any:
    """The value no maximum is below: -inf, the least integer, False."""
    if is_float(dtype):
        return -np.inf
    return False if dtype == np.bool_ else np.iinfo(dtype).min


def min_identity(dtype: np.dtype) -> Any:
    """The value no minimum is above: +inf, the greatest integer, True."""
    if is_float(dtype):
        return np.inf
    return True if dtype == np.bool_ else np.iinfo(dtype).max
