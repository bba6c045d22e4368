"""Weights from checkpoint files: ``load_params`` maps a ``.safetensors`` or ``.npz`` file (or the shards of
one, as ``transformers`` writes them) into a nested dict.

Nothing is read when a file is loaded: every array is a read-only view of the
file, memory-mapped, so the pages come in as the weights are first copied to
a device; :func:`release_pages` then drops them from the process (they are
the file's, read again only if something reads the arrays), so that serving
a checkpoint does not hold it twice. Dotted names become nesting (``encoder.layer.0.w`` is
``params["encoder"]["layer"][0]["w"]``), and a level whose keys are
``0..n-1`` becomes a list, so the tree reads as the model's code indexes it.
:func:`save_params` writes a tree back as ``.safetensors`` with the same
names.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import zipfile
from typing import Any

import jax
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from .errors import CheckpointError

# safetensors' dtype names (its spec) -> numpy; bfloat16 and the float8s are ml_dtypes', as in JAX
SAFETENSORS_DTYPES: dict[str, Any] = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
_ZIP_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # a zip member's local header: its name and extra field follow


SHARD_INDEX = ".safetensors.index.json"  # transformers' sharded checkpoint: {"weight_map": {name: shard file}}


def load_params(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The arrays of a ``.safetensors`` or ``.npz`` file as a nested dict (see the module's docstring),
    memory-mapped and read-only. Members of a compressed ``.npz`` (``np.savez_compressed``) cannot be
    mapped and are read into memory. A checkpoint sharded as ``transformers`` writes one (its
    ``*.safetensors.index.json``, or the folder that holds it or a single ``.safetensors``) is every
    shard's arrays together."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = _checkpoint_in(path)
    readers = {".safetensors": _safetensors, ".npz": _npz, SHARD_INDEX: _shards}
    reader = next((read for suffix, read in readers.items() if path.endswith(suffix)), None)
    if reader is None:
        raise CheckpointError(f"cannot load weights from {path!r}: expected a .safetensors or .npz file, a "
                              f"{SHARD_INDEX} of shards, or a folder holding one of those")
    if not os.path.isfile(path):
        raise CheckpointError(f"cannot load weights from {path!r}: no such file")
    return nest(reader(path), repr(path))


def _checkpoint_in(folder: str) -> str:
    """The one checkpoint of a folder: its shard index, else its one ``.safetensors``."""
    names = sorted(os.listdir(folder))
    for suffix in (SHARD_INDEX, ".safetensors"):
        found = [name for name in names if name.endswith(suffix)]
        if len(found) == 1:
            return os.path.join(folder, found[0])
        if found:
            raise CheckpointError(f"cannot load weights from folder {folder!r}: it holds {len(found)} "
                                  f"{suffix} files ({', '.join(found)}); name the one to load")
    raise CheckpointError(f"cannot load weights from folder {folder!r}: it holds no {SHARD_INDEX} and no "
                          f".safetensors file")


def _shards(index: str) -> dict[str, np.ndarray]:
    """Every array an index's ``weight_map`` names, from the shard it names, each shard mapped once."""
    try:
        with open(index, "rb") as file:
            weight_map = json.load(file)["weight_map"]
        shards = {name: str(shard) for name, shard in weight_map.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{index!r} is not a shard index (JSON with a 'weight_map' of names to "
                              f"shard files): {error!r}") from None
    files = {shard: os.path.join(os.path.dirname(index), shard) for shard in sorted(set(shards.values()))}
    for shard, path in files.items():
        if os.path.basename(shard) != shard or not os.path.isfile(path):
            raise CheckpointError(f"{index!r} names shard {shard!r}, which is not a file beside it")
    arrays: dict[str, np.ndarray] = {}
    for shard, path in files.items():
        held = _safetensors(path)
        listed = {name for name, listed_shard in shards.items() if listed_shard == shard}
        if held.keys() != listed:
            stray = sorted(held.keys() ^ listed)[:3]
            raise CheckpointError(f"{index!r} and its shard {shard!r} disagree on which arrays it holds "
                                  f"(for example {', '.join(stray)})")
        arrays.update(held)
    return arrays


def _safetensors(path: str) -> dict[str, np.ndarray]:
    try:
        with safe_open(path, framework="np") as checkpoint:  # checks the header: entries in bounds, no gaps
            entries = [(name, checkpoint.get_slice(name)) for name in checkpoint.offset_keys()]
            layout = [(name, entry.get_dtype(), tuple(entry.get_shape())) for name, entry in entries]
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path!r} is not a readable .safetensors file: {error}") from None
    unknown = sorted({dtype for _, dtype, _ in layout} - set(SAFETENSORS_DTYPES))
    if unknown:
        raise CheckpointError(f"{path!r} holds tensors of dtype {', '.join(unknown)}, which jitserve cannot map; "
                              f"it reads {', '.join(SAFETENSORS_DTYPES)}")
    sizes = [math.prod(shape) * np.dtype(SAFETENSORS_DTYPES[dtype]).itemsize for _, dtype, shape in layout]
    mapped = np.ndarray((os.path.getsize(path),), np.uint8, buffer=_mapping(path))
    at = mapped.size - sum(sizes)  # the tensors fill the file after its header, in the order of their offsets
    arrays = {}
    for (name, dtype, shape), size in zip(layout, sizes):
        arrays[name] = mapped[at:at + size].view(SAFETENSORS_DTYPES[dtype]).reshape(shape)
        at += size
    return arrays


def _npz(path: str) -> dict[str, np.ndarray]:
    try:
        with zipfile.ZipFile(path) as archive, open(path, "rb") as raw:
            return {member.filename.removesuffix(".npy"): _npz_member(path, archive, raw, member)
                    for member in archive.infolist()}
    except (zipfile.BadZipFile, ValueError, OSError, struct.error) as error:
        raise CheckpointError(f"{path!r} is not a readable .npz file: {error}") from None


def _npz_member(path: str, archive: zipfile.ZipFile, raw: Any, member: zipfile.ZipInfo) -> np.ndarray:
    """One array of an .npz: mapped where it is stored as is, else read (allow_pickle stays off)."""
    if member.compress_type != zipfile.ZIP_STORED:
        with archive.open(member) as stream:
            return np.lib.format.read_array(stream, allow_pickle=False)
    raw.seek(member.header_offset)
    header = _ZIP_LOCAL_HEADER.unpack(raw.read(_ZIP_LOCAL_HEADER.size))
    raw.seek(header[-2] + header[-1], os.SEEK_CUR)  # past the member's name and extra field: the .npy file
    npy_start = raw.tell()
    read_header = _NPY_HEADERS.get(np.lib.format.read_magic(raw))
    if read_header is None:  # a newer .npy version than numpy's public readers know: read it whole
        with archive.open(member) as stream:
            return np.lib.format.read_array(stream, allow_pickle=False)
    shape, fortran_order, dtype = read_header(raw)
    if dtype.hasobject:
        raise CheckpointError(f"{path!r}: {member.filename} holds Python objects, not numbers; it is not loaded")
    stored = member.file_size - (raw.tell() - npy_start)  # the bytes after its header
    if any(n < 0 for n in shape) or math.prod(shape) * dtype.itemsize != stored:
        raise CheckpointError(f"{path!r}: {member.filename} declares shape {tuple(shape)} of {dtype}, "
                              f"{math.prod(shape) * dtype.itemsize:,} bytes, but holds {stored:,}")
    return np.ndarray(shape, dtype, buffer=_mapping(path), offset=raw.tell(), order="F" if fortran_order else "C")


def _mapping(path: str) -> mmap.mmap:
    """The whole file, mapped read-only (the arrays viewing it keep it mapped)."""
    with open(path, "rb") as file:
        return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)


def release_pages(params: Any) -> None:
    """Drop from this process the resident pages of the files that ``params``' arrays map, the range of each
    array, once its contents were copied where it runs: the pages are the file's, so an array that is read
    again reads them back, and nothing changes but the memory the process holds."""
    for leaf in jax.tree_util.tree_leaves(params):
        base = leaf
        while isinstance(base, np.ndarray) and base.base is not None:
            base = base.base
        mapping = base.obj if isinstance(base, memoryview) else base
        if not isinstance(mapping, mmap.mmap) or not isinstance(leaf, np.ndarray) or leaf.size == 0:
            continue
        start = leaf.ctypes.data - np.frombuffer(mapping, np.uint8).ctypes.data
        first_page = start - start % mmap.PAGESIZE
        mapping.madvise(mmap.MADV_DONTNEED, first_page, start + leaf.nbytes - first_page)


def nest(flat: dict[str, Any], source: str = "the checkpoint") -> dict[str, Any]:
    """Dotted names as nested dicts, levels keyed 0..n-1 as lists."""
    root: dict[str, Any] = {}
    for name, array in flat.items():
        *parents, leaf = name.split(".")
        level = root
        for depth, part in enumerate(parents):
            level = level.setdefault(part, {})
            if not isinstance(level, dict):
                raise CheckpointError(f"{source}: {'.'.join(parents[:depth + 1])!r} is an array and also the "
                                      f"prefix of {name!r}")
        if leaf in level:
            raise CheckpointError(f"{source}: {name!r} is an array and also the prefix of other names")
        level[leaf] = array
    return _lists(root)


def _lists(tree: Any) -> Any:
    if not isinstance(tree, dict):
        return tree
    children = {key: _lists(value) for key, value in tree.items()}
    if children and sorted(children) == sorted(map(str, range(len(children)))):
        return [children[str(i)] for i in range(len(children))]
    return children


def flatten(params: Any) -> dict[str, np.ndarray]:
    """A tree of weights as ``{dotted name: numpy array}``, the names :func:`load_params` nests back."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {".".join(str(getattr(key, "key", getattr(key, "idx", key))) for key in path): np.asarray(leaf)
            for path, leaf in leaves}


def save_params(path: str | os.PathLike[str], params: Any) -> None:
    """Write a tree of weights to a ``.safetensors`` file (names as :func:`flatten` gives them), atomically: a
    new file renamed over the old one, so that a server that maps the old one keeps reading it intact
    until it reloads."""
    path = os.fspath(path)
    partial = f"{path}.{os.getpid()}.partial"
    save_file({name: np.ascontiguousarray(array) for name, array in flatten(params).items()}, partial)
    os.replace(partial, path)
