"""Where a tensor's bytes sit inside one `torch.save` blob of a DCP storage file.

torch's FileSystemWriter stores each saved box as a `torch.save` archive (a zip file,
entries stored uncompressed) at some offset of a `.distcp` file. To read a byte range
of a box without loading the whole archive, read only the archive's directory and its
small `data.pkl` (which names the storage, dtype, offset, size and stride) and
compute where the raw storage bytes start in the file.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
import warnings
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import IO, Any

import torch

from .._torch.serialization import REBUILD_MODULE, REBUILD_TENSOR_V2, REBUILD_TENSOR_V3
from ..errors import ShardingError

_LOCAL_HEADER = struct.Struct("<4s5H3I2H")  # zip local file header: 30 bytes, then name and extra field


@dataclass(frozen=True)
class SavedTensor:
    """A plain tensor inside a storage file: dtype, shape, strides and storage offset in elements."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    data_start: int  # absolute byte offset of the storage's first byte in the file
    storage_numel: int
    crc32: int  # of the storage bytes, as the archive records it

    @property
    def whole_storage_bytes(self) -> int:
        return self.storage_numel * self.itemsize

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


class FileSlice(io.RawIOBase):
    """A read-only window [offset, offset + length) of an open binary file."""

    def __init__(self, f: IO[bytes], offset: int, length: int) -> None:
        self._f, self._start, self._len, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = max(0, min(self._len, base + pos))
        return self._pos

    def readinto(self, buf: Any) -> int:
        n = min(len(buf), self._len - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buf)[:n])  # type: ignore[attr-defined]  # a binary file: typing.IO lacks it
        self._pos += got
        return got


class _Storage:
    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype


def _storage_dtype(name: str) -> torch.dtype | None:
    if name == "UntypedStorage":
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage classes warn on any use
        cls = getattr(torch, name, None)
        dtype = getattr(cls, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise ShardingError(f"checkpoint: unknown storage type torch.{name} in a saved tensor")
    return dtype


class _HeaderUnpickler(pickle.Unpickler):
    """Reads a plain tensor's record from data.pkl without touching its storage bytes."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == (REBUILD_MODULE, REBUILD_TENSOR_V2):
            return lambda storage, offset, size, stride, *rest: (
                "tensor",
                storage,
                offset,
                tuple(size),
                tuple(stride),
                None,
            )
        if (module, name) == (REBUILD_MODULE, REBUILD_TENSOR_V3):
            return lambda storage, offset, size, stride, requires_grad, hooks, dtype, *rest: (
                "tensor",
                storage,
                offset,
                tuple(size),
                tuple(stride),
                dtype,
            )
        if module == "torch" and name.endswith("Storage"):
            return name
        if module == "torch" and name in (
            "bfloat16",
            "float16",
            "float32",
            "float64",
            "uint16",
            "uint32",
            "uint64",
            "float8_e4m3fn",
            "float8_e5m2",
        ):
            return getattr(torch, name)
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise ShardingError(f"checkpoint: a saved item holds {module}.{name}, not a plain tensor")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise ShardingError(f"checkpoint: unexpected persistent id {pid!r} in a saved tensor")
        _, storage_type, key, _location, numel = pid
        return (storage_type, str(key), int(numel))


def read_saved_tensor(f: IO[bytes], offset: int, length: int) -> SavedTensor:
    """Parse the torch.save archive at [offset, offset + length) of `f`."""
    view = FileSlice(f, offset, length)
    try:
        archive = zipfile.ZipFile(io.BufferedReader(view))
        names = archive.namelist()
        prefix = names[0].split("/")[0]
        record = _HeaderUnpickler(io.BytesIO(archive.read(f"{prefix}/data.pkl"))).load()
        byteorder = archive.read(f"{prefix}/byteorder").decode() if f"{prefix}/byteorder" in names else "little"
    except (
        zipfile.BadZipFile,
        KeyError,
        EOFError,
        pickle.UnpicklingError,
        struct.error,
        ValueError,
        IndexError,
    ) as e:  # ValueError: bad names
        raise ShardingError(
            f"checkpoint: the saved item at bytes {offset}..{offset + length} is not a readable torch.save archive "
            f"({e}); the file is truncated or corrupted"
        ) from e
    if not (isinstance(record, tuple) and record and record[0] == "tensor"):
        raise ShardingError("checkpoint: a saved item is not a plain tensor")
    _, (storage_type, key, numel), storage_offset, shape, stride, dtype_v3 = record
    dtype = dtype_v3 if dtype_v3 is not None else _storage_dtype(storage_type)
    if dtype is None:
        raise ShardingError(
            f"checkpoint: saved storage {key} is untyped and its record names no dtype; it cannot be read"
        )
    if byteorder != sys.byteorder:
        raise ShardingError(f"checkpoint: saved with {byteorder}-endian bytes; this machine is {sys.byteorder}-endian")
    info = archive.getinfo(f"{prefix}/data/{key}")
    if info.compress_type != zipfile.ZIP_STORED:
        raise ShardingError("checkpoint: a saved tensor's bytes are compressed; ranged reads need stored entries")
    view.seek(info.header_offset)
    header = _LOCAL_HEADER.unpack(view.read(_LOCAL_HEADER.size))
    if header[0] != b"PK\x03\x04":
        raise ShardingError(
            f"checkpoint: bad zip entry header in the saved item at byte {offset}; the file is corrupted"
        )
    name_len, extra_len = header[-2], header[-1]
    data_start = offset + info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if info.file_size != numel * dtype.itemsize:
        raise ShardingError(f"checkpoint: storage {key} holds {info.file_size} bytes, expected {numel} x {dtype}")
    return SavedTensor(dtype, shape, stride, int(storage_offset), data_start, numel, info.CRC)
