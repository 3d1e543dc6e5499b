"""Taking the engine's periodic snapshots and resuming from the newest checkpoint that verifies.

The engine calls :func:`after_optimizer_step` after every optimizer step and binds
:func:`load_checkpoint` as ``engine.load_checkpoint``; the policy (when, which tag, which to
keep) is :mod:`shardwise.checkpoint.snapshots`'. A snapshot is the checkpointer's ordinary
save, asynchronous whatever ``async_save`` says: the loop blocks only while the state is copied
to host memory; a background thread writes, checksums and publishes it like any save.

A resume is ``engine.load_checkpoint(load_dir)`` with no tag, as DeepSpeed scripts call it at
start: with snapshots configured it tries ``load_dir``'s ``latest`` and every snapshot, newest
step first, and loads the first that verifies (a damaged one is skipped, named in the report).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from shardwise import comm
from shardwise.checkpoint import engine_io, layout, publish
from shardwise.checkpoint.integrity import CheckpointIntegrityError
from shardwise.checkpoint.snapshots import (
    Candidate,
    ResumeReport,
    SnapshotPolicy,
    newest_first,
    policy_from_config,
    read_progress,
    snapshot_step,
    step_from_tag,
    write_progress,
)
from shardwise.comm.object_gather import all_gather_objects
from shardwise.config.sections.features import CheckpointConfig
from shardwise.utils.logging import logger


class SnapshottingEngine(engine_io.CheckpointedEngine, Protocol):
    """What these functions read from an engine besides the checkpoint parts."""

    snapshots: Snapshots | None

    @property
    def world_size(self) -> int:
        """All ranks."""
        ...


class Snapshots:
    """The engine's snapshot part: the policy, and what the last resume did.

    Attributes:
        policy: when and where snapshots are taken.
        last_resume: the report of the last resume through ``load_checkpoint`` (None before one).
    """

    def __init__(self, policy: SnapshotPolicy) -> None:
        self.policy = policy
        self.last_resume: ResumeReport | None = None
        self.first_step_done = False  # the restart-without-resume check runs once


def build_snapshots(section: CheckpointConfig) -> Snapshots | None:
    """The engine's snapshot part for the config's ``checkpoint`` section (None: no snapshots).

    Example:
        >>> from shardwise.config import load_config
        >>> build_snapshots(load_config({"train_batch_size": 8}).config.checkpoint) is None
        True
    """
    policy = policy_from_config(section)
    return None if policy is None else Snapshots(policy)


def _attempt() -> int:
    """torch elastic's restart count (0 outside a restart)."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def after_optimizer_step(engine: SnapshottingEngine) -> None:
    """Leave the progress mark and, when the policy says so, start a snapshot (every rank calls it).

    Raises:
        RuntimeError: the previous snapshot's background write failed (raised on every rank).
    """
    snapshots = engine.snapshots
    assert snapshots is not None, "the engine calls this only with snapshots configured"
    policy, step = snapshots.policy, engine.global_steps
    if not snapshots.first_step_done:
        snapshots.first_step_done = True
        _warn_if_restart_did_not_resume(snapshots, step)
    publisher = publish.is_publisher(engine.checkpointer.options.use_node_local_storage)
    if publisher:
        write_progress(policy.directory, step, engine.world_size, _attempt())
    if not policy.due(step):
        return
    engine.checkpointer.wait()  # the previous snapshot is published (or its error raised) before pruning
    tag = policy.tag(step)
    if publisher:
        for old in policy.to_prune(layout.list_tags(policy.directory), writing=tag):
            shutil.rmtree(policy.directory / old, ignore_errors=True)
    engine.checkpointer.save(
        engine_io.training_state(engine),
        policy.directory,
        tag=tag,
        client_state={},
        background=True,
    )


def _warn_if_restart_did_not_resume(snapshots: Snapshots, step: int) -> None:
    """A restarted run whose script never called ``load_checkpoint`` trains from scratch next to the
    snapshots it could have resumed: say so (once, at its first optimizer step)."""
    latest = layout.read_latest(snapshots.policy.directory)
    if snapshots.last_resume is None and _attempt() > 0 and latest is not None:
        logger.warning(
            "restart %d: %s holds snapshot %s but this run loaded none, so it trained step %d from where it "
            "started; call engine.load_checkpoint(save_dir) before training to resume from the newest snapshot",
            _attempt(),
            snapshots.policy.directory,
            latest,
            step,
        )


def _candidate(path: Path, snapshot: bool) -> Candidate:
    summary = layout.read_summary(path)
    step = summary.get("counters", {}).get("global_steps")
    if step is None:
        step = snapshot_step(path.name) if snapshot else step_from_tag(path.name)
    return Candidate(path, int(step) if step is not None else -1, snapshot)


def candidates(load_dir: Path, policy: SnapshotPolicy) -> list[Candidate]:
    """What a resume may load, in the order it tries them: ``load_dir``'s ``latest`` and every
    snapshot in the policy's directory."""
    found = []
    latest = layout.read_latest(load_dir)
    if latest is not None and (load_dir / latest).is_dir():
        found.append(_candidate(load_dir / latest, snapshot_step(latest) is not None))
    for tag in layout.list_tags(policy.directory):
        if snapshot_step(tag) is not None:
            found.append(_candidate(policy.directory / tag, True))
    return newest_first(found)


def agreed(found: list[Candidate]) -> list[Candidate]:
    """The candidates every rank sees (collective), in ``found``'s order.

    Ranks must try the same checkpoints in the same order: each load is collective. With node-local
    storage (or a shared file system still catching up) a crash between two nodes' publications can
    leave the nodes with different newest snapshots; trying only what all of them hold keeps the
    ranks in step instead of hanging them in different loads.
    """
    mine = [(c.path.name, c.step, c.snapshot) for c in found]
    if comm.get_world_size() == 1:
        return found
    common = set(mine)
    for theirs in all_gather_objects(mine, None):
        common &= {tuple(x) for x in theirs}  # type: ignore[attr-defined]
    dropped = [c.path.name for c in found if (c.path.name, c.step, c.snapshot) not in common]
    if dropped:
        logger.warning("resume: %s not on every rank's storage, so not a candidate", ", ".join(dropped))
    return [c for c in found if (c.path.name, c.step, c.snapshot) in common]


def load_checkpoint(
    engine: SnapshottingEngine,
    load_dir: str | Path,
    tag: object = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    custom_load_fn: Callable[..., object] | None = None,
) -> tuple[str | None, dict[str, Any] | None]:
    """``engine.load_checkpoint``: DeepSpeed's signature and behaviour; with snapshots configured
    and no ``tag``, the newest of ``load_dir``'s ``latest`` and the snapshots that verifies.

    Returns ``(path, client_state)`` (a snapshot's ``client_state`` holds only ``ds_config`` and
    ``global_samples``: read ``engine.global_steps``), or ``(None, None)`` when there is nothing.
    """
    options: dict[str, Any] = {
        "load_module_strict": load_module_strict,
        "load_optimizer_states": load_optimizer_states,
        "load_lr_scheduler_states": load_lr_scheduler_states,
        "load_module_only": load_module_only,
        "custom_load_fn": custom_load_fn,
    }
    snapshots = engine.snapshots
    if tag is not None or snapshots is None or engine.checkpointer.options.load_universal:
        # an explicit tag, or a universal checkpoint (`latest_universal`): snapshots are neither
        return engine_io.load_checkpoint(engine, load_dir, tag, **options)
    progress = read_progress(snapshots.policy.directory)
    tried = agreed(candidates(Path(load_dir), snapshots.policy))
    if not tried:
        return engine_io.load_checkpoint(engine, load_dir, None, **options)  # DeepSpeed's "no latest" warning
    skipped: list[str] = []
    for candidate in tried:
        try:
            path, client_state = engine_io.load_checkpoint(
                engine, candidate.path.parent, candidate.path.name, **options
            )
        except CheckpointIntegrityError as error:  # raised alike on every rank, before any byte is used
            skipped.append(f"{candidate.path}: {str(error).splitlines()[0]}")
            logger.warning("resume: %s does not verify, trying the next newest: %s", candidate.path, error)
            continue
        saved = layout.read_summary(candidate.path).get("world_size")
        report = ResumeReport(
            step=engine.global_steps,
            path=candidate.path,
            snapshot=candidate.snapshot,
            reached=None if progress is None else int(progress["global_step"]),
            attempt=_attempt(),
            world_size=comm.get_world_size(),
            saved_world_size=None if saved is None else int(saved),
            skipped=tuple(skipped),
        )
        snapshots.last_resume = report
        (logger.warning if report.after_failure else logger.info)("%s", report)
        return path, client_state
    raise CheckpointIntegrityError(
        f"no checkpoint to resume from verifies ({len(tried)} tried, newest first): " + "; ".join(skipped)
    )
