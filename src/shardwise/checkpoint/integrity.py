"""Checksums of a checkpoint's files: recorded at save, verified before a load uses a byte.

Every file a shardwise save writes is listed in its summary (``shardwise_checkpoint.json``)
under ``checksums``: the size and CRC-32 of DCP's ``.metadata`` and of each rank's
``.distcp`` file, and per ``.distcp`` file the CRC-32 of every item DCP wrote into it (one
tensor chunk or one pickled object), so a damaged file is reported with the entries it
holds. The summary protects itself: ``summary_crc32`` is the CRC-32 of the file's own bytes
with that value written as eight zeros. CRC-32 (``zlib``) is used because it is the fastest
stdlib checksum (3-4 GB/s on one core; blake2b 0.85 GB/s) and finds accidental damage, which
is what it is for; it is no defence against deliberate tampering. The summary names the
algorithm and :data:`~shardwise.checkpoint.checksums.DIGESTS` maps names to functions, so a faster one (xxhash's xxh3 runs
at about 17 GB/s, but is not in the standard library) can be added without breaking old saves.

:func:`verify_tag` checks one tag directory; what it reads is selectable, so a multi-rank
load splits the work (:mod:`~shardwise.checkpoint.integrity_ranks`) and ``checkpoint info``
checks sizes only. Checkpoints saved before checksums existed (format version 1) get a
structural check (DCP's index readable, every file it names present and long enough) and
are reported as *unverified*; DeepSpeed checkpoints are ``torch.save`` zip files, whose
per-record CRC-32 is checked instead. :class:`CheckpointIntegrityError` names the tag, the
file, what was expected and what was found, and the newest other tag that verifies.

Filesystem only: torch is imported only to read an old checkpoint's ``.metadata``.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.checkpoint import layout
from shardwise.checkpoint.checksums import ALGORITHM, DIGESTS, FileRecord, damaged_items, file_digest
from shardwise.utils.logging import logger

SEAL_KEY = "summary_crc32"
_PLACEHOLDER = "0" * 8

ReadPolicy = Callable[[str, FileRecord], bool]
"""Which data files a verification reads in full: ``(file name, its record) -> bool``."""


class CheckpointIntegrityError(RuntimeError):
    """A checkpoint's files do not match the checksums recorded when it was saved."""


@dataclass
class Verdict:
    """The result of checking one tag directory.

    Attributes:
        tag_dir: the directory checked.
        status: ``"ok"`` (checksums match), ``"damaged"``, or ``"unverified"`` (no checksums
            recorded; only the structure was checked).
        problems: one line per damaged file: the file, what was expected, what was found.
        detail: what was checked, for display.
    """

    tag_dir: Path
    status: str
    problems: list[str] = field(default_factory=list)
    detail: str = ""

    @property
    def damaged(self) -> bool:
        """True when a file is missing, truncated or does not match its checksum."""
        return self.status == "damaged"


# ---------------------------------------------------------------------------- the sealed summary
def _crc32_hex(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


def seal_summary(summary: Mapping[str, object]) -> bytes:
    """The summary as JSON bytes carrying their own CRC-32 under ``summary_crc32``."""
    body = {**summary, SEAL_KEY: _PLACEHOLDER}
    text = json.dumps(body, indent=1, sort_keys=True, default=str).encode()
    marker = f'\n "{SEAL_KEY}": "{_PLACEHOLDER}"'.encode()
    assert text.count(marker) == 1, "the summary's seal must appear once, at the top level"
    return text.replace(marker, f'\n "{SEAL_KEY}": "{_crc32_hex(zlib.crc32(text))}"'.encode())


def write_sealed_summary(tag_dir: Path, summary: Mapping[str, object]) -> None:
    """Write the summary (atomically) with its seal."""
    layout.atomic_write_bytes(tag_dir / layout.SUMMARY, seal_summary(summary))


def read_checked_summary(tag_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(summary, problem)``: the parsed summary if intact, else None and what is wrong."""
    path = tag_dir / layout.SUMMARY
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, f"{layout.SUMMARY}: expected the summary (it holds the checksums), found no file"
    except OSError as error:
        return None, f"{layout.SUMMARY}: cannot be read ({error})"
    try:
        summary = json.loads(raw)
        if not isinstance(summary, dict):
            raise ValueError("not a JSON object")
    except ValueError as error:
        return None, f"{layout.SUMMARY}: expected JSON, found {len(raw)} bytes that are not ({error})"
    seal = re.findall(rb'\n "' + SEAL_KEY.encode() + rb'": "([0-9a-f]{8})"', raw)
    if len(seal) == 1:
        found = _crc32_hex(zlib.crc32(_blank_seal(raw, seal[0])))
        if found != seal[0].decode():
            return None, f"{layout.SUMMARY}: expected crc32 {seal[0].decode()}, found {found}"
        return summary, None
    if "checksums" in summary or int(summary.get("format_version", 1)) >= 2:
        return None, f"{layout.SUMMARY}: expected its own crc32 ('{SEAL_KEY}'), found none"
    return summary, None


def _blank_seal(raw: bytes, value: bytes) -> bytes:
    marker = b'\n "' + SEAL_KEY.encode() + b'": "'
    return raw.replace(marker + value, marker + _PLACEHOLDER.encode(), 1)


# ---------------------------------------------------------------------------- verifying
def read_all(name: str, record: FileRecord) -> bool:
    """A :data:`ReadPolicy` reading every file."""
    return True


def read_none(name: str, record: FileRecord) -> bool:
    """A :data:`ReadPolicy` checking sizes only (plus the small ``.metadata``)."""
    return False


def _check_file(tag_dir: Path, name: str, record: FileRecord, read: bool, algorithm: str) -> str | None:
    path = tag_dir / name
    want_bytes, want = int(record["bytes"]), record[algorithm]
    expected = f"{want_bytes} bytes ({algorithm} {want})"
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{name}: expected {expected}, found no file (missing)"
    if size != want_bytes:
        what = "empty" if size == 0 else "truncated" if size < want_bytes else "longer than saved"
        return f"{name}: expected {expected}, found {size} bytes ({what})"
    if not read:
        return None
    _, found = file_digest(path, algorithm)
    if found == want:
        return None
    hit = damaged_items(path, record, algorithm)
    where = f" (damaged entries: {', '.join(hit[:3])}{', ...' if len(hit) > 3 else ''})" if hit else ""
    return f"{name}: expected {algorithm} {want} over {want_bytes} bytes, found {algorithm} {found}{where}"


def verify_tag(tag_dir: Path, read: ReadPolicy = read_all) -> Verdict:
    """Check one checkpoint tag directory against its recorded checksums.

    Args:
        tag_dir: the tag directory (shardwise or DeepSpeed).
        read: which data files to read in full (CRC); the others are checked for presence and
            size only. DCP's ``.metadata`` and the summary are always read (they are small).

    Example:
        >>> # verify_tag(Path("ckpts/global_step10")).status   # 'ok', 'damaged' or 'unverified'
    """
    kind = layout.detect_kind(tag_dir)
    if kind in ("deepspeed", "universal"):
        return _verify_deepspeed(tag_dir, read)
    if kind is None:
        return Verdict(tag_dir, "damaged", [f"{tag_dir}: no checkpoint files (no .metadata, no summary)"])
    summary, problem = read_checked_summary(tag_dir)
    if problem is not None or summary is None:
        return Verdict(tag_dir, "damaged", [problem or f"{layout.SUMMARY}: unreadable"])
    checksums = summary.get("checksums")
    if not checksums:
        return _verify_structure(tag_dir)
    files: dict[str, FileRecord] = checksums.get("files", {})
    algorithm = checksums.get("algorithm", ALGORITHM)
    if algorithm not in DIGESTS:
        return Verdict(
            tag_dir, "unverified", [], f"checksummed with {algorithm!r}, unknown to this shardwise"
        )
    problems = [
        p
        for name, record in sorted(files.items())
        if (
            p := _check_file(
                tag_dir, name, record, name == layout.DCP_METADATA or read(name, record), algorithm
            )
        )
    ]
    total = sum(int(r["bytes"]) for r in files.values())
    detail = f"{len(files) + 1} files, {total} bytes, {algorithm}"
    return Verdict(tag_dir, "damaged" if problems else "ok", problems, detail)


def _verify_structure(tag_dir: Path) -> Verdict:
    """A checkpoint without checksums: DCP's index readable, every file it names long enough."""
    from shardwise.checkpoint import dcp_io

    note = "saved without checksums (before format version 2): only its structure was checked"
    try:
        metadata = dcp_io.read_metadata(tag_dir)
    except Exception as error:  # any unpickling failure means the same: the index is damaged
        return Verdict(
            tag_dir, "damaged", [f"{layout.DCP_METADATA}: cannot be read ({type(error).__name__}: {error})"]
        )
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    problems = []
    for name, end in sorted(needed.items()):
        path = tag_dir / name
        if not path.is_file():
            problems.append(f"{name}: expected at least {end} bytes (DCP's index), found no file (missing)")
        elif path.stat().st_size < end:
            size = path.stat().st_size
            what = "empty" if size == 0 else "truncated"
            problems.append(
                f"{name}: expected at least {end} bytes (DCP's index), found {size} bytes ({what})"
            )
    return Verdict(tag_dir, "damaged" if problems else "unverified", problems, note)


def _verify_deepspeed(tag_dir: Path, read: ReadPolicy) -> Verdict:
    """DeepSpeed's ``torch.save`` zip files: each record's CRC-32 (read) or the zip directory (not).

    Files in torch's legacy (pre-1.6, non-zip) format carry no checksum: unverified.
    """
    problems, legacy = [], []
    files = sorted(tag_dir.rglob("*.pt"))  # a universal checkpoint's zero/<param>/<state>.pt included
    for path in files:
        name = str(path.relative_to(tag_dir))
        with open(path, "rb") as handle:
            head = handle.read(4)
        if head[:1] == b"\x80":  # a pickle: torch's legacy format
            legacy.append(name)
            continue
        record: FileRecord = {"bytes": path.stat().st_size}
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip() if read(name, record) else None
        except (zipfile.BadZipFile, OSError, EOFError) as error:
            problems.append(
                f"{name}: expected a complete torch.save zip file, found a damaged one ({error})"
            )
            continue
        if bad is not None:
            problems.append(
                f"{name}: expected record {bad} to match the CRC-32 stored with it, found other bytes"
            )
    if problems:
        return Verdict(tag_dir, "damaged", problems)
    if legacy:
        return Verdict(
            tag_dir, "unverified", [], f"DeepSpeed files in torch's legacy format: {', '.join(legacy)}"
        )
    return Verdict(tag_dir, "ok", [], f"{len(files)} DeepSpeed files, zip CRC-32 of every record")


def tag_dirs(path: str | os.PathLike[str], tag: str | None = None) -> list[Path]:
    """The tag directories to check: ``tag`` in ``path``, ``path`` itself if it is one, or all its tags."""
    root = Path(path)
    if tag is not None:
        return [layout.tag_path(root, layout.check_tag(tag))]
    if layout.detect_kind(root):
        return [root]
    return [root / name for name in layout.list_tags(root)]


def require_intact(tag_dir: Path) -> Verdict:
    """Verify ``tag_dir`` in full; raise :class:`CheckpointIntegrityError` if it is damaged.

    Example:
        >>> # require_intact(Path("ckpts/global_step10"))   # before exporting it
    """
    verdict = verify_tag(tag_dir)
    if verdict.damaged:
        raise integrity_error(verdict)
    note_unverified(verdict)
    return verdict


# ---------------------------------------------------------------------------- reporting
def last_verified_tag(root: Path, exclude: str | None = None) -> tuple[str | None, str | None]:
    """``(newest tag that verifies, newest tag without checksums whose structure is intact)``.

    The second is only looked for up to the first: a tag older than a verified one is never advice.
    """
    unverified = None
    for tag in reversed(layout.list_tags(root)):
        if tag == exclude:
            continue
        status = verify_tag(root / tag).status
        if status == "ok":
            return tag, unverified
        if status == "unverified" and unverified is None:
            unverified = tag
    return None, unverified


def integrity_error(verdict: Verdict) -> CheckpointIntegrityError:
    """The error for a damaged tag: the tag, each file's expected and found, the last good tag."""
    tag_dir = verdict.tag_dir
    root = tag_dir.parent
    good, unverified = last_verified_tag(root, exclude=tag_dir.name)
    if good is not None:
        advice = f"the last tag in {root} that verifies is {good!r} (load_checkpoint(dir, tag={good!r}))"
    else:
        advice = f"no other tag in {root} verifies"
    if unverified is not None:
        newer = " is newer but" if good is not None else ""
        advice += (
            f"; {unverified!r}{newer} has no checksums (only its structure was checked, and it is intact)"
        )
    return CheckpointIntegrityError(
        f"checkpoint tag {tag_dir.name!r} in {root} is damaged: {'; '.join(verdict.problems)}; {advice}"
    )


_NOTED: set[str] = set()


def note_unverified(verdict: Verdict) -> None:
    """Log once per tag that a checkpoint without checksums is used unverified."""
    key = os.fspath(verdict.tag_dir)
    if verdict.status == "unverified" and key not in _NOTED:
        _NOTED.add(key)
        logger.warning("checkpoint %s has no checksums (%s); loading it unverified", key, verdict.detail)
