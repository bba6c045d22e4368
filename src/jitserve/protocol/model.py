"""A served model as the network sees it: its tensors' names, datatypes and shapes, and how a request's
tensors become what it runs.

A :class:`ModelSpec` describes a :class:`~jitserve.Serving`: its input names,
datatypes and per-row shapes (from the serving's ``input_template``; -1 for
the batch axis) and its outputs. It turns decoded request tensors into a
:class:`jitserve.Batch` and outputs into named arrays. Input names are the
dict keys of an entry, else ``input`` (``input_0``, ``input_1``, ... for a
tuple); outputs likewise with ``output``. A :class:`GenerationSpec` describes a
:class:`~jitserve.Generation`: a prompt in, an output per step.

Both give the network service the same four things: ``ask`` (a request's
tensors and parameters, checked, as what the model's front takes: the
engine's typed request), ``call`` and ``stream`` (its named outputs, through
the front's entry points of the same names), ``rows`` and ``labels``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from .. import compilers
from ..batch import Batch
from ..errors import OptionError, ProtocolError
from ..serving.corridor import Rows
from ..serving.generation import GenerationFront, Prompt, stacked, stop_text
from ..serving.server import Server
from ..template import Template, is_template
from .codec import BYTES, datatype_of, dtype_of, shown
from .llm import OPTIONAL_INPUTS, PROMPT, PROMPT_CHARS_PER_TOKEN, SAMPLING, prompt_chars, read_fields


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
    """A tensor of a model: ``row_shape``, the shape of one row, which metadata gives after the batch axis
    (-1) unless the model has none (``batched`` False: a generation's, whose ``max_batch_size`` is 0); an
    ``optional`` input may be left out."""

    name: str
    datatype: str
    row_shape: tuple[int, ...]
    optional: bool = False
    batched: bool = True

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype,
                "shape": [-1, *self.row_shape] if self.batched else list(self.row_shape)}

    def config(self) -> dict[str, Any]:
        """The tensor in Triton's model configuration: ``dims`` without the batch axis (Triton calls BYTES
        ``TYPE_STRING`` there)."""
        config = {"name": self.name, "data_type": "TYPE_STRING" if self.datatype == BYTES else "TYPE_" + self.datatype,
                  "dims": list(self.row_shape)}
        return {**config, "optional": True} if self.optional else config


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
        self._single = next(iter(self._expected.items())) if self._one_array and len(self._expected) == 1 else None
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

    @property
    def labels(self) -> Mapping[str, Sequence[str]] | None:
        """The class labels of its outputs (for Triton's classification)."""
        return self.server.serving.labels

    @staticmethod
    def rows(tensors: Mapping[str, np.ndarray]) -> int:
        """A request's rows, as the access log counts them: its first input's first axis."""
        first = next(iter(tensors.values()), None)
        return 0 if first is None or first.ndim == 0 else int(first.shape[0])

    def ask(self, tensors: Mapping[str, np.ndarray], parameters: Mapping[str, Any], priority: int | None,
            timeout: float | None, streaming: bool) -> Rows:
        """What a request asks the serving: its tensors' value (:meth:`value`) at ``priority``, given up after
        ``timeout`` before its rows start; ``streaming``: the call answers more than once (a stream), which a
        serving that streams its results needs."""
        value = self.value(tensors)
        if self.server.serving.streaming and not streaming:
            raise ProtocolError(f"model '{self.name}' streams its results: call it with ModelStreamInfer (gRPC) or "
                                f"POST /v2/models/{self.name}/infer_stream (HTTP, server-sent events)")
        return Rows(value, timeout, priority)

    async def call(self, ask: Rows) -> list[tuple[str, np.ndarray]]:
        """The named outputs of what ``ask`` asks."""
        return self.named_outputs(await self.server.call_async(ask))

    async def stream(self, ask: Rows) -> AsyncIterator[list[tuple[str, np.ndarray]]]:
        """The named outputs of ``ask`` as they are ready (queued once awaited: its errors raise here)."""
        return self._named(await self.server.open_stream(ask))

    async def _named(self, items: AsyncGenerator[Any, None]) -> AsyncIterator[list[tuple[str, np.ndarray]]]:
        async for outputs in items:
            yield self.named_outputs(outputs)

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
        if self._single is not None and len(tensors) == 1:  # the common case, checked in a few comparisons
            name, (spec, dtype) = self._single
            array = tensors.get(name)
            if array is not None and array.dtype == dtype and array.ndim and array.shape[1:] == spec.row_shape \
                    and array.shape[0]:
                return Batch.concatenate([array])
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


@dataclass(frozen=True)
class Asked:
    """What one generation request asks: of the generation's front, a :class:`Prompt`; of the network,
    whether its answer comes whole (a streaming call's request that says ``stream`` false: the whole text in
    one response) and the text that comes first (the prompt's, where a text generation's
    ``exclude_input_in_output`` is false)."""

    prompt: Prompt
    whole: bool = False
    echo: str = ""


class GenerationSpec:
    """A :class:`~jitserve.Generation` as the network sees it (Triton's decoupled model, ``max_batch_size``
    0): a prompt in, an output per step. A token generation takes one input, ``prompt`` (a prompt's token
    ids, INT32 or INT64, shaped ``[n]`` or ``[1, n]``), answers ``output`` once per step (shaped ``[1, ...]``:
    the one sequence), and takes as parameters how long to go, ``max_steps`` (default ``DEFAULT_STEPS``,
    vLLM's), how to pick tokens (``temperature``, ``top_k``, ``top_p``, ``seed``; a ``logits=True``
    generation) and where its text ends (``stop``, a text ``postprocess``'s; see
    :class:`~jitserve.serving.generation.StopText`). A generation with a ``preprocess`` takes the prompt as
    it comes (a BYTES tensor of one element: that element, the text), and one with a ``postprocess``
    answers what it gives per output (BYTES for bytes or str), its datatype and shape learnt at start from
    the ``postprocess`` of a zero output.

    A text generation (one with a ``detokenizer``: a checkpoint's) speaks Triton's LLM convention: input
    ``text_input`` (BYTES, dims ``[1]``), output ``text_output`` (BYTES: a piece per streamed response, the
    whole text otherwise), and the fields of :data:`jitserve.protocol.llm.FIELDS` (``max_tokens`` for how
    long to go) as optional inputs, parameters or keys of vLLM's ``sampling_parameters`` input. Its
    metadata lists those inputs, and its config marks them ``optional``, as Triton's vLLM and TensorRT-LLM
    models do, so that perf_analyzer (genai-perf's) sends them. Anything else is refused by name."""

    DEFAULT_STEPS = 16

    def __init__(self, name: str, server: GenerationFront, version: str = "1") -> None:
        self.name = name
        self.version = version
        self.server = server
        generation = server.generation
        output = server.output_template
        self.text = generation.detokenizer is not None
        self.input_name, self.output_name = (PROMPT, "text_output") if self.text else ("prompt", "output")
        self.steps_parameter = "max_tokens" if self.text else "max_steps"
        if self.text:
            self.inputs = [TensorSpec(PROMPT, BYTES, (1,), batched=False),
                           *(TensorSpec(name, datatype, dims, optional=True, batched=False)
                             for name, (datatype, dims) in OPTIONAL_INPUTS.items())]
        else:
            self.inputs = [TensorSpec("prompt", "INT32" if generation.preprocess is None else BYTES, (-1,),
                                      batched=False)]
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
                "max_batch_size": 0, "input": [t.config() for t in self.inputs],
                "output": [t.config() for t in self.outputs], "model_transaction_policy": {"decoupled": True},
                "parameters": {name: {"string_value": str(value)} for name, value in parameters.items()}}

    labels = None  # a generation's outputs have no class labels

    @staticmethod
    def rows(tensors: Mapping[str, np.ndarray]) -> int:
        """A request's rows, as the access log counts them: a prompt is one."""
        return 1

    def ask(self, tensors: Mapping[str, np.ndarray], parameters: Mapping[str, Any], priority: int | None,
            timeout: float | None, streaming: bool) -> Asked:
        """What a request asks (:class:`Asked`), checked (the prompt itself by the generation's front);
        ``streaming``: the call answers more than once (a stream), else once (``infer``, which refuses
        ``stream`` true). ``timeout``: how long its prompt may wait for a slot."""
        if priority is not None:
            raise ProtocolError(f"model '{self.name}' is a generation: it admits prompts in arrival order and has "
                                f"no priority levels; send no 'priority' parameter")
        if self.input_name not in tensors or (not self.text and len(tensors) > 1):
            takes = "(BYTES: the prompt's text)" if self.text else "(INT32 or INT64 token ids)"
            raise ProtocolError(f"model '{self.name}' takes {'the' if self.text else 'one'} input, "
                                f"'{self.input_name}' {takes}; got "
                                f"{', '.join(repr(shown(name)) for name in tensors) or 'none'}")
        fields = read_fields(self.name, self.text, {name: array for name, array in tensors.items()
                                                    if name != self.input_name}, parameters)
        prompt = tensors[self.input_name]
        generation = self.server.generation
        if generation.preprocess is not None:  # it checks the prompt, and the server its token ids
            prompt = prompt.reshape(-1)[0] if prompt.dtype.kind == "O" and prompt.size == 1 else prompt
            longest = prompt_chars(generation.max_length)
            if self.text and isinstance(prompt, bytes | str) and len(prompt) > longest:
                raise ProtocolError(f"input '{self.input_name}' is {len(prompt):,} bytes long; model '{self.name}' "
                                    f"takes at most {longest:,} ({PROMPT_CHARS_PER_TOKEN} per token of its "
                                    f"max_length): shorten it")
        elif prompt.dtype.kind not in "iu":
            raise ProtocolError(f"input 'prompt' has datatype {datatype_of(prompt.dtype)}, but model "
                                f"'{self.name}' expects INT32 or INT64 token ids")
        elif prompt.ndim == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if generation.preprocess is None and prompt.ndim != 1:
            raise ProtocolError(f"input 'prompt' has shape {list(tensors['prompt'].shape)}; model '{self.name}' "
                                f"takes one prompt per request, shaped [n] or [1, n]")
        try:
            sampling = generation.sampling(**{key: fields[key] for key in SAMPLING if key in fields})
        except OptionError as error:
            raise ProtocolError(f"a sampling parameter: {error}") from None
        try:
            stop_text(generation, fields.get("stop"))
        except OptionError as error:
            raise ProtocolError(f"the 'stop' parameter: {error}") from None
        stream = fields.get("stream")
        if stream and not streaming:
            raise ProtocolError(f"model '{self.name}': 'stream' true asks for a response per token, which infer "
                                f"does not give; send the request over ModelStreamInfer (gRPC) or to infer_stream "
                                f"or generate_stream (HTTP)")
        echo = "" if fields.get("exclude_input_in_output", True) else \
            prompt.decode(errors="replace") if isinstance(prompt, bytes) else str(prompt)
        steps = fields.get(self.steps_parameter, self.DEFAULT_STEPS)
        return Asked(Prompt(prompt, steps, sampling, fields.get("stop"), timeout), streaming and stream is False, echo)

    async def call(self, asked: Asked) -> list[tuple[str, np.ndarray]]:
        """The whole answer: the outputs stacked; a text generation's text as one string, after its echo."""
        answer = await self.server.call_async(asked.prompt)
        return [(self.output_name, stacked([asked.echo + answer]) if self.text else answer)]

    async def stream(self, asked: Asked) -> AsyncIterator[list[tuple[str, np.ndarray]]]:
        """The request queued once awaited (its text tokenized off the event loop; its errors raise here,
        before a response starts); its outputs as they come, one ``[("output", array)]`` per step, or the
        whole text at once where ``asked.whole``."""
        return self._outputs(await self.server.open_stream(asked.prompt), asked.echo, asked.whole)

    async def _outputs(self, items: AsyncGenerator[Any, None], echo: str, whole: bool
                       ) -> AsyncIterator[list[tuple[str, np.ndarray]]]:
        try:
            if whole:
                yield [(self.output_name, stacked([echo + "".join([item async for item in items])]))]
                return
            async for item in items:
                yield [(self.output_name, stacked([echo + item if echo else item]))]
                echo = ""
            if echo:  # no text came: the prompt alone
                yield [(self.output_name, stacked([echo]))]
        finally:
            await items.aclose()


Spec = ModelSpec | GenerationSpec  # a served model as the network sees it
# what a model's front asks -> the spec of the model (given its name, the front and its version): a new kind of
# servable is an entry
SPECS: dict[type, Callable[[str, Any, str], Spec]] = {Rows: ModelSpec, Prompt: GenerationSpec}
