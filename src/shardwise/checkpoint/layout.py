"""The checkpoint directory: tags, ``latest``, staging and atomic publication.

::

    <save_dir>/
      latest                      the newest tag, no trailing newline (DeepSpeed's format)
      <tag>/                      one complete checkpoint
        .metadata, __<r>_0.distcp DCP's index and each rank's data file
        shardwise_checkpoint.json a human-readable summary (stage, world size, sizes, ...) and the
                                  checksum of every file (see shardwise.checkpoint.integrity)
      .<tag>.partial/             a save in progress (never read)

A save writes everything into ``.<tag>.partial`` and renames it to ``<tag>`` only when every
rank's bytes are on disk (fsynced); ``latest`` moves last, by an atomic ``os.replace``. An
exception or a killed process at any point leaves the previous checkpoint and ``latest``
untouched. Re-saving an existing tag moves the old directory aside to ``.<tag>.old`` for the
instant between the two renames; a load that finds ``<tag>`` missing falls back to it.

Filesystem only: no torch, no process group.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from shardwise.utils.logging import logger

LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"
UNIVERSAL_OPTIMIZER_STATE = "zero/optimizer_state.pt"  # marks DeepSpeed's universal layout
SUMMARY = "shardwise_checkpoint.json"
DCP_METADATA = ".metadata"


def check_tag(tag: object) -> str:
    """``str(tag)``, refusing names that are not a single directory name.

    Raises:
        ValueError: empty, hidden (starts with a dot) or containing a path separator.

    Example:
        >>> check_tag(7)
        '7'
    """
    text = str(tag)
    if not text or text.startswith(".") or "/" in text or "\\" in text or text in (LATEST, LATEST_UNIVERSAL):
        raise ValueError(
            f"checkpoint tag {text!r} is not usable as a directory name: it must be non-empty, not start "
            "with '.', contain no path separator and not be 'latest'; e.g. tag='global_step100'"
        )
    return text


def staging_dir(save_dir: Path, tag: str) -> Path:
    """Where a save of ``tag`` is written before it is published."""
    return save_dir / f".{tag}.partial"


def _old_dir(save_dir: Path, tag: str) -> Path:
    return save_dir / f".{tag}.old"


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def prepare_staging(save_dir: Path, tag: str) -> Path:
    """A fresh, empty staging directory (a stale one from a crashed save is removed)."""
    save_dir.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(save_dir, tag)
    if staging.exists():
        logger.info("removing %s left by an interrupted save", staging)
        shutil.rmtree(staging)
    staging.mkdir()
    return staging


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write a whole file or nothing: temporary file, fsync, ``os.replace``."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def publish(save_dir: Path, tag: str) -> Path:
    """Rename the complete staging directory to ``<tag>`` (replacing an older save of it)."""
    staging, final, old = staging_dir(save_dir, tag), save_dir / tag, _old_dir(save_dir, tag)
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.rename(final, old)
    os.rename(staging, final)
    fsync_dir(save_dir)
    if old.exists():
        shutil.rmtree(old)
    return final


def write_latest(save_dir: Path, tag: str, name: str = LATEST) -> None:
    """Point ``latest`` at ``tag`` atomically (text, no trailing newline)."""
    atomic_write_bytes(save_dir / name, tag.encode())


def read_latest(load_dir: Path, name: str = LATEST) -> str | None:
    """The tag ``latest`` names, or None when there is no such file."""
    path = load_dir / name
    if not path.is_file():
        return None
    return path.read_text().strip()


def tag_path(load_dir: Path, tag: str) -> Path:
    """The directory of ``tag``; falls back to ``.<tag>.old`` if a re-save was cut between its renames.

    Raises:
        FileNotFoundError: neither exists.
    """
    final = load_dir / tag
    if final.is_dir():
        return final
    old = _old_dir(load_dir, tag)
    if old.is_dir():
        logger.warning(
            "checkpoint %s is missing; a re-save was interrupted; loading the previous %s", final, old
        )
        return old
    available = ", ".join(list_tags(load_dir)) or "none"
    raise FileNotFoundError(f"no checkpoint tag {tag!r} in {load_dir} (tags there: {available})")


def detect_kind(path: Path) -> str | None:
    """``"shardwise"`` (a DCP checkpoint), ``"universal"`` (DeepSpeed's universal layout:
    ``*_model_states.pt`` and ``zero/optimizer_state.pt``), ``"deepspeed"`` (DeepSpeed's native
    ``*_model_states.pt``) or None.

    A directory with shardwise's summary or DCP data files but no ``.metadata`` is a damaged
    shardwise checkpoint, not "no checkpoint" (verification then names the missing file).
    """
    if (path / DCP_METADATA).is_file() or (path / SUMMARY).is_file() or any(path.glob("*.distcp")):
        return "shardwise"
    if any(path.glob("*model_states.pt")):
        return "universal" if (path / UNIVERSAL_OPTIMIZER_STATE).is_file() else "deepspeed"
    return None


def list_tags(save_dir: Path) -> list[str]:
    """Checkpoint tags in a directory, oldest first (by modification time)."""
    if not save_dir.is_dir():
        return []
    tags = [p for p in save_dir.iterdir() if p.is_dir() and not p.name.startswith(".") and detect_kind(p)]
    return [p.name for p in sorted(tags, key=lambda p: (p.stat().st_mtime, p.name))]


def dir_bytes(path: Path) -> int:
    """Total size of the files under ``path``."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def read_summary(tag_dir: Path) -> dict[str, Any]:
    """The summary of a shardwise checkpoint ({} if absent)."""
    path = tag_dir / SUMMARY
    return json.loads(path.read_text()) if path.is_file() else {}


def resolve(path: str | os.PathLike[str], tag: str | None = None, latest_name: str = LATEST) -> Path:
    """A checkpoint's tag directory from a save directory (+ tag or ``latest``) or a tag directory.

    Raises:
        FileNotFoundError: nothing loadable there.
    """
    root = Path(path)
    if tag is not None:
        return tag_path(root, check_tag(tag))
    if detect_kind(root):
        return root
    latest = read_latest(root, latest_name) or read_latest(root)
    if latest is not None:
        return tag_path(root, latest)
    tags = list_tags(root)
    if tags:
        return root / tags[-1]
    raise FileNotFoundError(f"{root} holds no checkpoint: no '{latest_name}' file and no tag directory")
