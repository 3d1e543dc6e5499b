"""Megatron's memory-mapped indexed dataset (``<prefix>.bin`` + ``<prefix>.idx``): reader and writer.

DeepSpeed's ``deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset.MMapIndexedDataset`` and
``MMapIndexedDatasetBuilder`` (the files Megatron's ``preprocess_data.py`` and DeepSpeed's data analyzer
write). The layout, all little-endian:

- ``.bin``: every item's elements back to back, in the index's element type, no header;
- ``.idx``: the magic ``b"MMIDIDX\\x00\\x00"`` (9 bytes), the version (uint64, 1), the element-type code
  (uint8), the item count ``n`` (uint64), the document-boundary count ``d`` (uint64), then ``n`` item
  lengths in elements (int32), ``n`` byte offsets into ``.bin`` (int64, an exclusive running sum of
  length x element size), and ``d`` document boundaries (int64 item indices, starting with 0).

The element-type codes 1-5 are the same everywhere (uint8, int8, int16, int32, int64); 6-8 differ:
DeepSpeed reads them as uint16, uint32, uint64 (:data:`DEEPSPEED_DTYPES`, the default), Megatron-LM
as float64, float32, uint16 (:data:`MEGATRON_DTYPES`: pass ``dtype_codes=MEGATRON_DTYPES`` for token
files Megatron wrote with uint16, its choice for vocabularies under 65500).

Example:
    >>> import tempfile, numpy as np
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     builder = MMapIndexedDatasetBuilder(f"{tmp}/d.bin", dtype=np.int32)
    ...     for item in ([1, 2, 3], [4], [5, 6]):
    ...         builder.add_item_numpy(np.array(item))
    ...     builder.end_document(); builder.finalize(f"{tmp}/d.idx")
    ...     data = MMapIndexedDataset(f"{tmp}/d", skip_warmup=True)
    ...     len(data), data[0].tolist(), [a.tolist() for a in data[1:3]], data.get(0, offset=1, length=1).tolist()
    (3, [1, 2, 3], [[4], [5, 6]], [2])
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "DEEPSPEED_DTYPES",
    "MEGATRON_DTYPES",
    "MMapIndexedDataset",
    "MMapIndexedDatasetBuilder",
    "data_file_path",
    "index_file_path",
]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DEEPSPEED_DTYPES: Mapping[int, type[np.generic]] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.uint16, 7: np.uint32, 8: np.uint64,
}
"""Element-type codes as DeepSpeed 0.19.8 reads and writes them."""
MEGATRON_DTYPES: Mapping[int, type[np.generic]] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
"""Element-type codes as Megatron-LM's ``indexed_dataset.py`` reads and writes them."""
_WARMUP_CHUNK = 100 * 2**20


def index_file_path(prefix_path: str) -> str:
    """``<prefix>.idx``."""
    return prefix_path + ".idx"


def data_file_path(prefix_path: str) -> str:
    """``<prefix>.bin``."""
    return prefix_path + ".bin"


def _warm_up(path: str) -> None:
    """Read the file through once, so the page cache holds it before training reads it at random."""
    with open(path, "rb") as stream:
        while stream.read(_WARMUP_CHUNK):
            pass


def _code_of(dtype: Any, dtype_codes: Mapping[int, type[np.generic]]) -> int:
    wanted = np.dtype(dtype if not isinstance(dtype, torch.dtype) else torch.empty(0, dtype=dtype).numpy().dtype)
    for code, candidate in dtype_codes.items():
        if np.dtype(candidate) == wanted:
            return code
    raise ValueError(f"element type {wanted} has no code in this table; use one of "
                     f"{sorted(str(np.dtype(t)) for t in dtype_codes.values())}")


class _Index:
    """The parsed ``.idx`` file: element type, item lengths and offsets, document boundaries."""

    def __init__(self, path: str, skip_warmup: bool, dtype_codes: Mapping[int, type[np.generic]]) -> None:
        with open(path, "rb") as stream:
            magic = stream.read(len(MAGIC))
            if magic != MAGIC:
                raise ValueError(f"{path}: not a memory-mapped indexed dataset index (starts with {magic!r}, "
                                 f"expected {MAGIC!r}); it may be Megatron's older 'cached'/'lazy' format")
            (version,) = struct.unpack("<Q", stream.read(8))
            if version != VERSION:
                raise ValueError(f"{path}: index version {version}; only version {VERSION} is read")
            (code,) = struct.unpack("<B", stream.read(1))
            if code not in dtype_codes:
                raise ValueError(f"{path}: element-type code {code} is not in the table {sorted(dtype_codes)}")
            self.dtype: type[np.generic] = dtype_codes[code]
            self.length, self.doc_count = struct.unpack("<QQ", stream.read(16))
            offset = stream.tell()
        if not skip_warmup:
            _warm_up(path)
        self._mmap = np.memmap(path, mode="r", order="C")
        buffer = memoryview(self._mmap)  # type: ignore[arg-type]  # an ndarray exports the buffer protocol
        self.sizes = np.frombuffer(buffer, dtype=np.int32, count=self.length, offset=offset)
        offset += self.sizes.nbytes
        self.pointers = np.frombuffer(buffer, dtype=np.int64, count=self.length, offset=offset)
        offset += self.pointers.nbytes
        self.doc_idx = np.frombuffer(buffer, dtype=np.int64, count=self.doc_count, offset=offset)


class MMapIndexedDataset(torch.utils.data.Dataset):
    """Items of a ``<prefix>.bin``/``<prefix>.idx`` pair as numpy arrays read from a memory map.

    Args:
        path: the prefix (without ``.bin``/``.idx``).
        skip_warmup: False reads both files through once first.
        dtype_codes: the element-type table (:data:`DEEPSPEED_DTYPES` or :data:`MEGATRON_DTYPES`).

    Raises:
        ValueError: the index is not this format, or its version or element type is unknown.
    """

    def __init__(self, path: str, skip_warmup: bool = False,
                 dtype_codes: Mapping[int, type[np.generic]] = DEEPSPEED_DTYPES) -> None:
        super().__init__()
        self._dtype_codes = dtype_codes
        self._open(str(path), skip_warmup)

    def _open(self, path: str, skip_warmup: bool) -> None:
        self._path = path
        self._index = _Index(index_file_path(path), skip_warmup, self._dtype_codes)
        if not skip_warmup:
            _warm_up(data_file_path(path))
        self._bin_mmap = np.memmap(data_file_path(path), mode="r", order="C")
        self._bin_buffer = memoryview(self._bin_mmap)  # type: ignore[arg-type]  # (buffer protocol)

    def __getstate__(self) -> tuple[str, Mapping[int, type[np.generic]]]:
        return self._path, self._dtype_codes

    def __setstate__(self, state: tuple[str, Mapping[int, type[np.generic]]]) -> None:
        self._path, self._dtype_codes = state
        self._open(self._path, skip_warmup=True)

    def __len__(self) -> int:
        return int(self._index.length)

    def __getitem__(self, idx: int | np.integer[Any] | slice) -> Any:
        """Item ``idx`` (a numpy array), or the list of items of a contiguous slice."""
        if isinstance(idx, (int, np.integer)):
            return np.frombuffer(self._bin_buffer, dtype=self.dtype, count=int(self._index.sizes[idx]),
                                 offset=int(self._index.pointers[idx]))
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("Slices into indexed_dataset must be contiguous")
            sizes = self._index.sizes[start:stop]
            flat = np.frombuffer(self._bin_buffer, dtype=self.dtype, count=int(sizes.sum()),
                                 offset=int(self._index.pointers[start]))
            return np.split(flat, np.cumsum(sizes)[:-1])
        raise TypeError(f"MMapIndexedDataset[{idx!r}]: index with an int or a contiguous slice")

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray[Any, Any]:
        """``length`` elements of item ``idx`` from element ``offset`` (the rest of it by default)."""
        size = int(self._index.sizes[idx])
        if length is None:
            length = size - offset
        start = int(self._index.pointers[idx]) + offset * np.dtype(self.dtype).itemsize
        return np.frombuffer(self._bin_buffer, dtype=self.dtype, count=length, offset=start)

    @property
    def sizes(self) -> np.ndarray[Any, Any]:
        """Every item's length in elements (int32)."""
        return self._index.sizes

    def size(self, index: int) -> int:
        """Item ``index``'s length in elements."""
        return int(self._index.sizes[index])

    @property
    def doc_idx(self) -> np.ndarray[Any, Any]:
        """The item index at which each document starts (first 0; last the item count after ``end_document``)."""
        return self._index.doc_idx

    def get_doc_idx(self) -> np.ndarray[Any, Any]:
        """:attr:`doc_idx`."""
        return self._index.doc_idx

    def set_doc_idx(self, doc_idx: np.ndarray[Any, Any]) -> None:
        """Replace the document boundaries in memory (the file is not changed)."""
        self._index.doc_idx = doc_idx

    @property
    def supports_prefetch(self) -> bool:
        """False: the memory map needs no prefetch."""
        return False

    @staticmethod
    def exists(path: str) -> bool:
        """Whether both ``<path>.idx`` and ``<path>.bin`` exist."""
        return os.path.exists(index_file_path(path)) and os.path.exists(data_file_path(path))

    @property
    def dtype(self) -> type[np.generic]:
        """The element type."""
        return self._index.dtype


class MMapIndexedDatasetBuilder:
    """Writes a ``.bin`` as items are added and its ``.idx`` at :meth:`finalize` (DeepSpeed's builder).

    Args:
        out_file: the ``.bin`` path.
        dtype: the element type (numpy or torch); every item is converted to it.
        dtype_codes: the element-type table the ``.idx`` is written with.
    """

    def __init__(self, out_file: str, dtype: Any = np.int64,
                 dtype_codes: Mapping[int, type[np.generic]] = DEEPSPEED_DTYPES) -> None:
        self._code = _code_of(dtype, dtype_codes)
        self._dtype = dtype_codes[self._code]
        self._data_file = open(out_file, "wb")  # noqa: SIM115  (closed by finalize)
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]

    def add_item(self, tensor: torch.Tensor) -> None:
        """Append one item from a tensor."""
        self.add_item_numpy(tensor.numpy())

    def add_items(self, arrays: Sequence[np.ndarray[Any, Any]]) -> None:
        """Append one item per array."""
        for array in arrays:
            self.add_item_numpy(array)

    def add_item_numpy(self, array: np.ndarray[Any, Any]) -> None:
        """Append one item from an array (flattened, converted to the element type)."""
        data = np.ascontiguousarray(array, dtype=self._dtype).reshape(-1)
        self._data_file.write(data.tobytes(order="C"))
        self._sizes.append(int(data.size))

    def end_document(self) -> None:
        """Close the current document: the next item starts a new one."""
        self._doc_idx.append(len(self._sizes))

    def finalize(self, index_file: str) -> None:
        """Close the ``.bin`` and write the ``.idx``."""
        self._data_file.close()
        sizes = np.asarray(self._sizes, dtype=np.int64)
        pointers = np.concatenate([[0], np.cumsum(sizes * np.dtype(self._dtype).itemsize)[:-1]]) if len(sizes) else sizes
        with open(index_file, "wb") as stream:
            stream.write(MAGIC)
            stream.write(struct.pack("<Q", VERSION))
            stream.write(struct.pack("<B", self._code))
            stream.write(struct.pack("<QQ", len(sizes), len(self._doc_idx)))
            stream.write(sizes.astype(np.int32).tobytes(order="C"))
            stream.write(np.asarray(pointers, dtype=np.int64).tobytes(order="C"))
            stream.write(np.asarray(self._doc_idx, dtype=np.int64).tobytes(order="C"))
