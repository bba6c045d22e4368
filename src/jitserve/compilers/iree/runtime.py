"""IREE from Python, as NxIREE does it from Elixir.

``list_drivers`` and ``list_devices`` show what the runtime can use here;
``compile`` turns StableHLO MLIR into a vmfb with the given flags (through a
cache in memory and on disk, keyed by MLIR, flags and compiler version);
``call`` runs a compiled module's function on a device, after checking the
inputs against the module's own signature. Results are IREE ``DeviceArray``
objects: they stay on the device when passed to another call and become
numpy arrays on demand (``np.asarray``).

Needs the ``iree`` extra: ``pip install 'jitserve[iree]'``.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import iree.compiler as iree_compiler
import iree.compiler.version as iree_version
import iree.runtime as iree_runtime
import jax
import numpy as np

from ...defaults import CACHE_DIR_ENV
from ...device import Device
from ...errors import CompileError, EvaluationError, OptionError, TemplateMismatchError
from ...template import Template, is_template, template_of

DEFAULT_DRIVER = "local-task"

# What IREE's drivers say of themselves; the Python runtime reports only their names.
DRIVER_DESCRIPTIONS: dict[str, str] = {
    "local-sync": "Local execution using a lightweight inline synchronous queue",
    "local-task": "Local execution using the IREE multithreading task system",
    "cuda": "NVIDIA CUDA HAL driver",
    "hip": "AMD HIP HAL driver",
    "vulkan": "Vulkan 1.x (dynamic)",
    "metal": "Apple Metal",
}

# The compiler target backend that produces code for each driver.
TARGET_BACKENDS: dict[str, str] = {
    "local-sync": "llvm-cpu",
    "local-task": "llvm-cpu",
    "cuda": "cuda",
    "hip": "rocm",
    "vulkan": "vulkan-spirv",
    "metal": "metal-spirv",
}

# MLIR element types in IREE's function signatures -> numpy dtypes.
ELEMENT_TYPES: dict[str, str] = {
    "i1": "bool", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
    "si8": "int8", "si16": "int16", "si32": "int32", "si64": "int64",
    "ui8": "uint8", "ui16": "uint16", "ui32": "uint32", "ui64": "uint64",
    "f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
    "complex<f32>": "complex64", "complex<f64>": "complex128",
}

# Flags jitserve adds unless given otherwise, because IREE's defaults change answers:
# - f64 stays f64 (IREE demotes it to f32 by default, silently, and changes the function's signature);
# - neither indirect (reusable) command buffers nor constant expressions hoisted into globals: with either on,
#   IREE 3.x fails at run time on some modules with "OUT_OF_RANGE; indirect buffer reference slot 0 is out of
#   range of the declared binding capacity" (a jax.random key made inside the function from an input seed
#   needs the first off, one made from a constant seed the second); bench/iree_flags.py measures what this costs.
CORRECTNESS_FLAGS: tuple[str, ...] = ("--iree-input-demote-f64-to-f32=false",
                                      "--iree-hal-indirect-command-buffers=false",
                                      "--iree-opt-const-expr-hoisting=false")

# Operations IREE's diagnostics say it cannot lower: what a user wrote to get them, and what to do instead.
LOWERING_GAPS: dict[str, str] = {
    "stablehlo.custom_call": "a call into a host library (on CPU, LAPACK linear algebra: jnp.linalg.solve, inv, det, "
                             "cholesky, svd, eigh, qr, ...); linear algebra needs compiler='xla' or "
                             "compiler='evaluator'",
    "stablehlo.fft": "an FFT IREE cannot lower (it lowers one axis of a power-of-two length in single precision; "
                     "js.jit(..., compiler='iree') rewrites the others, a module compiled as it is keeps them), "
                     "or use compiler='xla' or compiler='evaluator'",
    "stablehlo.triangular_solve": "a triangular solve (jax.scipy.linalg.solve_triangular); "
                                  "linear algebra needs compiler='xla' or compiler='evaluator'",
}

COMPILER_VERSION = f"{iree_version.VERSION}+{iree_version.REVISIONS.get('IREE', '')}"


def list_drivers() -> dict[str, str]:
    """Every driver this IREE runtime was built with: name -> description."""
    return {name: DRIVER_DESCRIPTIONS.get(name, f"IREE HAL driver {name}")
            for name in iree_runtime.query_available_drivers()}


def list_devices(driver: str) -> list[Device]:
    """The devices ``driver`` finds here; ``[]`` when it is installed but finds none (or cannot load)."""
    if driver not in iree_runtime.query_available_drivers():
        raise OptionError(f"unknown IREE driver {driver!r}; this runtime has: {', '.join(list_drivers())}")
    try:
        found = iree_runtime.get_driver(driver).query_available_devices()
    except (RuntimeError, ValueError):  # the driver's library (libcuda, libvulkan, ...) is not here
        return []
    return [
        Device(compiler="iree", driver=driver, id=int(info["device_id"]),
               uri=f"{driver}://{info.get('path') or ''}", description=info.get("name", ""),
               target_backend=TARGET_BACKENDS.get(driver))
        for info in found
    ]


_hal_devices: dict[str, Any] = {}
_hal_lock = threading.Lock()


def device_uri(device: Device | str | None) -> str:
    """The URI of a Device, a URI or a driver name given as ``device``; None is ``local-task://``."""
    if device is None:
        return f"{DEFAULT_DRIVER}://"
    if isinstance(device, Device):
        if device.compiler != "iree":
            raise OptionError(f"device {device.uri} belongs to compiler {device.compiler!r}, not 'iree'")
        return device.uri
    if isinstance(device, str):
        return device if "://" in device else f"{device}://"
    raise OptionError(f"cannot use {device!r} as an IREE device; pass a Device from list_devices or a URI")


def hal_device(device: Device | str | None) -> Any:
    """The runtime's device object for ``device`` (created once per URI)."""
    uri = device_uri(device)
    found = _hal_devices.get(uri)
    if found is None:
        with _hal_lock:
            found = _hal_devices.get(uri)
            if found is None:
                try:
                    found = _hal_devices[uri] = iree_runtime.get_device(uri)
                except (RuntimeError, ValueError) as error:
                    raise OptionError(f"cannot open IREE device {uri!r}: {error}") from None
    return found


def to_device(array: Any, device: Device | str | None = None) -> Any:
    """``array`` copied once into a buffer of ``device`` (an IREE DeviceArray, which calls take as it is,
    without uploading it again)."""
    return iree_runtime.asdevicearray(hal_device(device), np.asarray(array))


def target_backend(device: Device | str | None) -> str:
    driver = device_uri(device).split("://", 1)[0]
    if driver not in TARGET_BACKENDS:
        raise OptionError(f"no known compiler target for IREE driver {driver!r}; pass the flags yourself")
    return TARGET_BACKENDS[driver]


def default_flags(device: Device | str | None) -> list[str]:
    """Flags for StableHLO input and the target backend that fits ``device`` (host CPU for llvm-cpu)."""
    backend = target_backend(device)
    flags = [f"--iree-hal-target-backends={backend}", "--iree-input-type=stablehlo"]
    if backend == "llvm-cpu":
        flags.append("--iree-llvmcpu-target-cpu=host")
    return flags


def _parse_signature(declaration: str) -> list[Template | None]:
    """Input templates from IREE's ``iree.abi.declaration`` (None where a dimension is dynamic)."""
    inputs = declaration.split("->", 1)[0]
    templates: list[Template | None] = []
    for argument in re.findall(r"%\w+: ([^,()]+(?:<[^>]*>)?)", inputs):
        match = re.fullmatch(r"tensor<(.*)>", argument.strip())
        if match is None:
            templates.append(None)
            continue
        *dims, element = match.group(1).split("x")
        dtype = ELEMENT_TYPES.get(element)
        templates.append(None if dtype is None or "?" in dims else Template(tuple(int(d) for d in dims), dtype))
    return templates


@dataclass
class Module:
    """A compiled IREE module: the vmfb, and what it was compiled from."""

    vmfb: bytes
    flags: tuple[str, ...]
    mlir_module: str
    output_container: Any = None
    # keyed by (device as given, name) and by (device URI, name)
    _functions: dict[tuple[Any, str], Callable[..., Any]] = field(default_factory=dict, repr=False)
    _signatures: dict[str, list[Template | None]] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def function(self, device: Device | str | None = None, name: str = "main") -> Callable[..., Any]:
        """The raw runtime function ``name`` on ``device`` (one loaded context per device, cached)."""
        found = self._functions.get((device, name))
        if found is None:
            found = self._functions[(device, name)] = self._load(device, name)
        return found

    def _load(self, device: Device | str | None, name: str) -> Callable[..., Any]:
        key = (device_uri(device), name)
        found = self._functions.get(key)
        if found is None:
            with self._lock:
                found = self._functions.get(key)
                if found is None:
                    context = iree_runtime.SystemContext(config=iree_runtime.Config(device=hal_device(device)))
                    vm_module = iree_runtime.VmModule.copy_buffer(context.instance, self.vmfb)
                    try:
                        context.add_vm_module(vm_module)
                    except RuntimeError as error:
                        targets = [f for f in self.flags if f.startswith("--iree-hal-target")]
                        raise CompileError(
                            f"the module was compiled for {', '.join(targets) or 'another target'} and cannot run on "
                            f"device {key[0]!r}; compile it with iree.default_flags({key[0]!r}) "
                            f"({str(error).splitlines()[0]})") from None
                    if name not in vm_module.function_names:
                        raise OptionError(f"the module has no function {name!r}; it has: "
                                          f"{', '.join(n for n in vm_module.function_names if n != '__init')}")
                    reflection = vm_module.lookup_function(name).reflection
                    self._signatures[name] = _parse_signature(reflection.get("iree.abi.declaration", ""))
                    found = self._functions[key] = context.modules[vm_module.name][name]
        return found

    def input_templates(self, name: str = "main") -> list[Template | None]:
        if name not in self._signatures:
            self.function(None, name)
        return self._signatures[name]

    def __post_init__(self) -> None:
        self._out_tree = (None if self.output_container is None
                          else jax.tree_util.tree_structure(self.output_container))

    def wrap_outputs(self, out: Any) -> Any:
        """The runtime's result shaped like ``output_container`` (as returned when there is none)."""
        if self._out_tree is None:
            return out
        return self._out_tree.unflatten(out if isinstance(out, tuple) else (out,))


class CompileCache:
    """vmfb bytes by hash of MLIR + flags + compiler version: in memory, and as files in a directory."""

    def __init__(self) -> None:
        self.memory: dict[str, bytes] = {}
        self.stats = {"compiles": 0, "memory_hits": 0, "disk_hits": 0}
        self._lock = threading.Lock()

    @staticmethod
    def directory(cache_dir: str | os.PathLike[str] | None) -> Path:
        base = cache_dir or os.environ.get(CACHE_DIR_ENV)
        if base is None:
            base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jitserve"
        return Path(base) / "iree"

    @staticmethod
    def key(mlir_text: str, flags: Sequence[str]) -> str:
        digest = hashlib.sha256(COMPILER_VERSION.encode())
        for part in (mlir_text, *flags):
            digest.update(b"\0" + part.encode())
        return digest.hexdigest()

    def get_or_compile(self, mlir_text: str, flags: Sequence[str], cache_dir: Any) -> bytes:
        key = self.key(mlir_text, flags)
        with self._lock:
            if key in self.memory:
                self.stats["memory_hits"] += 1
                return self.memory[key]
        path = self.directory(cache_dir) / f"{key}.vmfb"
        if path.exists():
            vmfb = path.read_bytes()
            self.stats["disk_hits"] += 1
        else:
            vmfb = _compile_vmfb(mlir_text, flags)
            self.stats["compiles"] += 1
            _write_atomically(path, vmfb)
        with self._lock:
            self.memory[key] = vmfb
        return vmfb


def _compile_vmfb(mlir_text: str, flags: Sequence[str]) -> bytes:
    try:
        return iree_compiler.compile_str(mlir_text, extra_args=list(flags))
    except iree_compiler.CompilerToolError as error:
        raise CompileError(f"{diagnose(str(error), mlir_text)}IREE could not compile the module with flags "
                           f"{list(flags)}:\n{error}") from None


def _failing_operation(diagnostics: str, mlir_text: str) -> str:
    """Name the operation at the line of the module the first error points at (IREE's own words follow)."""
    located = re.search(r"<stdin>:(\d+):\d+: error: ([^\n]*)", diagnostics)
    lines = mlir_text.splitlines()
    if located is None or not 0 < int(located.group(1)) <= len(lines):
        return ""
    operation = re.search(r"\b(stablehlo\.\w+|\w+\.\w+)", lines[int(located.group(1)) - 1].split("=", 1)[-1])
    if operation is None:
        return ""
    return (f"IREE could not compile operation '{operation.group(1)}' (line {located.group(1)} of the module) for "
            f"this target: {located.group(2)}; use compiler='xla' or compiler='evaluator' for this definition.\n")


def diagnose(diagnostics: str, mlir_text: str) -> str:
    """A first line naming the operation IREE could not lower and what to do, where it is a known gap."""
    missing = re.search(r"undefined symbol: (\w+)", diagnostics)
    if missing is not None:
        return (f"IREE's CPU target has no library function {missing.group(1)!r} (float64 math such as sin, tanh "
                f"or pow is missing from it); compute it in float32, or use compiler='xla' or compiler='evaluator'.\n")
    match = re.search(r"failed to legalize operation '([\w.]+)'", diagnostics)
    if match is None or match.group(1) not in LOWERING_GAPS:
        return _failing_operation(diagnostics, mlir_text)
    operation = match.group(1)
    target = re.search(r"custom_call @(\w+)", mlir_text) if operation == "stablehlo.custom_call" else None
    named = f"'{operation}'" + (f" @{target.group(1)}" if target else "")
    return f"IREE cannot compile {LOWERING_GAPS[operation]} (operation {named} has no lowering).\n"


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(handle, "wb") as out:
        out.write(data)
    os.replace(temporary, path)


compile_cache = CompileCache()


def compile(mlir_text: str, flags: Sequence[str] = (), output_container: Any = None,
            cache_dir: str | os.PathLike[str] | None = None) -> Module:
    """Compile StableHLO MLIR with ``flags`` (``iree-compile`` command-line flags).

    Without a target among the flags, the host CPU (``llvm-cpu``) is the target;
    without ``--iree-input-type``, StableHLO is the input. Compiler diagnostics
    raise :class:`jitserve.CompileError`, led by what to do where the failing
    operation is a known gap (:data:`LOWERING_GAPS`). Unless the flags say
    otherwise, :data:`CORRECTNESS_FLAGS` are added. Compiled modules are cached in memory
    and under ``cache_dir`` (default ``$JITSERVE_CACHE_DIR/iree`` or
    ``~/.cache/jitserve/iree``).
    """
    flags = list(flags)
    if not any(f.startswith(("--iree-hal-target-backends", "--iree-hal-target-device")) for f in flags):
        flags += ["--iree-hal-target-backends=llvm-cpu", "--iree-llvmcpu-target-cpu=host"]
    if not any(f.startswith("--iree-input-type") for f in flags):
        flags.append("--iree-input-type=stablehlo")
    flags += [flag for flag in CORRECTNESS_FLAGS if not any(f.startswith(flag.split("=")[0]) for f in flags)]
    vmfb = compile_cache.get_or_compile(mlir_text, flags, cache_dir)
    container = None if output_container is None else jax.tree_util.tree_map(
        template_of, output_container, is_leaf=is_template)
    return Module(vmfb, tuple(flags), mlir_text, container)


def check_inputs(inputs: Sequence[Any], expected: Sequence[Template | None], function: str) -> Sequence[Any]:
    """The inputs as arrays, checked in count, shape and dtype against the function's signature
    (numpy arrays that match, the common case, are passed on as they are)."""
    if len(inputs) != len(expected):
        raise TemplateMismatchError(f"function {function!r} takes {len(expected)} inputs, got {len(inputs)}")
    for value, want in zip(inputs, expected):
        mismatched = want is not None and (value.shape != want.shape or value.dtype != want.dtype)
        if type(value) is not np.ndarray or mismatched:
            return _checked_slowly(inputs, expected)
    return inputs


def _checked_slowly(inputs: Sequence[Any], expected: Sequence[Template | None]) -> list[Any]:
    arrays = []
    for position, (value, want) in enumerate(zip(inputs, expected)):
        if not hasattr(value, "shape"):
            value = np.asarray(value, want.dtype if want is not None else None)
        if want is not None:
            shape = value.shape if type(value.shape) is tuple else tuple(value.shape)
            if shape != want.shape or value.dtype != want.dtype:
                raise TemplateMismatchError(f"argument {position}: expected {want}, got {Template(shape, value.dtype)}")
        arrays.append(value)
    return arrays


def call(module: Module, inputs: Sequence[Any], device: Device | str | None = None, function: str = "main") -> Any:
    """Run ``function`` of ``module`` on ``device`` (default ``local-task://``); outputs shaped like the
    module's output container. Wrong input count, shape or dtype is an error before IREE sees it."""
    invoke = module.function(device, function)
    arrays = check_inputs(inputs, module._signatures[function], function)
    return module.wrap_outputs(invoke_checked(invoke, arrays, function))


def invoke_checked(invoke: Callable[..., Any], arrays: Sequence[Any], function: str) -> Any:
    """Run a loaded function; a failure of the runtime is an :class:`EvaluationError` naming the function."""
    try:
        return invoke(*arrays)
    except (RuntimeError, IndexError, ValueError) as error:
        raise EvaluationError(f"IREE failed running function {function!r}: {error}") from None
