"""Writing a collected state into a tag directory and publishing it (every rank calls this).

DCP writes every rank's files into ``.<tag>.partial`` (fsynced); every rank checksums the
files it wrote and the checksums are gathered (:mod:`~shardwise.checkpoint.integrity_ranks`);
the publishing rank writes the sealed summary, renames the directory to ``<tag>`` and moves
``latest``. A failure anywhere is raised on every rank and publishes nothing. Also here:
which rank publishes, and the copy an asynchronous save writes from.
"""

from __future__ import annotations

import copy
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from shardwise import comm
from shardwise.checkpoint import checksums, dcp_io, integrity, integrity_ranks, layout
from shardwise.comm.fsdp_internals import is_dtensor
from shardwise.comm.group_type import Group
from shardwise.utils.logging import logger


def is_publisher(node_local: bool) -> bool:
    """Whether this rank writes the summary and renames: rank 0, or each node's first rank."""
    return comm.get_local_rank() == 0 if node_local else comm.get_rank() == 0


def write_and_publish(
    items: dict[str, object],
    root: Path,
    tag: str,
    summary: dict[str, object],
    save_latest: bool,
    group: Group,
    side_files: Mapping[str, object] | None = None,
    *,
    node_local: bool = False,
    thread_count: int = 1,
) -> None:
    """Write ``items`` with DCP into ``root``'s staging directory for ``tag``, then publish it.

    ``side_files`` (``file name -> object``) are this rank's ``torch.save`` files next to DCP's
    (DeepSpeed's MoE model files), checksummed with the rest.

    Raises:
        RuntimeError: the write or the publication failed (on any rank); nothing was published.
    """
    staging = layout.staging_dir(root, tag)
    start = time.perf_counter()
    alone = comm.get_world_size(group) == 1  # no collectives at all (also safe from a background thread)
    try:
        records = dcp_io.save(items, staging, process_group=group, no_dist=alone, thread_count=thread_count)
    except RuntimeError:
        if is_publisher(node_local):  # leave nothing half-written behind (latest was never moved)
            shutil.rmtree(staging, ignore_errors=True)
        raise
    for name, value in (side_files or {}).items():
        records[name] = _save_side_file(staging / name, value)
    if node_local and not alone:
        _share_metadata(staging, group)
    records = integrity_ranks.gather_records(records, group, alone)  # every rank's file checksums
    failure = None
    if is_publisher(node_local):
        try:
            summary["checksums"] = integrity_ranks.checksums_section(staging, records, node_local)
            summary["bytes"] = layout.dir_bytes(staging)
            integrity.write_sealed_summary(staging, summary)
            layout.publish(root, tag)
            if save_latest:
                layout.write_latest(root, tag)
        except OSError as error:
            failure = error
    integrity_ranks.raise_if_any_failed(failure, group, f"publishing checkpoint {root / tag}")
    logger.info("saved checkpoint %s in %.2fs", root / tag, time.perf_counter() - start)


def _save_side_file(path: Path, value: object) -> checksums.FileRecord:
    """``torch.save`` one file, fsynced; its checksum record."""
    with open(path, "wb") as handle:
        torch.save(value, handle)
        handle.flush()
        os.fsync(handle.fileno())
    return checksums.record_file(path, [], rank=comm.get_rank())


def _share_metadata(staging: Path, group: Group) -> None:
    """Node-local storage: every node's publisher needs DCP's index next to its files."""
    if comm.get_world_size(group) == 1:
        return
    data = (staging / layout.DCP_METADATA).read_bytes() if comm.get_rank() == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    comm.broadcast(size, src=0, group=group)
    payload = torch.zeros(int(size.item()), dtype=torch.uint8)
    if comm.get_rank() == 0:
        payload.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    comm.broadcast(payload, src=0, group=group)
    if comm.get_rank() != 0 and comm.get_local_rank() == 0:
        layout.atomic_write_bytes(staging / layout.DCP_METADATA, payload.numpy().tobytes())


def snapshot(items: dict[str, object]) -> dict[str, Any]:
    """Copies that training cannot change while a background thread writes them."""
    out: dict[str, object] = {}
    for key, value in items.items():
        if isinstance(value, dcp_io.FlatShards):
            out[key] = value.snapshot()
        elif torch.is_tensor(value):
            out[key] = value.detach().clone() if is_dtensor(value) else value.detach().to("cpu", copy=True)
        else:
            out[key] = copy.deepcopy(value)
    return out
