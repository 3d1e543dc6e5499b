"""Per-rank bodies of test_snapshot_scale_down.py (module level so the harness can pickle them).

A tiny model at ZeRO-2 with an ``elasticity`` block (global batch 8, micro batch 2: gas 2 at two
ranks, 4 at one) reads a 64-sample dataset through the engine's loader; every sample carries its
index, so each step's samples are known.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import shardwise

SAMPLES = 64
ELASTIC = {"enabled": True, "max_train_batch_size": 8, "micro_batch_sizes": [2], "min_gpus": 1, "max_gpus": 2,
           "version": 0.1}  # fmt: skip


def _data() -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(4, generator=g), torch.randn(1, generator=g), i) for i in range(SAMPLES)]


def _engine(checkpoint: dict[str, Any]) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    config = {"elasticity": ELASTIC, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 2}, "checkpoint": checkpoint}  # fmt: skip
    engine, _, loader, _ = shardwise.initialize(
        model=model, model_parameters=model.parameters(), config=config, training_data=_data()
    )
    return engine, loader


def _train_to(engine: Any, loader: Any, last_step: int) -> list[list[int]]:
    """Train up to ``global_steps == last_step``; the sample indices this rank read, per step."""
    batches, seen = iter(loader), []
    while engine.global_steps < last_step:
        step = []
        for _ in range(engine.gradient_accumulation_steps()):
            x, y, index = next(batches)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            step += index.tolist()
        seen.append(step)
    return seen


def _weights(engine: Any) -> torch.Tensor:
    engine.optimizer.wait_for_parameters()
    return torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()])


def run(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """``case["op"]``: ``save`` (train, save_checkpoint), ``snapshots`` (train with snapshots, then
    stop as if killed), ``resume`` (load_checkpoint, train on), ``pipeline`` (:func:`pipelined`), ``agree`` (:func:`agree`)."""
    if case["op"] == "pipeline":
        return pipelined(rank, world, case)
    if case["op"] == "agree":
        return {"agreed": agree(rank)}
    root = Path(case["root"])
    snapshots = {"snapshot_interval": case["interval"], "snapshot_dir": str(root / "snaps")} if "interval" in case else {}
    engine, loader = _engine(snapshots)
    out: dict[str, Any] = {"gas": engine.gradient_accumulation_steps()}
    if case["op"] == "resume":
        engine.load_checkpoint(root / "ckpt")
        out["resumed_at"] = engine.global_steps
        report = engine.snapshots.last_resume if engine.snapshots is not None else None
        out["report"] = None if report is None else str(report)
    out["seen"] = _train_to(engine, loader, case["steps"])
    if case["op"] == "save":
        engine.save_checkpoint(root / "ckpt")
    engine.wait_for_checkpoint()  # a snapshot still being written is published (the kill comes after it)
    out["weights"] = _weights(engine)
    return out


def agree(rank: int) -> list[str]:
    """Node-local storage where rank 1's node never published the step-6 snapshot: both ranks must
    try the same candidates, the ones every node holds, newest first."""
    from shardwise.checkpoint.snapshot_io import agreed
    from shardwise.checkpoint.snapshots import Candidate

    node = Path(f"/node{rank}")
    found = [Candidate(node / "snapshot_step6", 6, True)] if rank == 0 else []
    found += [Candidate(node / "global_step5", 5, False), Candidate(node / "snapshot_step4", 4, True)]
    return [c.path.name for c in agreed(found)]


def pipelined(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """A 2-stage pipeline: ``train_batch`` ends its steps through the engine's snapshot call too.
    Train 3 steps (snapshots at 2), then a fresh pipeline resumes from the snapshot and redoes step 3."""
    import pipe_cases as pipe

    snapshots = {"snapshot_interval": 2, "snapshot_dir": str(Path(case["root"]) / "snaps")}
    engine = pipe.build_pipe(2, checkpoint=snapshots)
    losses = pipe.train(engine, 3)
    engine.wait_for_checkpoint()
    fresh = pipe.build_pipe(2, checkpoint=snapshots)
    fresh.load_checkpoint(Path(case["root"]) / "ckpt")
    return {"losses": losses, "resumed_at": fresh.global_steps, "redone": pipe.train(fresh, 1, first_step=2)}
