"""Checksums of files, whole and by byte range: what a save records and a verification recomputes.

A record (:data:`FileRecord`) holds a file's size, its checksum, and the checksum of every
item DCP wrote into it (``"offset length checksum name"``), so damage can be traced to the
entries it hits. Files are read memory-mapped: no copy, the page cache serves them.
Algorithms are looked up by the name a checkpoint records (:data:`DIGESTS`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

ALGORITHM = "xxh3_64"
"""The algorithm a save uses: XXH3 (64-bit) from the ``xxhash`` package, about 17 GB/s per core
here against zlib's CRC-32 at 3 GB/s; with CRC-32, verifying cost 14-19 % of a 17M-model load,
above the 10 % budget (benchmarks/checkpoint_bench.py). No stdlib checksum is that fast, hence the
dependency (a small, prebuilt, well-kept binding). Checkpoints saved with CRC-32 still verify."""

FileRecord = dict[str, Any]
"""``{"bytes": n, "crc32": "8 hex digits", "rank": r, "items": ["offset length crc32 name", ...]}``."""


def _hex(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


def _xxh3_64(data: memoryview) -> str:
    import xxhash  # lazily: `import shardwise` stays light

    return str(xxhash.xxh3_64_hexdigest(data))


DIGESTS: dict[str, Callable[[memoryview], str]] = {
    "crc32": lambda data: _hex(zlib.crc32(data)),
    "xxh3_64": _xxh3_64,
}
"""Checksum algorithms by the name a summary records (``checksums.algorithm``); a save uses
:data:`ALGORITHM`, a verification the recorded one, so adding a faster one keeps old saves readable."""


@contextlib.contextmanager
def _mapped(path: Path) -> Iterator[memoryview]:
    """The file's bytes, memory-mapped."""
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            yield memoryview(b"")
            return
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                yield view
            finally:
                view.release()


def file_digest(path: Path, algorithm: str | None = None) -> tuple[int, str]:
    """``(size, checksum)`` of a whole file (``algorithm`` defaults to :data:`ALGORITHM`)."""
    with _mapped(path) as data:
        return len(data), DIGESTS[algorithm or ALGORITHM](data)


def record_file(path: Path, items: Iterable[tuple[int, int, str]], rank: int | None = None) -> FileRecord:
    """The checksum record of a file DCP wrote: size, checksum, and checksum per item.

    Args:
        path: the file.
        items: ``(offset, length, name)`` of every item DCP wrote into it.
        rank: the rank that wrote it.
    """
    digest = DIGESTS[ALGORITHM]
    with _mapped(path) as data:
        lines = [f"{o} {n} {digest(data[o : o + n])} {name}" for o, n, name in sorted(items)]
        record: FileRecord = {"bytes": len(data), ALGORITHM: digest(data), "items": lines}
    if rank is not None:
        record["rank"] = rank
    return record


def damaged_items(path: Path, record: FileRecord, algorithm: str) -> list[str]:
    """The items of a file whose bytes no longer match their record (which entries a damage hits)."""
    out = []
    with _mapped(path) as data:
        for line in record.get("items", []):
            offset, length, want, name = line.split(" ", 3)
            start, stop = int(offset), int(offset) + int(length)
            if stop > len(data) or DIGESTS[algorithm](data[start:stop]) != want:
                out.append(f"{name} (bytes {start}-{stop})")
    return out
