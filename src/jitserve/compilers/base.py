"""The compiler contract every compiler plug-in implements.

A compiler turns a function and input templates into an :class:`Executable`
(``compile``), and says which option sets run it on each device it can use
(``partitions``). ``dispatcher`` gives ``jit`` a callable that compiles per
input signature on first sight; the default keeps one executable per
signature, and a compiler with a faster dispatch of its own (XLA) overrides it.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax

from ..device import Device as Device  # part of the compiler contract; defined below iree
from ..errors import OptionError
from ..template import Template, check_arguments, host_array, is_template, template_of, templates_of

COMMON_OPTIONS = frozenset({"compiler", "cache_dir"})


class Executable:
    """A compiled function for fixed input templates, called with the same pytree of arrays."""

    __slots__ = ("input_templates", "input_tree", "output_container", "run")

    def __init__(
        self,
        run: Callable[..., Any],
        input_templates: list[Template],
        input_tree: Any,
        output_container: Any,
    ) -> None:
        self.run = run  # the unchecked call, for dispatchers that already know the signature
        self.input_templates = input_templates
        self.input_tree = input_tree
        self.output_container = output_container

    def __call__(self, *args: Any) -> Any:
        return self.run(*args)

    def checked_call(self, *args: Any) -> Any:
        """Call after checking every argument against the templates (``TemplateMismatchError``)."""
        leaves = check_arguments(args, self.input_templates, self.input_tree)
        return self.run(*jax.tree_util.tree_unflatten(self.input_tree, leaves))


class Compiler(abc.ABC):
    """A compiler plug-in. Subclasses set ``name`` and ``options`` and implement ``compile`` and ``devices``;
    :func:`jitserve.register_compiler` makes one usable by name everywhere a compiler is chosen.

    ``compiles`` is False for a compiler that runs functions as they are (nothing to count or log). The
    executables of one that compiles must not keep their input arrays past the call: a server's partition
    writes every batch into the same buffers.
    ``default_isolation`` is where a server runs its executables unless the serving says: ``"thread"``
    (in the server's process) or ``"process"`` (a worker process per partition, which a native crash
    cannot take the server down with).
    ``shards`` is True for a compiler that runs one program over several devices (:meth:`compile_sharded`).
    ``pages`` is True for one that runs a paged KV cache's programs (writes through block tables, reads
    gathered by them) as XLA does, checked by a test against XLA's tokens.
    """

    name: ClassVar[str]
    options: ClassVar[frozenset[str]] = frozenset()
    compiles: ClassVar[bool] = True
    default_isolation: ClassVar[str] = "thread"
    shards: ClassVar[bool] = False
    pages: ClassVar[bool] = False

    def check_options(self, options: Mapping[str, Any]) -> None:
        unknown = sorted(set(options) - COMMON_OPTIONS - self.options)
        if unknown:
            accepted = ", ".join(sorted(COMMON_OPTIONS | self.options))
            raise OptionError(
                f"unknown option {unknown[0]!r} for compiler {self.name!r}; it accepts: {accepted}"
            )

    @abc.abstractmethod
    def compile(self, fn: Callable[..., Any], templates: Sequence[Any], options: Mapping[str, Any],
                donate: Sequence[int] = ()) -> Executable:
        """Compile ``fn`` for positional arguments shaped like ``templates`` (pytrees of templates).
        ``donate``: positions of arguments the caller never uses again after the call (a generation's
        decode state), whose buffers a compiler may reuse for the results; one that cannot ignores it."""

    def compile_sharded(self, fn: Callable[..., Any], templates: Sequence[Any], options: Mapping[str, Any],
                        shardings: tuple[Any, Any], donate: Sequence[int] = ()) -> Executable:
        """``fn`` compiled as one program over several devices (tensor parallel): ``shardings`` is the pair
        (of the arguments, of the results) of trees of ``jax.sharding.Sharding`` where each array lies, as
        ``jax.jit``'s ``in_shardings`` and ``out_shardings``. A compiler whose programs run on one device
        refuses."""
        raise OptionError(f"compiler {self.name!r} runs each program on one device; a program over several "
                          f"devices (tensor parallel) needs compiler 'xla'")

    @abc.abstractmethod
    def devices(self) -> list[Device]:
        """Every device this compiler can run on here."""

    def partitions(self, options: Mapping[str, Any]) -> list[dict[str, Any]]:
        """One option set per device: the given device, or every device of the default kind."""
        return [dict(options)]

    def first_run_costs(self, options: Mapping[str, Any]) -> bool:
        """Whether an executable's first run on this option set's device does one-off work (a GPU loads its
        kernels and builds its command buffers; XLA's CPU runtime compiles them), which a warm-up then pays
        by running each program once."""
        return False

    def place(self, tree: Any, options: Mapping[str, Any]) -> Any:
        """``tree``'s arrays resident on the device of this option set, once (a serving's weights), in the
        form its executables take without a copy per call: here host numpy arrays (a memory-mapped array
        stays mapped, not read)."""
        return jax.tree_util.tree_map(host_array, tree)

    def output_shapes(self, fn: Callable[..., Any], templates: Sequence[Any]) -> Any:
        """The shapes and dtypes ``fn`` returns for arguments shaped like ``templates`` (JAX's abstract
        evaluation; a compiler of functions JAX cannot trace overrides it)."""
        abstract = jax.tree_util.tree_map(lambda t: t.abstract(), tuple(templates), is_leaf=is_template)
        return jax.eval_shape(fn, *abstract)

    def dispatcher(
        self, fn: Callable[..., Any], options: Mapping[str, Any], on_compile: Callable[[], None]
    ) -> Callable[..., Any]:
        """A callable that compiles once per input signature and then runs the executable."""
        return SignatureDispatcher(self, fn, options, on_compile)


class SignatureDispatcher:
    """One executable per (pytree structure, leaf shapes and dtypes) of the arguments."""

    __slots__ = ("_compiler", "_fn", "_options", "_on_compile", "_cache", "_lock")

    def __init__(self, compiler: Compiler, fn: Callable[..., Any], options: Mapping[str, Any],
                 on_compile: Callable[[], None]) -> None:
        self._compiler = compiler
        self._fn = fn
        self._options = options
        self._on_compile = on_compile
        self._cache: dict[tuple[Any, ...], Callable[..., Any]] = {}  # signature -> Executable.run
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        try:  # every argument an array: its shapes and dtypes are the key
            key: tuple[Any, ...] = tuple([(x.shape, x.dtype) for x in args])
        except AttributeError:
            leaves, tree = jax.tree_util.tree_flatten(args)
            key = (tree, *[(getattr(x, "shape", ()), getattr(x, "dtype", type(x))) for x in leaves])
        run = self._cache.get(key)
        if run is None:
            run = self._compile(key, args)
        return run(*args)

    def _compile(self, key: tuple[Any, ...], args: tuple[Any, ...]) -> Callable[..., Any]:
        with self._lock:
            run = self._cache.get(key)
            if run is None:
                run = self._cache[key] = self._compiler.compile(self._fn, templates_of(args), self._options).run
                self._on_compile()
        return run


def flat_templates(templates: Sequence[Any]) -> tuple[list[Template], Any]:
    """The flat list of templates of a pytree of templates or values, and its structure."""
    leaves, tree = jax.tree_util.tree_flatten(tuple(templates), is_leaf=is_template)
    return [template_of(leaf) for leaf in leaves], tree
