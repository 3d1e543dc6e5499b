"""Rank scenarios for test_checkpoint_subset.py."""

from __future__ import annotations

import time
from typing import Any

import torch
from zero_reference import make_model

import shardwise


def save_on_rank0_only(rank: int, world: int, path: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    engine, _, _, _ = shardwise.initialize(
        model=make_model(),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2},
        },
    )
    start = time.monotonic()
    if rank == 0:
        try:
            engine.save_checkpoint(path)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
        return {"error": None, "seconds": time.monotonic() - start}
    time.sleep(8)  # rank 1 is busy elsewhere and never saves
    return {"error": None, "seconds": 0.0}
