"""Checksums across ranks: every rank's records gathered at save, verification shared at load.

At save each rank checksums the files it wrote (:class:`~shardwise.checkpoint.dcp_io.ChecksumWriter`);
:func:`gather_records` hands all of them to every rank, so the publishing rank(s) can write
them into the summary. At load, :func:`verify_before_load` checks the summary, DCP's index and
every file's size on every rank, and reads each data file in full on one rank only (the files
a rank wrote are read by the rank with that number, modulo the world size): the ranks then
agree, and on damage every rank raises the same :class:`~shardwise.checkpoint.integrity.CheckpointIntegrityError`
before any byte of the checkpoint is used.
"""

from __future__ import annotations

import re
import socket
import zlib
from pathlib import Path
from typing import Any, cast

from shardwise import comm
from shardwise.checkpoint import checksums, integrity, layout
from shardwise.comm.group_type import Group
from shardwise.comm.object_gather import all_gather_objects


def gather_records(
    records: dict[str, checksums.FileRecord], group: Group, alone: bool
) -> dict[str, checksums.FileRecord]:
    """All ranks' file records, on every rank (collective unless ``alone``)."""
    if alone:
        return dict(records)
    merged: dict[str, checksums.FileRecord] = {}
    for part in all_gather_objects(records, group):
        merged.update(cast("dict[str, checksums.FileRecord]", part))
    return merged


def checksums_section(
    staging: Path, records: dict[str, checksums.FileRecord], only_present: bool = False
) -> dict[str, Any]:
    """The summary's ``checksums``: DCP's ``.metadata`` (checksummed here) and the data files.

    ``only_present``: list only the files in ``staging`` (node-local storage, where each node's
    directory holds its own ranks' files).
    """
    size, digest = checksums.file_digest(staging / layout.DCP_METADATA)
    files = {name: rec for name, rec in records.items() if not only_present or (staging / name).is_file()}
    files[layout.DCP_METADATA] = {"bytes": size, checksums.ALGORITHM: digest}
    return {"algorithm": checksums.ALGORITHM, "files": files}


def _writer_rank(name: str, record: checksums.FileRecord) -> int:
    if "rank" in record:
        return int(record["rank"])
    found = re.match(r"__(\d+)_", name)
    return int(found.group(1)) if found else zlib.crc32(name.encode())


def verify_before_load(tag_dir: Path, group: Group) -> integrity.Verdict:
    """Verify a tag before loading it (collective); raise the same error on every rank if damaged.

    Raises:
        CheckpointIntegrityError: a file is missing, truncated or does not match its checksum.
    """
    rank, world = comm.get_rank(group), comm.get_world_size(group)

    def mine(name: str, record: checksums.FileRecord) -> bool:
        return _writer_rank(name, record) % world == rank

    verdict = integrity.verify_tag(tag_dir, read=mine)
    damaged = verdict.damaged if world == 1 else comm.all_reduce_max_flag(verdict.damaged, group=group)
    if damaged:
        verdict = integrity.verify_tag(tag_dir)  # every rank reads everything: the same message everywhere
        if not verdict.damaged:  # e.g. node-local storage: the damage is in another node's directory
            verdict = integrity.Verdict(
                tag_dir, "damaged", ["another rank found a damaged file; see its log"]
            )
        raise integrity.integrity_error(verdict)
    integrity.note_unverified(verdict)
    return verdict


def raise_if_any_failed(error: BaseException | None, group: Group, what: str) -> None:
    """Collective: when ``error`` is set on any rank, raise on every rank an error naming each
    failing rank, its host and what it got (instead of the others waiting in the next
    collective until the failed rank's exit breaks it).

    Raises:
        RuntimeError: ``what`` failed on at least one rank.
    """
    if comm.get_world_size(group) == 1:
        if error is not None:
            raise RuntimeError(f"{what} failed on {socket.gethostname()}: {error}") from error
        return
    if not comm.all_reduce_max_flag(error is not None, group=group):
        return
    mine = "" if error is None else f"rank {comm.get_rank()} (host {socket.gethostname()}): {type(error).__name__}: {error}"
    failures = [str(part) for part in all_gather_objects(mine, group) if part]
    raise RuntimeError(f"{what} failed on {len(failures)} rank(s): " + "; ".join(failures)) from error
