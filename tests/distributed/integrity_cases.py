"""Per-rank scenarios for test_checkpoint_integrity.py: 2-rank saves (sync and async) whose
files the test then damages, and loads that must refuse them on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from checkpoint_cases import build, full_params, train

from shardwise.checkpoint import engine_io
from shardwise.checkpoint.integrity import CheckpointIntegrityError


def save_sync_then_async(rank: int, world: int, root: str) -> None:
    """Tag ``good`` from a synchronous save, then tag ``bad`` (latest) from an asynchronous one."""
    engine, batches = build(2, world)
    train(engine, batches, 2)
    engine.save_checkpoint(root, tag="good")
    torch.save(full_params(engine), Path(root) / f"good_rank{rank}.pt")
    engine, batches = build(2, world, seed=3, checkpoint={"async_save": True})
    train(engine, batches, 3)
    engine.save_checkpoint(root, tag="bad")
    train(engine, batches, 1)  # runs while the files are written and checksummed
    engine_io.wait_for_checkpoint(engine)


def load_or_error(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Load ``latest`` into a fresh engine: the error (if any) and whether the weights were touched."""
    engine, _ = build(2, world, seed=11)
    before = full_params(engine)
    error = None
    try:
        engine.load_checkpoint(case["dir"], tag=case.get("tag"))
    except CheckpointIntegrityError as exc:
        error = str(exc)
    after = full_params(engine)
    return {"error": error, "untouched": all(torch.equal(before[k], v) for k, v in after.items())}
