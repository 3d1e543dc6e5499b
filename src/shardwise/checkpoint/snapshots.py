"""The periodic-snapshot policy: when the engine takes one, what it is called, which are kept,
which a resume tries first, and the report line of a resume.

``"checkpoint": {"snapshot_interval": N, "snapshot_dir": D, "snapshot_keep": K}`` (a shardwise
extension) makes the engine save an asynchronous checkpoint into ``D`` every ``N`` optimizer
steps, tagged ``snapshot_step<global step>``; the ``K`` newest stay while the next is written.
A snapshot is an ordinary checkpoint (atomic, checksummed, topology-free), so a crash during its
background write leaves the previous one and ``latest`` untouched. The publishing rank also
leaves a progress mark (``progress.json``: the last finished step) after every optimizer step,
so a resume can say how many steps the failure cost.

Everything here is pure or touches only ``D``'s small files; the saving and loading are
:mod:`shardwise.checkpoint.snapshot_io`'s.

Example:
    >>> policy = SnapshotPolicy(interval=4, directory=Path("snaps"), keep=1)
    >>> [step for step in range(1, 10) if policy.due(step)], policy.tag(8)
    ([4, 8], 'snapshot_step8')
    >>> policy.to_prune(["snapshot_step4", "global_step6", "snapshot_step8"], writing="snapshot_step12")
    ['snapshot_step4']
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from shardwise.config.sections.features import CheckpointConfig

SNAPSHOT_PREFIX = "snapshot_step"
PROGRESS_FILE = "progress.json"
_STEP_SUFFIX = re.compile(r"(\d+)$")


def snapshot_step(tag: str) -> int | None:
    """The global step of a snapshot tag (None for any other tag).

    Example:
        >>> snapshot_step("snapshot_step12"), snapshot_step("global_step12")
        (12, None)
    """
    rest = tag[len(SNAPSHOT_PREFIX) :] if tag.startswith(SNAPSHOT_PREFIX) else ""
    return int(rest) if rest.isdigit() else None


def step_from_tag(tag: str) -> int | None:
    """The trailing number of a tag (``global_step7`` -> 7), for checkpoints without a summary."""
    found = _STEP_SUFFIX.search(tag)
    return int(found.group(1)) if found else None


@dataclass(frozen=True)
class SnapshotPolicy:
    """When to snapshot and which snapshots to keep.

    Attributes:
        interval: optimizer steps between snapshots (> 0).
        directory: where the snapshots (and their ``latest``) go.
        keep: snapshots kept besides the one being written (>= 1).
    """

    interval: int
    directory: Path
    keep: int = 1

    def __post_init__(self) -> None:
        if self.interval < 1 or self.keep < 1:
            raise ValueError(
                f"SnapshotPolicy(interval={self.interval}, keep={self.keep}): both must be >= 1 "
                "(checkpoint.snapshot_interval 0 means no snapshots: build no policy)"
            )

    def due(self, global_step: int) -> bool:
        """Whether the optimizer step that just made ``global_steps == global_step`` is snapshotted."""
        return global_step > 0 and global_step % self.interval == 0

    def tag(self, global_step: int) -> str:
        """The snapshot's tag."""
        return f"{SNAPSHOT_PREFIX}{global_step}"

    def to_prune(self, tags: Iterable[str], writing: str | None = None) -> list[str]:
        """The snapshot tags to delete before ``writing`` (the next snapshot's tag) is written,
        oldest first: all but the ``keep`` newest others (``writing`` itself is replaced by the
        save, and tags that are not snapshots are never touched)."""
        snapshots = sorted(
            (step, tag) for tag in tags if (step := snapshot_step(tag)) is not None and tag != writing
        )
        return [tag for _, tag in snapshots[: max(len(snapshots) - self.keep, 0)]]


def policy_from_config(section: CheckpointConfig) -> SnapshotPolicy | None:
    """The policy of the config's ``checkpoint`` section (None when ``snapshot_interval`` is 0).

    Example:
        >>> from shardwise.config import load_config
        >>> section = load_config({"train_batch_size": 8, "checkpoint": {"snapshot_interval": 2,
        ...                        "snapshot_dir": "s"}}).config.checkpoint
        >>> policy_from_config(section)
        SnapshotPolicy(interval=2, directory=PosixPath('s'), keep=1)
    """
    if section.snapshot_interval == 0:
        return None
    assert section.snapshot_dir, "config checks require snapshot_dir with snapshot_interval"
    return SnapshotPolicy(section.snapshot_interval, Path(section.snapshot_dir), section.snapshot_keep)


@dataclass(frozen=True)
class Candidate:
    """A checkpoint a resume may load.

    Attributes:
        path: its tag directory.
        step: the global step it holds.
        snapshot: taken by the engine (False: a ``save_checkpoint`` of the script).
    """

    path: Path
    step: int
    snapshot: bool


def newest_first(candidates: Iterable[Candidate]) -> list[Candidate]:
    """Candidates in the order a resume tries them: highest step first; at the same step the
    script's own checkpoint first (it carries the script's ``client_state``); each path once.

    Example:
        >>> a, b = Candidate(Path("c/global_step4"), 4, False), Candidate(Path("s/snapshot_step4"), 4, True)
        >>> [c.path.name for c in newest_first([b, Candidate(Path("s/snapshot_step2"), 2, True), a, a])]
        ['global_step4', 'snapshot_step4', 'snapshot_step2']
    """
    seen: set[Path] = set()
    unique = []
    for candidate in candidates:
        key = candidate.path.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(candidate)
    return sorted(unique, key=lambda c: (-c.step, c.snapshot))


@dataclass(frozen=True)
class ResumeReport:
    """What a resume did, for its report line (``str(report)``).

    Attributes:
        step: the global step resumed at.
        path: the checkpoint loaded.
        snapshot: it was a snapshot.
        reached: the last step the previous run finished (its progress mark), None if unknown.
        attempt: torch elastic's ``TORCHELASTIC_RESTART_COUNT`` (0 outside a restart).
        world_size: ranks now.
        saved_world_size: ranks that wrote the checkpoint (None if unknown).
        skipped: newer candidates that did not verify, with why.
    """

    step: int
    path: Path
    snapshot: bool
    reached: int | None = None
    attempt: int = 0
    world_size: int = 1
    saved_world_size: int | None = None
    skipped: tuple[str, ...] = field(default_factory=tuple)

    @property
    def redone(self) -> int | None:
        """Steps the previous run finished that are trained again (None if unknown)."""
        return None if self.reached is None else max(self.reached - self.step, 0)

    @property
    def after_failure(self) -> bool:
        """A restart, or a resume that redoes steps (worth a warning, not an info line)."""
        return self.attempt > 0 or bool(self.redone) or bool(self.skipped)

    def __str__(self) -> str:
        kind = "snapshot" if self.snapshot else "checkpoint"
        where = f"restart {self.attempt}: " if self.attempt else ""
        redone = (
            "the previous run's last step is unknown"
            if self.redone is None
            else f"the previous run reached step {self.reached}: {self.redone} step(s) redone"
        )
        ranks = (
            f"; world size {self.saved_world_size} -> {self.world_size}"
            if self.saved_world_size not in (None, self.world_size)
            else ""
        )
        skipped = f"; skipped (did not verify): {'; '.join(self.skipped)}" if self.skipped else ""
        return f"{where}resumed at step {self.step} from {kind} {self.path}; {redone}{ranks}{skipped}"


def write_progress(directory: Path, global_step: int, world_size: int, attempt: int) -> None:
    """Record the last finished step (the publishing rank, after every optimizer step).

    No fsync: the mark must survive the death of a process (the page cache does), not of the
    machine; it costs tens of microseconds.
    """
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{PROGRESS_FILE}.tmp"
    tmp.write_text(json.dumps({"global_step": global_step, "world_size": world_size, "attempt": attempt}))
    os.replace(tmp, directory / PROGRESS_FILE)


def read_progress(directory: Path) -> dict[str, int] | None:
    """The last progress mark in ``directory`` (None without one, or if it cannot be read)."""
    try:
        record = json.loads((directory / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("global_step"), int) else None
