"""DCP file storage with tensors as raw bytes: no ``torch.save`` / ``torch.load`` per item.

DCP's own file writer stores every tensor item as a small ``torch.save`` archive, and its
reader runs ``torch.load`` on each one (about a millisecond per item here, most of a load's
time for a model with a few hundred tensors). torch 2.13 has no raw-bytes option for its
file reader (its safetensors format is read through a separate, whole-file HF reader), so
this module writes its own:

- :class:`RawWriter` keeps DCP's planning, file naming and metadata, and writes each tensor
  item as its bytes in C order. The item's storage record carries the descriptor
  :data:`RAW_DESCRIPTOR`; the element type and chunk shape are already in DCP's metadata.
- :class:`RawAwareReader` reads those items straight into the target tensor (one
  ``readinto`` when the request covers a whole contiguous chunk, no intermediate copy) and
  hands every other item (Python objects, and tensors of checkpoints written before this
  format) to DCP's own reader, so old checkpoints still load.

A stock DCP reader refuses a raw item with an error naming the ``shardwise.raw``
extension; ``shardwise checkpoint export`` writes plain torch or safetensors files.

Why private torch names: a storage record must be DCP's ``_StorageInfo`` (``finish`` writes it
into ``.metadata`` and every reader reads its fields); it has no public spelling in 2.13.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

__all__ = ["RAW_DESCRIPTOR", "RawAwareReader", "RawWriter", "tensor_bytes"]

RAW_DESCRIPTOR = "shardwise.raw"
"""The storage-record descriptor of a tensor item stored as raw C-order bytes."""

_SUFFIX = ".distcp"


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor`` in C order (a view when it is already contiguous on the CPU).

    Example:
        >>> bytes(tensor_bytes(torch.tensor([1, 2], dtype=torch.int16)))
        b'\\x01\\x00\\x02\\x00'
    """
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")


def _split_by_size(items: Sequence[WriteItem], buckets: int, size_of: Any) -> list[list[WriteItem]]:
    """Items spread over ``buckets`` files, largest first onto the lightest file (one file per thread)."""
    if buckets <= 1:
        return [list(items)]
    bins: list[list[WriteItem]] = [[] for _ in range(buckets)]
    loads = [0] * buckets
    for item in sorted(items, key=size_of, reverse=True):
        lightest = loads.index(min(loads))
        bins[lightest].append(item)
        loads[lightest] += size_of(item)
    return [b for b in bins if b]


def _item_bytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    numel = 1
    for size in item.tensor_data.chunk.sizes:
        numel *= size
    return numel * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()


class RawWriter(FileSystemWriter):
    """DCP's file writer with tensor items stored as raw bytes (see the module docstring).

    Files are fsynced before the write reports success when ``sync_files`` (always, here).
    """

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix
        buckets = _split_by_size(plan.items, self.thread_count, _item_bytes)
        jobs = [(f"{prefix}{n}{_SUFFIX}", bucket) for n, bucket in enumerate(buckets)]
        if len(jobs) > 1:
            with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
                parts = list(pool.map(lambda job: self._write_file(job[0], job[1], planner), jobs))
        else:
            parts = [self._write_file(name, bucket, planner) for name, bucket in jobs]
        results = [result for part in parts for result in part]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_file(self, name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        with open(Path(self.path) / name, "wb") as stream:
            results = [self._write_item(stream, name, item, planner.resolve_data(item)) for item in items]
            if self.sync_files:
                stream.flush()
                os.fsync(stream.fileno())
        return results

    def _write_item(self, stream: BinaryIO, name: str, item: WriteItem, data: object) -> WriteResult:
        """Append one item to ``stream``: a Python object's bytes, or a tensor's raw bytes."""
        offset = stream.tell()
        if item.type == WriteItemType.BYTE_IO:
            assert isinstance(data, io.BytesIO), f"{item.index.fqn}: BYTE_IO item is {type(data)}"
            stream.write(data.getbuffer())
            descriptors = None
        else:
            assert isinstance(data, torch.Tensor), f"{item.index.fqn}: tensor item is {type(data)}"
            stream.write(tensor_bytes(data))
            descriptors = [RAW_DESCRIPTOR]
        length = stream.tell() - offset
        info = _StorageInfo(name, offset, length, transform_descriptors=descriptors)
        return WriteResult(index=item.index, size_in_bytes=length, storage_data=info)


class RawAwareReader(FileSystemReader):
    """DCP's file reader that reads raw tensor items itself (see the module docstring)."""

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: object, **kwargs: object
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.Size, torch.dtype]] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for chunk in md.chunks:
                    self._chunks[(fqn, tuple(chunk.offsets))] = (chunk.sizes, md.properties.dtype)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        raw: dict[str, list[ReadItem]] = {}
        others: list[ReadItem] = []
        for item in plan.items:
            info: _StorageInfo = self.storage_data[item.storage_index]
            if item.type != LoadItemType.BYTE_IO and RAW_DESCRIPTOR in (info.transform_descriptors or ()):
                raw.setdefault(info.relative_path, []).append(item)
            else:
                others.append(item)
        for relative_path, items in raw.items():
            with open(Path(self.path) / relative_path, "rb") as stream:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    self._read_raw(stream, item, planner)
        if others:
            return super().read_data(dataclasses.replace(plan, items=others), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_raw(self, stream: BinaryIO, item: ReadItem, planner: LoadPlanner) -> None:
        info: _StorageInfo = self.storage_data[item.storage_index]
        index = item.storage_index
        sizes, dtype = self._chunks[(index.fqn, tuple(index.offset) if index.offset is not None else ())]
        target = planner.resolve_tensor(item).detach()
        whole_chunk = not any(item.storage_offsets) and tuple(item.lengths) == tuple(sizes)
        direct = (
            whole_chunk
            and tuple(target.shape) == tuple(sizes)
            and target.is_contiguous()
            and target.device.type == "cpu"
            and target.dtype == dtype
        )
        chunk = target if direct else torch.empty(sizes, dtype=dtype)
        _read_exact(stream, info, chunk, relative_path=info.relative_path)
        if not direct:
            piece = chunk
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                piece = piece.narrow(dim, start, length)
            if tuple(target.shape) != tuple(piece.shape):
                raise RuntimeError(
                    f"checkpoint item {index.fqn}: the read region has shape {tuple(piece.shape)}, "
                    f"the target {tuple(target.shape)}"
                )
            target.copy_(piece)
        planner.commit_tensor(item, target)


def _read_exact(stream: BinaryIO, info: _StorageInfo, into: torch.Tensor, *, relative_path: str) -> None:
    """Fill ``into`` with the ``info.length`` bytes at ``info.offset`` (a short file is an error)."""
    expected = into.numel() * into.element_size()
    if expected != info.length:
        raise RuntimeError(
            f"checkpoint file {relative_path}: the item at offset {info.offset} holds {info.length} bytes, "
            f"its metadata says {expected} ({into.dtype}, shape {tuple(into.shape)})"
        )
    if expected == 0:
        return
    view = into.reshape(-1).view(torch.uint8).numpy().data
    stream.seek(info.offset)
    filled = 0
    while filled < expected:
        count = stream.readinto(view[filled:])  # type: ignore[attr-defined]
        if not count:
            raise RuntimeError(
                f"checkpoint file {relative_path} is truncated: {expected - filled} of the {expected} bytes "
                f"at offset {info.offset} are missing"
            )
        filled += count
