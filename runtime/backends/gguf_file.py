"""A minimal GGUF reader: the tensor directory and a read-only memory map, nothing else.

gguf-py's GGUFReader also builds a numpy view per metadata string, which takes tens of seconds
on a 262k-token vocabulary; the native backend only needs where each tensor's blocks are. The
layout (GGUF v2/v3): magic, version, tensor count, metadata count; metadata key/value pairs
(skipped, except general.alignment); tensor infos (name, dims, type, offset); padding to the
alignment; the tensor data.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_MAGIC = b"GGUF"
# Metadata value types: id -> fixed size in bytes (8 = string, 9 = array are variable).
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_U64 = struct.Struct("<Q")


class GGUFError(ValueError):
    """The file is not a readable GGUF (truncated, wrong magic, unknown layout)."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's blocks lie: its GGML type, its dims (GGUF order: columns first) and byte range."""

    name: str
    ggml_type: int
    dims: tuple[int, ...]
    offset: int  # absolute, in the file
    nbytes: int


class _Cursor:
    def __init__(self, buffer, path: Path) -> None:
        self.buffer, self.position, self.path = buffer, 0, path

    def truncated(self) -> GGUFError:
        return GGUFError(f"{self.path} is truncated (its header runs past the end of the file); download or assemble it again")

    def take(self, count: int) -> bytes:
        chunk = self.buffer[self.position : self.position + count]
        self.skip(count)
        return chunk

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def string(self) -> str:
        return self.take(self.u64()).decode("utf-8", errors="replace")

    def skip(self, count: int) -> None:
        """Move past `count` bytes without copying them."""
        if self.position + count > len(self.buffer):
            raise self.truncated()
        self.position += count

    def skip_strings(self, count: int) -> None:
        """Move past `count` strings (u64 length, then bytes; e.g. a 262k-token vocabulary) without copying them."""
        buffer, position = self.buffer, self.position
        for _ in range(count):
            if position + 8 > len(buffer):
                raise self.truncated()
            position += 8 + _U64.unpack_from(buffer, position)[0]
        self.skip(position - self.position)

    def skip_value(self, kind: int) -> None:
        if kind == _STRING:
            self.skip(self.u64())
        elif kind == _ARRAY:
            inner, count = self.u32(), self.u64()
            if inner in _SIZES:
                self.skip(_SIZES[inner] * count)
            elif inner == _STRING:
                self.skip_strings(count)
            else:
                for _ in range(count):
                    self.skip_value(inner)
        elif kind in _SIZES:
            self.take(_SIZES[kind])
        else:
            raise GGUFError(f"{self.path} has a metadata value of unknown type {kind}; is it a GGUF file?")


def _tensor_bytes(ggml_type: int, dims: tuple[int, ...]) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return -1  # unknown type: reported by the caller, which names it
    elements = int(np.prod(dims, dtype=np.int64))
    return elements // block * size


class GGUFFile:
    """The tensor directory of a GGUF file over a read-only memory map."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # an empty file
                raise GGUFError(f"{self.path} is empty; download or assemble it again") from exc
        cursor = _Cursor(self.map, self.path)
        if cursor.take(4) != _MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (wrong magic bytes)")
        version = cursor.u32()
        if version not in (2, 3):
            raise GGUFError(f"{self.path} is GGUF version {version}; only versions 2 and 3 are read")
        tensor_count, kv_count = cursor.u64(), cursor.u64()
        alignment = 32
        for _ in range(kv_count):
            key, kind = cursor.string(), cursor.u32()
            if key == "general.alignment" and kind == _UINT32:
                alignment = cursor.u32()
            else:
                cursor.skip_value(kind)
        infos = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = tuple(cursor.u64() for _ in range(cursor.u32()))
            ggml_type, offset = cursor.u32(), cursor.u64()
            infos.append((name, ggml_type, dims, offset))
        data_start = -(-cursor.position // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, ggml_type, dims, offset in infos:
            info = TensorInfo(name, ggml_type, dims, data_start + offset, _tensor_bytes(ggml_type, dims))
            if info.nbytes >= 0 and info.offset + info.nbytes > len(self.map):
                raise GGUFError(f"{self.path} is truncated (tensor {name} runs past the end); download or assemble it again")
            self.tensors[name] = info

    def release(self, name: str, start: int = 0, stop: int | None = None) -> None:
        """Drop this process's mapped pages of the tensor's bytes [start, stop) (it was copied into
        another layout; default: all of them): they leave the resident set, and a later read maps them
        again from the page cache."""
        info = self.tensors[name]
        stop = info.nbytes if stop is None else min(stop, info.nbytes)
        first = (info.offset + start) // mmap.PAGESIZE * mmap.PAGESIZE
        if stop > start:
            self.map.madvise(mmap.MADV_DONTNEED, first, info.offset + stop - first)

    def array(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array [rows, row_bytes] (no copy)."""
        info = self.tensors[name]
        rows = int(np.prod(info.dims[1:], dtype=np.int64)) if len(info.dims) > 1 else 1
        flat = np.frombuffer(self.map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return flat.reshape(rows, -1)
