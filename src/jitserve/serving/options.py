"""What a :class:`~jitserve.serving.serving.Serving` is given: the frozen record of its options, and the
checks that turn each into what the serving uses (an :class:`OptionError` naming the option otherwise).

The checks are shared with generation servings and the network's options: a
count is a positive whole number, a time a finite number of seconds.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import OptionError

OVERSIZE_MODES = ("split", "error")
ISOLATION_MODES = ("thread", "process")


QUEUE_POLICY_KEYS = ("max_queue", "timeout")


def finite_number(value: Any) -> bool:
    """Whether ``value`` is a real, finite number (a bool is not one; NaN and the infinities are not finite)."""
    return not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating)) \
        and math.isfinite(value)


def count_option(name: str, value: Any, or_none: bool = False) -> int:
    """``value`` as a positive whole number, else an OptionError naming ``name`` (saying that None is allowed
    too, for an option whose caller takes None before asking: see :func:`optional_count`)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise OptionError(f"{name} must be a positive integer{' or None' if or_none else ''}, got {value!r}")
    return int(value)


def seconds_option(name: str, value: Any, zero: bool = True, or_none: bool = False) -> float:
    """``value`` as a finite number of seconds, >= 0 (> 0 unless ``zero``), else an OptionError naming
    ``name``: a NaN, infinite or negative wait would wait forever, or never (``or_none``: see
    :func:`optional_seconds`)."""
    if not finite_number(value) or value < 0 or (value == 0 and not zero):
        raise OptionError(f"{name} must be a finite number of seconds {'>=' if zero else '>'} 0"
                          f"{' or None' if or_none else ''}, got {value!r}")
    return float(value)


def check_labels(labels: Any) -> dict[str, tuple[str, ...]]:
    """``labels`` (output name -> the label of each class index) as a dict of tuples, else an OptionError."""
    if labels is None:
        return {}
    if not isinstance(labels, Mapping) or not all(
            isinstance(name, str) and not isinstance(names, (str, bytes)) and isinstance(names, Sequence)
            and all(isinstance(label, str) for label in names) for name, names in labels.items()):
        raise OptionError(f"labels must map an output's name to its class labels (a list of strings), "
                          f"e.g. {{'output': ['cat', 'dog']}}; got {labels!r:.80}")
    return {name: tuple(names) for name, names in labels.items()}


def check_wire(wire: Any) -> dict[str, dict[str, tuple[str, tuple[int, ...]]]]:
    """``wire`` ({"inputs": {name: (datatype, per-row shape)}, "outputs": {...}}) with tuples, else an
    OptionError."""
    if wire is None:
        return {}
    try:
        if set(wire) - {"inputs", "outputs"}:
            raise TypeError
        return {side: {str(name): (str(datatype), tuple(int(n) for n in shape))
                       for name, (datatype, shape) in tensors.items()} for side, tensors in wire.items()}
    except (TypeError, ValueError, AttributeError):
        raise OptionError(f"wire must map 'inputs' and 'outputs' to {{name: (datatype, per-row shape)}}, e.g. "
                          f"{{'inputs': {{'text': ('BYTES', ())}}}}; got {wire!r:.80}") from None


def optional_count(name: str, value: Any) -> int | None:
    """None, or ``value`` checked by :func:`count_option`."""
    return None if value is None else count_option(name, value, or_none=True)


def optional_seconds(name: str, value: Any) -> float | None:
    """None, or ``value`` checked by :func:`seconds_option` (>= 0)."""
    return None if value is None else seconds_option(name, value, or_none=True)


def queue_policy(level: Any, policy: Mapping[str, Any]) -> dict[str, Any]:
    """One level's queue policy (Triton's per-level ``queue_policy``): ``max_queue`` rows, default ``timeout``."""
    unknown = sorted(set(policy) - set(QUEUE_POLICY_KEYS))
    if unknown:
        raise OptionError(f"priority_queues[{level!r}] has unknown key {unknown[0]!r}; expected "
                          f"{', '.join(QUEUE_POLICY_KEYS)}")
    checked: dict[str, Any] = {}
    if "max_queue" in policy:
        checked["max_queue"] = optional_count(f"priority_queues[{level!r}]['max_queue']", policy["max_queue"])
    if "timeout" in policy:
        checked["timeout"] = optional_seconds(f"priority_queues[{level!r}]['timeout']", policy["timeout"])
    return checked


def powers_of_two_up_to(limit: int, start: int = 1) -> list[int]:
    """The powers of two from ``start`` below ``limit``, then ``limit``: the default compiled sizes (a
    serving's batch sizes, a generation's prompt lengths and prompt counts, an encoder's text lengths)."""
    sizes = [size for size in (1 << k for k in range(limit.bit_length() + 1)) if start <= size < limit]
    return [*sizes, limit]


def check_batch_sizes(batch_size: int, batch_sizes: Sequence[int] | None) -> list[int]:
    count_option("batch_size", batch_size)
    if batch_sizes is None:
        return powers_of_two_up_to(batch_size)
    sizes = sorted(set(count_option(f"each of batch_sizes {list(batch_sizes)}", s) for s in batch_sizes))
    if not sizes or sizes[-1] != batch_size:
        raise OptionError(
            f"batch_sizes must be positive and end at batch_size ({batch_size}), got {list(batch_sizes)}"
        )
    return sizes


@dataclasses.dataclass(frozen=True)
class ServingOptions:
    """The arguments a Serving was built from, as given (the serving's attributes hold their checked
    forms; its signature holds the defaults); ``compiler_options`` are the keyword arguments left for the
    compiler. :meth:`arguments` gives them back as keyword arguments of ``Serving``."""

    fn: Callable[..., Any]
    params: Any
    batch_size: int
    batch_timeout: float
    batch_sizes: Sequence[int] | None
    oversize: str
    partitions: int
    max_queue: int | None
    input_template: Any
    preprocess: Callable[[Any], Any] | None
    postprocess: Callable[..., Any] | None
    compiler: str | None
    isolation: str | None
    batch_keys: Sequence[Any] | None
    priority_levels: int
    default_priority: int | None
    priority_aging: float
    priority_queues: Mapping[int, Mapping[str, Any]] | None
    adaptive: bool
    streaming: bool
    isolate_failures: bool
    labels: Mapping[str, Sequence[str]] | None
    wire: Mapping[str, Any] | None
    compiler_options: Mapping[str, Any]

    def arguments(self) -> dict[str, Any]:
        """Every option as a keyword argument of ``Serving`` (the compiler's options flattened in)."""
        return {**{name: getattr(self, name) for name in _OPTION_FIELDS}, **self.compiler_options}

    def changed(self, changes: Mapping[str, Any]) -> ServingOptions:
        """A copy with ``changes`` (Serving keyword arguments; the compiler's among them) applied; a new
        ``batch_size`` without ``batch_sizes`` drops explicit ``batch_sizes``."""
        own = {name: value for name, value in changes.items() if name in _OPTION_FIELDS}
        if "batch_size" in changes and "batch_sizes" not in changes:
            own["batch_sizes"] = None
        compiler = {name: value for name, value in changes.items() if name not in _OPTION_FIELDS}
        return dataclasses.replace(self, **own, compiler_options=types.MappingProxyType(
            {**self.compiler_options, **compiler}))


_OPTION_FIELDS = tuple(field.name for field in dataclasses.fields(ServingOptions) if field.name != "compiler_options")
