"""A served model as the network sees it: its tensors' names, datatypes and shapes, and how a request's
tensors become what it runs.

A :class:`ModelSpec` describes a :class:`~jitserve.Serving`: its input names,
datatypes and per-row shapes (from the serving's ``input_template``; -1 for
the batch axis) and its outputs. It turns decoded request tensors into a
:class:`jitserve.Batch` and outputs into named arrays. Input names are the
dict keys of an entry, else ``input`` (``input_0``, ``input_1``, ... for a
tuple); outputs likewise with ``output``. A :class:`GenerationSpec` describes a
:class:`~jitserve.Generation`: a prompt in, an output per step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from .. import compilers
from ..batch import Batch
from ..errors import OptionError, ProtocolError
from ..serving.generation import Delivery, GenerationFront, Sampling, stacked
from ..serving.server import Server
from ..template import Template, is_template
from .codec import BYTES, datatype_of, dtype_of


def _tensor_names(tree: Any, prefix: str) -> list[str]:
    """Names of the leaves of a structure: dict keys, ``prefix`` for one array, ``prefix_i`` for tuples."""
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=is_template)[0]]
    names = []
    for path in paths:
        parts = [str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path]
        if not parts:
            names.append(prefix)
        elif hasattr(path[0], "idx"):
            names.append("_".join([prefix, *parts]))
        else:
            names.append(".".join(parts))
    return names


def _computed_dtype(serving: Any, dtype: np.dtype) -> np.dtype:
    """The dtype a compiled serving computes an input in: without x64, JAX turns 64-bit types into 32-bit
    ones, so the model says INT32 / FP32 and 64-bit requests are refused instead of silently cut."""
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype)) if serving.compiles else np.dtype(dtype)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    row_shape: tuple[int, ...]

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": [-1, *self.row_shape]}

    def config(self) -> dict[str, Any]:
        """The tensor in Triton's model configuration: ``dims`` without the batch axis (Triton calls BYTES
        ``TYPE_STRING`` there)."""
        return {"name": self.name, "data_type": "TYPE_STRING" if self.datatype == BYTES else "TYPE_" + self.datatype,
                "dims": list(self.row_shape)}


class ModelSpec:
    """A served model as the network sees it."""

    def __init__(self, name: str, server: Server, version: str = "1") -> None:
        self.name = name
        self.version = version
        self.server = server
        serving = server.serving
        self._input_tree: Any = None
        self.inputs: list[TensorSpec] = []
        self._preprocess = serving.preprocess is not None  # it takes the request's tensors as they come
        if serving.input_template is not None and not self._preprocess:
            leaves, self._input_tree = jax.tree_util.tree_flatten(serving.input_template)
            self.inputs = [TensorSpec(n, datatype_of(_computed_dtype(serving, t.dtype)), t.shape)
                           for n, t in zip(_tensor_names(serving.input_template, "input"), leaves)]
        declared = serving.wire  # what a preprocess and postprocess take and give, as the serving says
        self.inputs = [TensorSpec(n, *spec) for n, spec in declared.get("inputs", {}).items()] or self.inputs
        self._expected = {t.name: (t, dtype_of(t.name, t.datatype)) for t in self.inputs}
        self._one_array = self._input_tree is not None and self._input_tree.num_nodes == 1  # no pytree to build
        self._outputs: list[TensorSpec] | None = [TensorSpec(n, *spec) for n, spec in
                                                  declared.get("outputs", {}).items()] or None
        self._output_names: dict[Any, list[str]] = {}  # output structure -> its leaves' names

    @property
    def outputs(self) -> list[TensorSpec]:
        """Output names, datatypes and per-row shapes, worked out once from a batch of one row."""
        if self._outputs is None:
            known = self._input_tree is not None and self.server.serving.postprocess is None
            self._outputs = self._infer_outputs() if known else []
        return self._outputs

    def _infer_outputs(self) -> list[TensorSpec]:
        serving = self.server.serving
        one_row = jax.tree_util.tree_map(lambda t: Template((1, *t.shape), t.dtype), serving.input_template,
                                         is_leaf=is_template)
        fn = serving.batch_function(None if serving.batch_keys is None else serving.batch_keys[0])
        shapes = compilers.get(serving.compiler_name).output_shapes(fn, serving.arguments(one_row))
        if serving.streaming:  # a generator of steps: each step is shaped like the first
            shapes = next(iter(shapes))
        leaves = jax.tree_util.tree_leaves(shapes)
        return [TensorSpec(n, datatype_of(leaf.dtype), tuple(leaf.shape[1:]))
                for n, leaf in zip(_tensor_names(shapes, "output"), leaves)]

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "versions": [self.version], "platform": "jitserve",
                "inputs": [t.metadata() for t in self.inputs], "outputs": [t.metadata() for t in self.outputs]}

    def config(self) -> dict[str, Any]:
        """Triton's model configuration (its JSON form; the gRPC ``ModelConfig`` has the same fields):
        ``max_batch_size``, the inputs and outputs with per-row ``dims``, and the dynamic batching settings."""
        serving = self.server.serving
        batching: dict[str, Any] = {"preferred_batch_size": list(serving.batch_sizes),
                                    "max_queue_delay_microseconds": int(serving.batch_timeout * 1e6)}
        if serving.priority_levels > 1:
            batching.update(priority_levels=serving.priority_levels, default_priority_level=serving.default_priority)
        return {"name": self.name, "platform": "jitserve", "backend": f"jitserve-{serving.compiler_name}",
                "max_batch_size": serving.batch_size, "input": [t.config() for t in self.inputs],
                "output": [t.config() for t in self.outputs], "dynamic_batching": batching}

    def value(self, tensors: Mapping[str, np.ndarray]) -> Any:
        """What a request's tensors give the serving: for one with ``preprocess``, the tensors as they came
        (one array, or a dict by name when there are several), which ``preprocess`` checks and batches;
        else one batch (:meth:`to_batch`)."""
        if not self._preprocess:
            return self.to_batch(tensors)
        if not tensors:
            raise ProtocolError(f"the request has no inputs; model '{self.name}' expects at least one")
        if self._expected and tensors.keys() != self._expected.keys():
            self._refuse_names(tensors)
        return next(iter(tensors.values())) if len(tensors) == 1 else dict(tensors)

    def to_batch(self, tensors: Mapping[str, np.ndarray]) -> Batch:
        """The request's tensors (by name, batch on axis 0) as one batch, checked against the inputs."""
        if not tensors:
            raise ProtocolError(f"the request has no inputs; model '{self.name}' expects "
                                f"{', '.join(t.name for t in self.inputs) or 'at least one'}")
        if self._input_tree is None:
            arrays = list(tensors.values())
            entry: Any = arrays[0] if len(arrays) == 1 else dict(tensors)
        else:
            if tensors.keys() != self._expected.keys():
                self._refuse_names(tensors)
            arrays = []
            for name, (spec, dtype) in self._expected.items():
                array = tensors[name]
                if array.dtype != dtype:
                    narrowed = " (it computes without 64-bit types: run the server with JAX_ENABLE_X64=1 for them)" \
                        if array.dtype.kind in "iuf" and array.dtype.itemsize == 8 and dtype.itemsize == 4 else ""
                    raise ProtocolError(f"input '{name}' has datatype {datatype_of(array.dtype)}, "
                                        f"but model '{self.name}' expects {spec.datatype}{narrowed}")
                if array.ndim == 0 or array.shape[1:] != spec.row_shape:
                    raise ProtocolError(f"input '{name}' has shape {list(array.shape)}, but model "
                                        f"'{self.name}' expects {[-1, *spec.row_shape]}")
                arrays.append(array)
            entry = arrays[0] if self._one_array else jax.tree_util.tree_unflatten(self._input_tree, arrays)
        if any(a.ndim == 0 for a in arrays):
            raise ProtocolError("inputs need a batch axis (axis 0 holds the rows); got a scalar")
        if any(a.dtype.kind == "O" for a in arrays):
            raise ProtocolError(f"model '{self.name}' computes on numbers and has no preprocess to turn BYTES "
                                f"inputs into them; send numeric tensors")
        rows = {a.shape[0] for a in arrays}
        if len(rows) != 1:
            raise ProtocolError(f"all inputs must have the same batch size (axis 0); got {sorted(rows)}")
        if 0 in rows:
            raise ProtocolError("the inputs hold no rows (batch size 0); send at least one")
        return Batch.concatenate([entry])

    def _refuse_names(self, tensors: Mapping[str, np.ndarray]) -> None:
        """The request's input names differ from the model's: say which one is unknown or missing."""
        unknown = sorted(set(tensors) - set(self._expected))
        if unknown:
            raise ProtocolError(f"unknown input '{unknown[0]}' for model '{self.name}'; "
                                f"expected: {', '.join(self._expected)}")
        missing = [n for n in self._expected if n not in tensors]
        raise ProtocolError(f"model '{self.name}' needs input '{missing[0]}', which the request lacks")

    def named_outputs(self, outputs: Any) -> list[tuple[str, np.ndarray]]:
        """The outputs as (name, array) pairs; the names of an output structure are worked out once."""
        if type(outputs) is np.ndarray:
            return [("output", outputs)]
        leaves, structure = jax.tree_util.tree_flatten(outputs)
        names = self._output_names.get(structure)
        if names is None:
            names = self._output_names[structure] = _tensor_names(outputs, "output")
        return list(zip(names, (np.asarray(leaf) for leaf in leaves)))


def select_outputs(outputs: Sequence[tuple[str, np.ndarray]], requested: Mapping[str, int] | None, model: str,
                   labels: Mapping[str, Sequence[str]] | None = None) -> list[tuple[str, np.ndarray]]:
    """The outputs the request asked for (all when it names none), each as it is or, when asked for with a
    classification count, as its top classes (:func:`classify`, with the serving's ``labels`` of it)."""
    if not requested:
        return list(outputs)
    available = dict(outputs)
    unknown = [n for n in requested if n not in available]
    if unknown:
        raise ProtocolError(f"unknown output '{unknown[0]}' for model '{model}'; it has: {', '.join(available)}")
    return [(name, classify(available[name], count, (labels or {}).get(name), name) if count else available[name])
            for name, count in requested.items()]


def class_count(value: Any, where: str) -> int:
    """A requested output's ``classification`` parameter: how many classes to return (0: the tensor)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ProtocolError(f"{where}: the 'classification' parameter must be a whole number of classes >= 0, "
                            f"got {value!r:.40}")
    return int(value)


def classify(array: np.ndarray, count: int, labels: Sequence[str] | None, name: str) -> np.ndarray:
    """Triton's classification: each row's ``count`` highest values (all of them if fewer), highest first,
    as BYTES ``value:index[:label]`` shaped ``[rows, count]``; a value as C++'s ``std::to_string`` writes it,
    as Triton does (``0.750000``, ``7``); ties in index order."""
    if array.ndim == 0 or array.dtype.kind not in "iuf" or (array.dtype.kind == "f" and array.dtype.itemsize < 4):
        raise ProtocolError(f"output '{name}': class results are not available for a {datatype_of(array.dtype)} "
                            f"output{' without a batch axis' if array.ndim == 0 else ''}; Triton classifies "
                            f"batched integer, FP32 and FP64 outputs")
    rows = array.reshape(array.shape[0], -1)
    key = -rows if rows.dtype.kind == "f" else np.invert(rows)  # highest first; ~x reverses integers, no overflow
    order = np.argsort(key, axis=1, kind="stable")[:, :count]
    shown = "{:f}:{:d}{}" if rows.dtype.kind == "f" else "{:d}:{:d}{}"
    suffixes = [f":{label}" for label in labels or ()]
    classes = np.empty(order.shape, dtype=object)
    classes[...] = [[shown.format(value, index, suffixes[index] if index < len(suffixes) else "").encode()
                     for value, index in zip(values, indices)]
                    for values, indices in zip(np.take_along_axis(rows, order, axis=1).tolist(), order.tolist())]
    return classes


class GenerationSpec:
    """A :class:`~jitserve.Generation` as the network sees it (Triton's decoupled model): one input,
    ``prompt`` (a prompt's token ids, INT32 or INT64, shaped ``[n]`` or ``[1, n]``), and one output,
    ``output``, answered once per step (shaped ``[1, ...]``: the one sequence). The request's parameters
    say how long to go, ``max_steps`` (default ``DEFAULT_STEPS``, vLLM's), and how to pick tokens
    (``temperature``, ``top_k``, ``top_p``, ``seed``; a ``logits=True`` generation) and where its text ends
    (``stop``, one stop sequence; a text generation, see :class:`~jitserve.serving.generation.StopText`).
    A generation with a ``preprocess`` takes the prompt as it comes (a BYTES tensor of one element: that
    element, the text), and one with a ``postprocess`` answers what it gives per output (BYTES for bytes
    or str), its datatype and shape learnt at start from the ``postprocess`` of a zero output.

    A text generation (one with a ``detokenizer``: a checkpoint's) speaks Triton's LLM convention, as
    genai-perf and Triton's TensorRT-LLM and vLLM back ends do: input ``text_input`` (BYTES), output
    ``text_output`` (BYTES: a piece per streamed response, the whole text otherwise), parameters
    ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed`` and ``stop``; any other is refused by
    name."""

    DEFAULT_STEPS = 16
    SAMPLING = ("temperature", "top_k", "top_p", "seed")
    TEXT_PARAMETERS = ("max_tokens", *SAMPLING, "stop")
    PROTOCOL_PARAMETERS = ("binary_data_output", "priority", "timeout", "triton_enable_empty_final_response")

    def __init__(self, name: str, server: GenerationFront, version: str = "1") -> None:
        self.name = name
        self.version = version
        self.server = server
        generation = server.generation
        output = server.output_template
        self.text = generation.detokenizer is not None
        self.input_name, self.output_name = ("text_input", "text_output") if self.text else ("prompt", "output")
        self.steps_parameter = "max_tokens" if self.text else "max_steps"
        self.inputs = [TensorSpec(self.input_name, "INT32" if generation.preprocess is None else BYTES, ())]
        if generation.postprocess is not None or self.text:
            sample = stacked(["" if self.text else generation.output_of(output.zeros())])
            output = Template(sample.shape[1:], sample.dtype)
        self.outputs = [TensorSpec(self.output_name, datatype_of(output.dtype), output.shape)]

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "versions": [self.version], "platform": "jitserve",
                "inputs": [t.metadata() for t in self.inputs], "outputs": [t.metadata() for t in self.outputs]}

    def config(self) -> dict[str, Any]:
        """Triton's model configuration of a decoupled model: no batching the client sees; one response per
        step; its slots and longest sequence as parameters (Triton's are strings: ``string_value``)."""
        generation = self.server.generation
        parameters = {"slots": generation.slots, "max_length": generation.max_length}
        return {"name": self.name, "platform": "jitserve", "backend": f"jitserve-{generation.compiler_name}",
                "max_batch_size": 0, "input": [{**self.inputs[0].config(), "dims": [-1]}],
                "output": [t.config() for t in self.outputs], "model_transaction_policy": {"decoupled": True},
                "parameters": {name: {"string_value": str(value)} for name, value in parameters.items()}}

    def request(self, tensors: Mapping[str, np.ndarray], parameters: Mapping[str, Any]
                ) -> tuple[np.ndarray, int, Sampling, Delivery]:
        """A request's prompt, ``max_steps``, sampling and what its caller gets (its ``stop`` sequence, a
        text generation's), checked (the prompt's length by the server)."""
        if set(tensors) != {self.input_name}:
            takes = "(BYTES: the prompt's text)" if self.text else "(INT32 or INT64 token ids)"
            raise ProtocolError(f"model '{self.name}' takes one input, '{self.input_name}' {takes}; got "
                                f"{', '.join(repr(name) for name in tensors) or 'none'}")
        if self.text:
            unknown = sorted(set(parameters) - {*self.TEXT_PARAMETERS, *self.PROTOCOL_PARAMETERS})
            if unknown:
                raise ProtocolError(f"model '{self.name}' does not take the parameter '{unknown[0]}'; a text "
                                    f"generation takes {', '.join(self.TEXT_PARAMETERS)}")
        prompt = tensors[self.input_name]
        generation = self.server.generation
        if generation.preprocess is not None:  # it checks the prompt, and the server its token ids
            prompt = generation.prompt_of(prompt.reshape(-1)[0] if prompt.dtype.kind == "O" and prompt.size == 1
                                          else prompt)
        elif prompt.dtype.kind not in "iu":
            raise ProtocolError(f"input 'prompt' has datatype {datatype_of(prompt.dtype)}, but model "
                                f"'{self.name}' expects INT32 or INT64 token ids")
        elif prompt.ndim == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if generation.preprocess is None and prompt.ndim != 1:
            raise ProtocolError(f"input 'prompt' has shape {list(tensors['prompt'].shape)}; model '{self.name}' "
                                f"takes one prompt per request, shaped [n] or [1, n]")
        steps = parameters.get(self.steps_parameter, self.DEFAULT_STEPS)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ProtocolError(f"the '{self.steps_parameter}' parameter must be a positive integer, got {steps!r}")
        try:
            sampling = Sampling(**{key: parameters[key] for key in self.SAMPLING if key in parameters})
        except OptionError as error:
            raise ProtocolError(f"a sampling parameter: {error}") from None
        try:
            delivery = Delivery(generation, parameters.get("stop"), prompt)
        except OptionError as error:
            raise ProtocolError(f"the 'stop' parameter: {error}") from None
        return prompt, steps, sampling, delivery

    def generate(self, tensors: Mapping[str, np.ndarray], parameters: Mapping[str, Any],
                 timeout: float | None) -> AsyncIterator[list[tuple[str, np.ndarray]]]:
        """Check and queue the request now (on the running event loop: its errors raise here, before a
        response starts); its outputs as they come, one ``[("output", array)]`` per step."""
        prompt, steps, sampling, delivery = self.request(tensors, parameters)
        request = self.server.submit(prompt, steps, asyncio.get_running_loop(), sampling)
        return self._outputs(delivery.each_async(self.server.outputs_async(request, timeout)))

    async def _outputs(self, items: AsyncGenerator[Any, None]) -> AsyncIterator[list[tuple[str, np.ndarray]]]:
        try:
            async for item in items:
                yield [(self.output_name, stacked([item]))]
        finally:
            await items.aclose()

    def whole(self, steps: Sequence[list[tuple[str, np.ndarray]]]) -> list[tuple[str, np.ndarray]]:
        """A request's answer at once: its outputs stacked; a text generation's text joined into one."""
        outputs = [step[0][1] for step in steps]
        if self.text:
            return [(self.output_name, stacked(["".join(output[0] for output in outputs)]))]
        return [(self.output_name, np.concatenate(outputs) if outputs else stacked([]))]
