"""Block checksums of a checkpoint's files, so that every byte range a load reads is verified.

The CRC-32 a torch.save archive records covers a whole saved box: a rank that reads part
of a box (a load onto another layout) could only check it by reading the whole box. Here
every file of the checkpoint (each rank's `.distcp` file and the `.metadata`) is cut into
fixed blocks (`BLOCK_BYTES`, recorded in the file) with one CRC-32 each; a read checks the
blocks it touches, once each, before using their bytes.

The sums live in a side file, `SUMS_FILE`, which torch's own `FileSystemReader`,
`dcp.load` and `dcp_to_torch_save` never open: the checkpoint stays torch's format. The
side file carries a CRC-32 of its own body. A checkpoint without it (saved by torch, or
before block sums) loads as before, checked by the archives' whole-box CRCs.
"""

from __future__ import annotations

import array
import base64
import json
import os
import sys
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import ShardingError

SUMS_FILE = ".shardops_blocksums"
BLOCK_BYTES = 64 << 10
_MAGIC = "shardops-blocksums-v1"


@dataclass(frozen=True)
class FileSums:
    """One file's size and the CRC-32 of each of its blocks."""

    size: int
    crcs: tuple[int, ...]


def sum_file(path: str, block_bytes: int) -> FileSums:
    """The block sums of the file at `path`, read through one block-sized buffer."""
    crcs, size, buf = [], 0, bytearray(block_bytes)
    with open(path, "rb") as f:
        while n := f.readinto(buf):  # a buffered read fills the buffer unless the file ends
            crcs.append(zlib.crc32(memoryview(buf)[:n]))
            size += n
    return FileSums(size, tuple(crcs))


def _pack(crcs: Iterable[int]) -> str:
    a = array.array("I", crcs)
    if sys.byteorder != "little":
        a.byteswap()
    return base64.b64encode(a.tobytes()).decode()


def _unpack(text: str) -> tuple[int, ...]:
    a = array.array("I")
    a.frombytes(base64.b64decode(text, validate=True))
    if sys.byteorder != "little":
        a.byteswap()
    return tuple(a)


def write_sums(directory: str, files: dict[str, FileSums], block_bytes: int) -> None:
    """Write the side file (durably: it is part of the checkpoint the commit swaps in)."""
    body = json.dumps(
        {
            "block_bytes": block_bytes,
            "files": {name: {"size": s.size, "crc32": _pack(s.crcs)} for name, s in sorted(files.items())},
        },
        sort_keys=True,
    ).encode()
    with open(os.path.join(directory, SUMS_FILE), "wb") as f:
        f.write(f"{_MAGIC} {zlib.crc32(body):08x}\n".encode() + body)
        f.flush()
        os.fsync(f.fileno())


class BlockSums:
    """The side file of one checkpoint directory, read and self-checked."""

    def __init__(self, block_bytes: int, files: dict[str, FileSums]) -> None:
        self.block_bytes, self.files = block_bytes, files

    @classmethod
    def read(cls, directory: str) -> BlockSums | None:
        """None for a checkpoint without block sums; raises if the side file is damaged."""
        path = os.path.join(directory, SUMS_FILE)
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            raw = f.read()
        head, _, body = raw.partition(b"\n")
        try:
            magic, crc = head.decode("ascii").split(" ")
            if magic != _MAGIC or int(crc, 16) != zlib.crc32(body):
                raise ValueError("its CRC-32 does not match")
            doc = json.loads(body)
            files = {name: FileSums(int(v["size"]), _unpack(v["crc32"])) for name, v in doc["files"].items()}
            return cls(int(doc["block_bytes"]), files)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ShardingError(f"checkpoint: the block checksums file {path} is corrupted ({e})") from e

    def of(self, relative_path: str, directory: str) -> FileSums:
        sums = self.files.get(relative_path)
        if sums is None:
            raise ShardingError(
                f"checkpoint: {os.path.join(directory, relative_path)} has no block checksums; the checkpoint is "
                "damaged or was changed after its save"
            )
        return sums

    def open(self, directory: str, relative_path: str) -> VerifiedFile:
        return VerifiedFile(os.path.join(directory, relative_path), self.of(relative_path, directory), self.block_bytes)

    def read_whole(self, directory: str, relative_path: str) -> bytes:
        """A whole small file (the .metadata), verified."""
        with self.open(directory, relative_path) as f:
            out = bytearray(f.size)
            f.seek(0)
            got = 0
            while got < f.size:
                n = f.readinto(memoryview(out)[got:])
                if not n:
                    raise ShardingError(
                        f"checkpoint: {f.path} ends at byte {got}, before its saved size {f.size}; the file is "
                        "truncated"
                    )
                got += n
        return bytes(out)


class VerifiedFile:
    """A read-only binary file whose reads check the block sums of every block they touch
    (each block once, on first touch) before handing out its bytes."""

    def __init__(self, path: str, sums: FileSums, block_bytes: int) -> None:
        self.path, self.sums, self.block = path, sums, block_bytes
        self._f = open(path, "rb")
        self._pos = 0
        self._checked: set[int] = set()
        self._scratch = bytearray(0)
        actual = os.fstat(self._f.fileno()).st_size
        if actual != sums.size:
            self._f.close()
            what = "truncated" if actual < sums.size else "longer than saved"
            raise ShardingError(
                f"checkpoint: {path} holds {actual} bytes but was saved with {sums.size}; the file is {what} "
                "(corrupted)"
            )

    @property
    def size(self) -> int:
        return self.sums.size

    def __enter__(self) -> VerifiedFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._f.close()

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = {0: 0, 1: self._pos, 2: self.sums.size}[whence] + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self.sums.size - self._pos))
        if n == 0:
            return 0
        self._check(self._pos, n)
        self._f.seek(self._pos)
        got = self._f.readinto(memoryview(buf)[:n])
        self._pos += got
        return got

    def read(self, n: int = -1) -> bytes:
        n = self.sums.size - self._pos if n is None or n < 0 else n
        out = bytearray(max(0, n))
        got = self.readinto(out)
        return bytes(out[:got])

    def _check(self, start: int, length: int) -> None:
        for b in range(start // self.block, (start + length - 1) // self.block + 1):
            if b in self._checked:
                continue
            lo = b * self.block
            n = min(self.block, self.sums.size - lo)
            if len(self._scratch) < n:
                self._scratch = bytearray(self.block)
            self._f.seek(lo)
            view, got = memoryview(self._scratch)[:n], 0
            while got < n:
                more = self._f.readinto(view[got:])
                if not more:
                    raise ShardingError(
                        f"checkpoint: {self.path} ends at byte {lo + got}, before its saved size {self.sums.size}; the "
                        "file is truncated"
                    )
                got += more
            if b >= len(self.sums.crcs) or zlib.crc32(view) != self.sums.crcs[b]:
                raise ShardingError(
                    f"checkpoint: bytes {lo}..{lo + n} of {self.path} fail their CRC-32 block check; the file is "
                    "corrupted"
                )
            self._checked.add(b)
