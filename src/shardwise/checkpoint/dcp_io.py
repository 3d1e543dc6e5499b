"""The bridge to ``torch.distributed.checkpoint`` (DCP): sharded writes, resharded reads.

DCP stores every tensor of a state dict as rectangular chunks with their global shape,
writes each rank's chunks in parallel, and on load reads whatever overlaps the chunks the
reader asks for, so a checkpoint written by N ranks in one layout loads on M ranks in
another. It understands plain tensors (replicated: written once) and DTensors (FSDP2,
ZeRO-3) natively. ZeRO stages 1-2 own *flat ranges* of parameters, which DCP cannot
describe, so :class:`FlatShards` presents a rank's flat ranges as boxes (see
:mod:`shardwise.checkpoint.boxes`) through DCP's ``_Checkpointable`` hooks
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``): the files
then hold every tensor at its real shape, readable by any layout or stage.

Two small planner subclasses are needed, and this module says why at each. Saves go through
:class:`ChecksumWriter`, which stores tensors as raw bytes
(:class:`~shardwise.checkpoint.raw_storage.RawWriter`) and records the checksum of every file
and item it wrote (see :mod:`shardwise.checkpoint.integrity`); loads go through
:class:`~shardwise.checkpoint.raw_storage.RawAwareReader`, which also reads checkpoints whose
tensors DCP's own writer stored with ``torch.save``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.futures import Future

from shardwise.checkpoint import checksums
from shardwise.checkpoint.boxes import Box, flat_range_to_boxes
from shardwise.checkpoint.raw_storage import RawAwareReader, RawWriter
from shardwise.comm.group_type import Group

Piece = tuple[int, int, torch.Tensor]
"""``(start, stop, data)``: flat elements ``[start, stop)`` of a tensor, held in 1-D ``data``."""


class FlatShards:
    """The parts of one checkpointed tensor that this rank holds, as flat-range pieces.

    Each piece is a 1-D tensor (usually a view into a ZeRO shard) holding a contiguous range
    of the tensor's flattened elements. DCP sees rectangular chunks at the tensor's real
    shape, so writes go straight from the views and reads land straight in them.

    Example:
        >>> flat = torch.arange(20.0)
        >>> shards = FlatShards((4, 5), torch.float32, [(3, 17, flat[3:17])])
        >>> [tuple(t.shape) for t in shards.local_tensors()]
        [(1, 2), (2, 5), (1, 2)]
    """

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, pieces: Iterable[Piece]) -> None:
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self._boxes: list[tuple[Box, torch.Tensor]] = []
        for start, stop, data in pieces:
            assert data.dim() == 1 and data.numel() == stop - start, (
                f"piece [{start}, {stop}) holds {tuple(data.shape)} elements"
            )
            for box in flat_range_to_boxes(self.shape, start, stop):
                lo = box.flat_start - start
                self._boxes.append((box, data[lo : lo + box.numel].view(box.sizes)))

    # ------------------------------------------------------------------ plain accessors
    def size(self) -> torch.Size:
        """The global shape (DCP compares it with the saved one before reading)."""
        return self.shape

    def local_tensors(self) -> list[torch.Tensor]:
        """The boxes' tensors (views), in flat order."""
        return [t for _, t in self._boxes]

    def fill_from(self, full: torch.Tensor) -> None:
        """Copy this rank's boxes out of the full tensor (imports, full-state loads)."""
        if tuple(full.shape) != tuple(self.shape):
            raise ValueError(f"expected a tensor of shape {tuple(self.shape)}, got {tuple(full.shape)}")
        with torch.no_grad():
            for box, tensor in self._boxes:
                region = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))
                tensor.copy_(full[region])

    def snapshot(self) -> FlatShards:
        """A copy on the CPU that later training steps cannot change (for asynchronous saves)."""
        copy = FlatShards.__new__(FlatShards)
        copy.shape, copy.dtype = self.shape, self.dtype
        copy._boxes = [(box, t.detach().to("cpu", copy=True)) for box, t in self._boxes]
        return copy

    # ------------------------------------------------------------------ DCP's _Checkpointable hooks
    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(box.offsets), i),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes)),
                    properties=TensorProperties(dtype=self.dtype),
                    size=self.shape,
                ),
            )
            for i, (box, _) in enumerate(self._boxes)
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))
            for box, _ in self._boxes
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        offsets = tuple(index.offset) if index.offset is not None else ()
        if index.index is not None and index.index < len(self._boxes):
            box, tensor = self._boxes[index.index]
            if box.offsets == offsets:
                return tensor
        for box, tensor in self._boxes:
            if box.offsets == offsets:
                return tensor
        raise ValueError(f"{index.fqn}: this rank holds no chunk at offsets {offsets}")


class ShardSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, taught to find :class:`FlatShards` chunks.

    Why a subclass: the default ``lookup_object`` only resolves chunk indices for
    torch.Tensor subclasses; FlatShards is deliberately not a tensor subclass (it is a
    view onto several tensors). Nested dicts are not flattened: every value we save is a
    leaf (a tensor, FlatShards, or a small Python object written as bytes).
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, FlatShards):
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)


class ShardLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, taught to fill :class:`FlatShards` targets.

    Why a subclass: ``DefaultLoadPlanner.set_up_planner`` first runs a pass that
    materialises meta-device tensors and, as a side effect, replaces any value it does not
    recognise (our FlatShards) with None; we never load into meta tensors, so that pass is
    skipped. Loaded Python objects are written back into the caller's dict.
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=False)

    def set_up_planner(
        self, state_dict: dict[str, object], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        self.original_state_dict = state_dict
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, FlatShards):
            return obj.__get_tensor_shard__(index)
        return super().lookup_tensor(index)


# ---------------------------------------------------------------------------- what a checkpoint holds
@dataclass(frozen=True)
class SavedEntry:
    """One key of a saved checkpoint: a tensor (global shape and dtype) or a Python object."""

    shape: tuple[int, ...] | None
    dtype: torch.dtype | None

    @property
    def is_tensor(self) -> bool:
        """True for tensors, False for pickled Python objects."""
        return self.shape is not None


def read_metadata(path: str | os.PathLike[str]) -> Metadata:
    """DCP's ``.metadata`` of a checkpoint directory (small; no tensor data is read)."""
    return FileSystemReader(os.fspath(path)).read_metadata()


def saved_entries(metadata: Metadata) -> dict[str, SavedEntry]:
    """Every key of a checkpoint with its global shape and dtype (None for Python objects)."""
    out: dict[str, SavedEntry] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            out[key] = SavedEntry(tuple(md.size), md.properties.dtype)
        else:
            assert isinstance(md, BytesStorageMetadata), f"unknown DCP storage metadata {type(md)} for {key}"
            out[key] = SavedEntry(None, None)
    return out


class ChecksumWriter(RawWriter):
    """The raw-bytes DCP writer that also records the checksum of each file it wrote and of each item in it.

    Why a subclass: DCP's writer keeps no checksum, and its per-item results (file, offset,
    length) are only known here. After the files are written and fsynced, each is read back
    once (from the page cache) and checksummed as stored, whole and per item.

    Attributes:
        records: ``file name -> record`` (:data:`~shardwise.checkpoint.checksums.FileRecord`)
            for the files this rank wrote.
    """

    def __init__(self, path: str | os.PathLike[str], *, thread_count: int = 1) -> None:
        super().__init__(os.fspath(path), sync_files=True, thread_count=thread_count, overwrite=True)
        self.records: dict[str, checksums.FileRecord] = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[Any]]:
        future = super().write_data(plan, planner)
        items: dict[str, list[tuple[int, int, str]]] = {}
        for result in future.wait():
            info = result.storage_data
            items.setdefault(info.relative_path, []).append(
                (info.offset, info.length, _item_name(result.index))
            )
        prefix = plan.storage_data.prefix  # "__<rank>_": every file of this rank, empty ones included
        rank = int(prefix.strip("_"))
        for path in sorted(Path(self.path).glob(f"{prefix}*.distcp")):
            self.records[path.name] = checksums.record_file(path, items.get(path.name, []), rank=rank)
        return future


def _item_name(index: MetadataIndex) -> str:
    """``key`` or ``key@offsets`` for a chunk (how a damaged item is named)."""
    offsets = tuple(index.offset) if index.offset is not None else ()
    return f"{index.fqn}@{','.join(map(str, offsets))}" if any(offsets) else index.fqn


def save(
    state: dict[str, object],
    path: str | os.PathLike[str],
    *,
    process_group: Group = None,
    no_dist: bool = False,
    thread_count: int = 1,
) -> dict[str, checksums.FileRecord]:
    """Write ``state`` to ``path`` with DCP (collective over ``process_group`` unless ``no_dist``).

    Files are fsynced (``sync_files``): a checkpoint is only published once its bytes are
    on disk. ``.metadata`` is written last, by the coordinator, after every rank reported
    its writes, so when this returns on the coordinator every rank's data is complete.

    Returns:
        The checksum records of the data files this rank wrote (``.metadata`` not included).
    """
    writer = ChecksumWriter(path, thread_count=thread_count)
    with _plain_errors("saving", path):
        torch.distributed.checkpoint.save(
            state,
            storage_writer=writer,
            planner=ShardSavePlanner(),
            process_group=process_group,
            no_dist=no_dist,
        )
    return writer.records


def load(
    targets: dict[str, object], path: str | os.PathLike[str], *, process_group: Group = None, no_dist: bool = False
) -> None:
    """Fill ``targets`` in place from the checkpoint at ``path`` (collective unless ``no_dist``).

    Tensor and FlatShards targets are written into; other values are replaced by the saved
    Python objects.
    """
    reader = RawAwareReader(os.fspath(path))
    with _plain_errors("loading", path):
        torch.distributed.checkpoint.load(
            targets,
            storage_reader=reader,
            planner=ShardLoadPlanner(),
            process_group=process_group,
            no_dist=no_dist,
        )


@contextlib.contextmanager
def _plain_errors(what: str, path: str | os.PathLike[str]) -> Iterator[None]:
    """DCP reports a failure on any rank as ``CheckpointException`` on every rank, which derives
    from BaseException (``except Exception`` misses it): re-raise it as a RuntimeError naming
    the failing ranks and their first error, and quiet DCP's single-process warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as error:
            failures = error.failures
            first = next(iter(failures.values()), None) if failures else None
            cause = first[0] if isinstance(first, tuple) else first
            raise RuntimeError(
                f"{what} checkpoint {path} failed on rank(s) {sorted(failures)}: {type(cause).__name__}: {cause}"
            ) from error


class StreamingReader:
    """Reads one key at a time from a checkpoint in this process, without a process group.

    Used by export and import: the metadata is read once, then each ``read`` touches only
    the file ranges of that key, so memory stays near the largest tensor. (``dcp.load`` would
    re-read the metadata for every call and plans all keys together.)
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._reader = RawAwareReader(os.fspath(path))
        self.metadata = self._reader.read_metadata()
        self._reader.set_up_storage_reader(self.metadata, is_coordinator=True)
        self.entries = saved_entries(self.metadata)

    def read(self, key: str) -> Any:
        """The full tensor (plain, CPU, saved dtype) or the Python object saved under ``key``."""
        entry = self.entries.get(key)
        if entry is None:
            raise KeyError(f"{key!r} is not in the checkpoint at {self.path}")
        target: dict[str, object] = {
            key: torch.empty(entry.shape, dtype=entry.dtype) if entry.is_tensor else None  # type: ignore[arg-type]
        }
        self.read_into(target)
        return target[key]

    def read_into(self, targets: dict[str, object]) -> None:
        """Fill ``targets`` (any subset of keys; tensors, FlatShards, or placeholders)."""
        planner = ShardLoadPlanner()
        planner.set_up_planner(targets, self.metadata, is_coordinator=True)
        plan = planner.create_local_plan()
        plan = self._reader.prepare_local_plan(plan)
        plan = self._reader.prepare_global_plan([plan])[0]
        plan = planner.finish_plan(plan)
        self._reader.read_data(plan, planner).wait()
