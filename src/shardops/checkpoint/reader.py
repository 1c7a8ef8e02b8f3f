"""A DCP storage reader that reads only the byte ranges each rank needs.

torch's `FileSystemReader` loads every saved box a read item touches whole (a
`torch.load` of the box) and then narrows it: a rank that needs a quarter of a saved
shard still materialises all of it. This reader parses each box's archive header
(`blob.read_saved_tensor`) and copies the requested sub-box straight from the file
into the destination view, through one reusable buffer of at most `buffer_bytes`.
Peak extra memory per rank: that buffer (plus the archive directories, a few KB).

Checksums (`verify`, default True): a checkpoint saved by `shardops.checkpoint.save` carries
block checksums (`blocksums`): every byte this reader reads, the `.metadata` included, is
checked against the CRC-32 of its block, so a load onto any layout fails on a corrupted
byte it would use. A checkpoint without them (saved by torch's `dcp.save`, or by an older
shardops) has only the CRC-32 each saved box's archive records: verify=True checks it for
every box read from (streaming the whole box through the same buffer: more I/O, no more
memory), `verify="read"` only for boxes read whole (a resume onto the same layout reads
everything whole). `verify=False` checks nothing. A truncated file is always an error.
"""

from __future__ import annotations

import io
import itertools
import math
import os
import pickle
import zlib
from collections.abc import Sequence
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from ..errors import ShardingError
from .blob import SavedTensor, read_saved_tensor
from .blocksums import BlockSums

DEFAULT_BUFFER_BYTES = 8 << 20


class RangedFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose tensor reads fetch only the requested byte ranges (see module doc)."""

    def __init__(
        self, path: str | os.PathLike, buffer_bytes: int = DEFAULT_BUFFER_BYTES, verify: bool | str = True
    ) -> None:
        super().__init__(path)
        if verify not in (True, False, "read"):
            raise ShardingError(f"checkpoint load: verify must be True, False or 'read', got {verify!r}")
        self.buffer_bytes = int(buffer_bytes)
        self.verify = verify
        self.largest_buffer = 0  # bytes of the largest read buffer this reader allocated
        self.bytes_read = 0
        self.sums: BlockSums | None = None  # the checkpoint's block checksums, if it has them

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        directory = os.fspath(self.path)
        self.sums = BlockSums.read(directory) if self.verify else None
        if self.sums is not None:
            self.sums.read_whole(directory, ".metadata")  # raises on a corrupted byte before unpickling
        try:
            return super().read_metadata(*args, **kwargs)
        except (pickle.UnpicklingError, EOFError, ValueError, AttributeError, ImportError, IndexError, KeyError) as e:
            raise ShardingError(
                f"checkpoint: {os.path.join(directory, '.metadata')} cannot be read ({type(e).__name__}: {e}); the "
                "file is corrupted"
            ) from e

    def _open(self, relative_path: str) -> Any:
        if self.sums is not None:
            return self.sums.open(os.fspath(self.path), relative_path)
        return open(os.path.join(self.path, relative_path), "rb")

    def _check_box(self, whole: bool) -> bool:
        """Whether to check a box's archive CRC-32 (block sums, where present, check every read instead)."""
        return self.sums is None and (self.verify is True or (self.verify == "read" and whole))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        buf = bytearray(0)
        for relative_path, items in per_file.items():
            with self._open(relative_path) as stream:
                headers: dict[tuple[int, int], SavedTensor] = {}
                verified: set[tuple[int, int]] = set()
                for req in sorted(items, key=lambda r: self.storage_data[r.storage_index].offset):
                    info = self.storage_data[req.storage_index]
                    if req.type == LoadItemType.BYTE_IO:
                        _load_bytes(
                            planner, req, _read_exact(stream, info.offset, info.length, relative_path), relative_path
                        )
                        self.bytes_read += info.length
                        continue
                    if info.transform_descriptors:
                        raise ShardingError(
                            f"checkpoint: {req.storage_index.fqn!r} was saved through stream extensions "
                            f"{info.transform_descriptors}; load it with torch.distributed.checkpoint.load"
                        )
                    key = (info.offset, info.length)
                    saved = headers.get(key) or headers.setdefault(
                        key, read_saved_tensor(stream, info.offset, info.length)
                    )
                    target = planner.resolve_tensor(req).detach()
                    if tuple(target.shape) != tuple(req.lengths):
                        raise ShardingError(
                            f"checkpoint: {req.dest_index.fqn!r}: destination view {tuple(target.shape)} for a read of "
                            f"{tuple(req.lengths)}"
                        )
                    need = min(self.buffer_bytes, _span_bytes(saved, req.storage_offsets, req.lengths))
                    if len(buf) < need:
                        buf = bytearray(need)
                        self.largest_buffer = max(self.largest_buffer, need)
                    self.bytes_read += copy_box(
                        stream, saved, list(req.storage_offsets), list(req.lengths), target, buf, relative_path
                    )
                    whole = not any(req.storage_offsets) and tuple(req.lengths) == saved.shape
                    if key not in verified and self._check_box(whole):
                        check_crc(
                            stream,
                            saved,
                            buf,
                            f"{relative_path} ({req.storage_index.fqn!r} at {tuple(req.storage_index.offset or ())})",
                        )
                        verified.add(key)
                    planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut


def _load_bytes(planner: LoadPlanner, req: Any, data: bytearray, relative_path: str) -> None:
    """A saved Python object (torch.save'd by DCP, no checksum of its own without block sums)."""
    try:
        planner.load_bytes(req, io.BytesIO(data))
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        RuntimeError,
        AttributeError,
        ImportError,
        IndexError,
        KeyError,
    ) as e:
        if isinstance(e, ShardingError):
            raise
        raise ShardingError(
            f"checkpoint: the saved object {req.storage_index.fqn!r} in {relative_path} cannot be read "
            f"({type(e).__name__}: {e}); the file is corrupted"
        ) from e


def check_crc(stream: IO[bytes], saved: SavedTensor, buf: bytearray, what: str) -> None:
    """Stream the box's stored bytes through `buf` and compare their CRC-32 with the archive's."""
    crc, pos, left = 0, saved.data_start, saved.whole_storage_bytes
    if not buf:
        buf = bytearray(min(left, DEFAULT_BUFFER_BYTES))
    while left:
        n = min(len(buf), left)
        _read_exact(stream, pos, n, what, into=buf)
        crc = zlib.crc32(memoryview(buf)[:n], crc)
        pos, left = pos + n, left - n
    if crc != saved.crc32:
        raise ShardingError(f"checkpoint: the saved bytes of {what} fail their CRC-32 check; the file is corrupted")


def _read_exact(stream: IO[bytes], offset: int, length: int, name: str, into: Any = None) -> Any:
    stream.seek(offset)
    out = into if into is not None else bytearray(length)
    view, got = memoryview(out)[:length], 0
    while got < length:
        n = stream.readinto(view[got:])  # type: ignore[attr-defined]  # a binary file: typing.IO lacks it
        if not n:
            raise ShardingError(
                f"checkpoint: {name} ends at byte {offset + got}, but a saved item needs bytes up to "
                f"{offset + length}; the file is truncated"
            )
        got += n
    return out


def _span_elements(saved: SavedTensor, start: Sequence[int], lengths: Sequence[int]) -> tuple[int, int]:
    """First element offset and element count of the storage span that holds the box."""
    first = saved.storage_offset + sum(s * st for s, st in zip(start, saved.stride))
    last = first + sum((n - 1) * st for n, st in zip(lengths, saved.stride))
    return first, last - first + 1


def _span_bytes(saved: SavedTensor, start: Sequence[int], lengths: Sequence[int]) -> int:
    if math.prod(lengths) == 0:
        return 0
    return _span_elements(saved, start, lengths)[1] * saved.itemsize


# Runs shorter than this are read as part of a wider span (fewer, larger reads) even where the
# span holds bytes the box does not need; longer runs are read one by one, exactly.
SMALL_RUN_BYTES = 4096


def copy_box(
    stream: IO[bytes],
    saved: SavedTensor,
    start: list[int],
    lengths: list[int],
    dst: torch.Tensor,
    buf: bytearray,
    name: str,
) -> int:
    """Copy the box [start, start + lengths) of the saved tensor into `dst`; the bytes read.

    A box whose storage span fits the buffer, and wastes little of it (<= 1/5), is one read. A box
    made of long runs far apart (a column block of a row-major tensor) is read run by run,
    exactly its own bytes. Anything larger than the buffer is cut along its outermost
    (largest-stride) dim into slabs that fit, down to single elements if need be.
    """
    count = math.prod(lengths)
    if count == 0:
        return 0
    span = _span_bytes(saved, start, lengths)
    run = _contiguous_run(saved, start, lengths)
    if (
        run is not None
        and 4 * span > 5 * count * saved.itemsize
        and SMALL_RUN_BYTES <= run[1] * saved.itemsize <= len(buf)
    ):
        return _copy_runs(stream, saved, start, lengths, run[0], dst, buf, name)
    if span <= len(buf):
        first, _ = _span_elements(saved, start, lengths)
        _read_exact(stream, saved.data_start + first * saved.itemsize, span, name, into=buf)
        src = (
            torch.frombuffer(buf, dtype=torch.uint8, count=span).view(saved.dtype).as_strided(lengths, saved.stride, 0)
        )
        dst.copy_(src)
        return span
    dims = [d for d in range(len(lengths)) if lengths[d] > 1]
    d = max(dims, key=lambda k: saved.stride[k])
    one = list(lengths)
    one[d] = 1
    slab = _span_bytes(saved, start, one)
    step = saved.stride[d] * saved.itemsize
    per = 1 if slab > len(buf) or step == 0 else max(1, 1 + (len(buf) - slab) // step)
    total = 0
    for j in range(0, lengths[d], per):
        k = min(per, lengths[d] - j)
        sub_start, sub_len = list(start), list(lengths)
        sub_start[d] += j
        sub_len[d] = k
        total += copy_box(stream, saved, sub_start, sub_len, dst.narrow(d, j, k), buf, name)
    return total


def _contiguous_run(saved: SavedTensor, start: Sequence[int], lengths: Sequence[int]) -> tuple[int, int] | None:
    """For a row-major saved tensor: (k, elements per run), where dims after k are whole in the box,
    so each index over dims < k names one contiguous run. None for other strides."""
    shape = saved.shape
    expected = 1
    for d in reversed(range(len(shape))):
        if shape[d] != 1 and saved.stride[d] != expected:
            return None
        expected *= shape[d]
    k = len(shape) - 1
    while k > 0 and start[k] == 0 and lengths[k] == shape[k]:
        k -= 1
    if k < 0:
        return None
    return k, lengths[k] * math.prod(shape[k + 1 :])


def _copy_runs(
    stream: IO[bytes],
    saved: SavedTensor,
    start: Sequence[int],
    lengths: Sequence[int],
    k: int,
    dst: torch.Tensor,
    buf: bytearray,
    name: str,
) -> int:
    run_shape = tuple(lengths[k:])
    nbytes = math.prod(run_shape) * saved.itemsize
    base = saved.storage_offset + start[k] * saved.stride[k]
    for outer in itertools.product(*(range(n) for n in lengths[:k])):
        first = base + sum((start[d] + i) * saved.stride[d] for d, i in enumerate(outer))
        _read_exact(stream, saved.data_start + first * saved.itemsize, nbytes, name, into=buf)
        dst[outer].copy_(torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(saved.dtype).reshape(run_shape))
    return nbytes * math.prod(lengths[:k])
