"""Templates: the shape and dtype of an argument or result, without its data.

A template is what a compiler needs to know about an input ahead of time
(``Nx.template`` in Nx, ``jax.ShapeDtypeStruct`` in JAX). Templates print as
``float32(1000, 1000, 5)``, the form used in error messages.
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from .errors import TemplateMismatchError

_PYTHON_SCALARS = (bool, int, float, complex)


class Template:
    """Shape and dtype of one array. Equal templates hash alike."""

    __slots__ = ("shape", "dtype", "weak_type")

    def __init__(self, shape: tuple[int, ...], dtype: Any, weak_type: bool = False) -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.weak_type = weak_type

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Template)
            and self.shape == other.shape
            and self.dtype == other.dtype
        )

    def __hash__(self) -> int:
        return hash((self.shape, self.dtype))

    def __str__(self) -> str:
        return f"{self.dtype.name}({', '.join(map(str, self.shape))})"

    def __repr__(self) -> str:
        return f"template({self.shape!r}, {self.dtype.name!r})"

    def abstract(self) -> jax.ShapeDtypeStruct:
        """The ``jax.ShapeDtypeStruct`` JAX traces with."""
        return jax.ShapeDtypeStruct(self.shape, self.dtype, weak_type=self.weak_type)

    def zeros(self) -> np.ndarray:
        return np.zeros(self.shape, self.dtype)


def template(shape: tuple[int, ...] | int, dtype: Any = "float32") -> Template:
    """A template of the given shape (a tuple, or an int for one axis) and dtype."""
    if isinstance(shape, int):
        shape = (shape,)
    return Template(shape, dtype)


def template_of(value: Any) -> Template:
    """The template of one array-like leaf (array, Template, ShapeDtypeStruct or Python scalar)."""
    if isinstance(value, Template):
        return value
    if isinstance(value, _PYTHON_SCALARS):
        # Python scalars trace as JAX's weakly typed defaults (float32 unless x64 is on).
        return Template((), jnp.result_type(type(value)), weak_type=True)
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is None or dtype is None:
        value = np.asarray(value)
        shape, dtype = value.shape, value.dtype
    return Template(shape, dtype, weak_type=bool(getattr(value, "weak_type", False)))


def host_array(value: Any) -> np.ndarray:
    """``value`` as a numpy array of its template's dtype: a Python scalar as JAX traces it (``2.0`` is
    float32, not numpy's float64), anything else as ``np.asarray`` gives it."""
    if isinstance(value, _PYTHON_SCALARS):
        return np.asarray(value, template_of(value).dtype)
    return np.asarray(value)


def is_template(value: Any) -> bool:
    """For ``is_leaf=``: a Template is a leaf of a pytree of templates."""
    return isinstance(value, Template)


def templates_of(tree: Any) -> Any:
    """The pytree of templates for a pytree of values or templates."""
    return jax.tree_util.tree_map(template_of, tree, is_leaf=is_template)


def abstract_tree(tree: Any) -> Any:
    """The pytree of ``jax.ShapeDtypeStruct`` for a pytree of values or templates."""
    return jax.tree_util.tree_map(
        lambda leaf: template_of(leaf).abstract(), tree, is_leaf=is_template
    )


def params_template(params: Any) -> Any:
    """The templates of a pytree of weights (arrays of any kind: numpy, memory-mapped, jax)."""
    return templates_of(params)


def check_params(params: Any, expected: Any, root: str = "params") -> Any:
    """``params`` if it has the structure of ``expected`` (a pytree of templates) and each leaf its shape
    and dtype; else a TemplateMismatchError naming the leaf by its path (``params['layers'][3]['w']``)."""
    given, given_tree = jax.tree_util.tree_flatten_with_path(params)
    wanted, wanted_tree = jax.tree_util.tree_flatten_with_path(expected, is_leaf=is_template)
    given_tree = cast(Any, given_tree)  # jaxlib's PyTreeDef compares by value; its stubs do not say so
    if given_tree != wanted_tree:
        given_paths = {jax.tree_util.keystr(path) for path, _ in given}
        wanted_paths = {jax.tree_util.keystr(path) for path, _ in wanted}
        missing = sorted(wanted_paths - given_paths)
        unexpected = sorted(given_paths - wanted_paths)
        differences = [f"missing {root}{path}" for path in missing[:3]] + \
            [f"unexpected {root}{path}" for path in unexpected[:3]]
        raise TemplateMismatchError(f"{root}: expected the structure of the serving's weights, got another "
                                    f"({'; '.join(differences) or f'{given_tree} instead of {wanted_tree}'})")
    for (path, leaf), (_, want) in zip(given, wanted):
        got = template_of(leaf)
        if got != want:
            raise TemplateMismatchError(f"{root}{jax.tree_util.keystr(path)}: expected {want}, got {got}")
    return params


def _argument_name(path: tuple[Any, ...]) -> str:
    position = path[0]
    index = getattr(position, "idx", getattr(position, "key", position))
    return f"argument {index}{jax.tree_util.keystr(path[1:])}"


def _accepts_scalar(value: Any, expected: Template) -> bool:
    if expected.shape != ():
        return False
    kinds = {bool: "b", int: "biuf", float: "fc", complex: "c"}[type(value)]
    return expected.dtype.kind in kinds if type(value) is not bool else expected.dtype.kind == "b"


def check_arguments(args: tuple[Any, ...], expected: list[Template], treedef: Any) -> list[Any]:
    """The flat argument leaves, checked against ``expected``.

    Python scalars are accepted where a scalar template of a compatible kind is
    expected and converted to its dtype. Anything else that differs raises
    :class:`TemplateMismatchError` naming the argument, the expected template
    and the given one.
    """
    leaves, given_tree = jax.tree_util.tree_flatten(args)
    if given_tree != treedef:
        raise TemplateMismatchError(
            f"arguments do not match the compiled structure: expected {treedef}, got {given_tree}"
        )
    for i, (leaf, want) in enumerate(zip(leaves, expected)):
        if isinstance(leaf, _PYTHON_SCALARS) and _accepts_scalar(leaf, want):
            leaves[i] = np.asarray(leaf, want.dtype)
            continue
        if getattr(leaf, "shape", None) != want.shape or getattr(leaf, "dtype", None) != want.dtype:
            _raise_mismatch(args, i, want)
    return leaves


def _raise_mismatch(args: tuple[Any, ...], index: int, want: Template) -> None:
    paths_and_leaves = jax.tree_util.tree_flatten_with_path(args)[0]
    path, leaf = paths_and_leaves[index]
    raise TemplateMismatchError(
        f"{_argument_name(path)}: expected {want}, got {template_of(leaf)}"
    )
