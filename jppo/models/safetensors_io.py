"""Reading and writing the safetensors format with numpy, bfloat16 included and without loading whole files.

A safetensors file is an 8-byte little-endian header size ``n``, ``n`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, offsets relative to the
end of the header), then the raw little-endian tensor bytes. Reading memory-maps the file, so slicing a tensor
reads only the pages of the slice: each device's shard of a large checkpoint is read on its own. Writing
streams one tensor at a time. (The ``safetensors`` package's numpy API cannot represent bfloat16.)

A checkpoint larger than a shard limit is cut, as transformers cuts it, into ``model-0000i-of-0000n.safetensors``
files plus ``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``).
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
from typing import Callable, Iterable

import ml_dtypes
import numpy as np
from etils import epath

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_CODES = {dtype: code for code, dtype in DTYPES.items()}


class SafetensorsFile:
    """Read-only, memory-mapped tensors of one ``.safetensors`` file."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        with open(self.path, "rb") as f:
            (header_size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_size))
        header.pop("__metadata__", None)
        self._entries: dict[str, dict] = header
        self._data_start = 8 + header_size
        self._buffer = np.memmap(self.path, dtype=np.uint8, mode="r")

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def tensor(self, name: str) -> np.ndarray:
        """A read-only view of tensor ``name`` (nothing is read until it is sliced or copied)."""
        entry = self._entries[name]
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        raw = self._buffer[self._data_start + begin : self._data_start + end]
        return raw.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])


def write_safetensors(
    path: str | pathlib.Path,
    layout: Iterable[tuple[str, tuple[int, ...], np.dtype]],
    fetch: Callable[[str], np.ndarray],
) -> None:
    """Writes the tensors named in ``layout`` (name, shape, dtype), in that order, calling ``fetch(name)`` for
    each one only when its bytes are written, so at most one tensor is held in host memory at a time."""
    layout = list(layout)
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in layout:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _CODES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header so that the data starts 8-byte aligned
    with epath.Path(path).open("wb") as f:  # a local file or a cloud object
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, shape, dtype in layout:
            array = np.ascontiguousarray(fetch(name), dtype=dtype)
            if array.shape != tuple(shape):
                raise ValueError(f"tensor {name}: layout says shape {tuple(shape)}, got {array.shape}")
            f.write(array.tobytes())  # DTYPES are little-endian (bfloat16: native, little-endian on x86/arm)


Layout = list[tuple[str, tuple[int, ...], np.dtype]]


def tensor_bytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def group_into_shards(
    layout: Iterable[tuple[str, tuple[int, ...], np.dtype]], max_shard_bytes: int | None
) -> list[Layout]:
    """``layout`` cut, in order, into shards of at most ``max_shard_bytes`` each (``None``: one shard). A tensor is
    never split: one larger than the limit is a shard of its own (as transformers does)."""
    shards: list[Layout] = [[]]
    size = 0
    for entry in layout:
        nbytes = tensor_bytes(entry[1], entry[2])
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def write_sharded_safetensors(
    directory: str | os.PathLike,
    layout: Iterable[tuple[str, tuple[int, ...], np.dtype]],
    fetch: Callable[[str], np.ndarray],
    max_shard_bytes: int | None = None,
    prefix: str = "model",
) -> list[str]:
    """Writes ``layout`` into ``directory`` as ``{prefix}.safetensors``, or, when it exceeds ``max_shard_bytes``,
    as numbered shards plus ``{prefix}.safetensors.index.json``; returns the file names written."""
    directory = epath.Path(directory)  # a local folder or a gs:// URI (pathlib would turn gs:// into gs:/)
    layout = list(layout)
    shards = group_into_shards(layout, max_shard_bytes)
    if len(shards) == 1:
        write_safetensors(directory / f"{prefix}.safetensors", shards[0], fetch)
        return [f"{prefix}.safetensors"]
    names = [f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        write_safetensors(directory / name, shard, fetch)
        weight_map.update(dict.fromkeys((entry[0] for entry in shard), name))
    index = {"metadata": {"total_size": sum(tensor_bytes(shape, dtype) for _, shape, dtype in layout)},
             "weight_map": weight_map}
    index_name = f"{prefix}.safetensors.index.json"
    (directory / index_name).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, index_name]
