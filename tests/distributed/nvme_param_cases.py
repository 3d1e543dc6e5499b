"""Scenarios for test_nvme_param_offload.py: parameters offloaded to NVMe, read between steps."""

from __future__ import annotations

from typing import Any

import torch
from zero_reference import batch, config, make_model

import shardwise


def _engine(rank: int, world: int, nvme: str) -> Any:
    cfg = config(3, "fp32", 1, 2, world, stage3_param_persistence_threshold=0)
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme}
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    return engine


def _step(engine: Any, rank: int, step: int) -> None:
    x, y = batch(step, 0, rank, 2)
    engine.backward(engine(x, y))
    engine.step()


def read_between_steps(rank: int, world: int, nvme: str) -> dict[str, Any]:
    """``full_tensor()``/``to_local()`` outside GatheredParameters while the shards are in the file."""
    torch.set_num_threads(1)
    engine = _engine(rank, world, nvme)
    record = engine.optimizer.record
    _step(engine, rank, 0)
    sharded = [(n, p) for n, p in engine.module.named_parameters() if hasattr(p, "full_tensor")]
    evicted_before = not record.swapper.resident
    outside = {n: p.detach().full_tensor().clone() for n, p in sharded}  # used to kill the process (SIGSEGV)
    locals_outside = {n: p.detach().to_local().clone() for n, p in sharded}
    still_evicted = not record.swapper.resident
    for _, p in sharded:  # an edit outside GatheredParameters is not kept (documented)
        p.detach().to_local().add_(1.0)
    inside = {}
    with shardwise.zero.GatheredParameters([p for _, p in sharded]):
        for n, p in engine.module.named_parameters():
            if n in outside:
                inside[n] = p.detach().clone()
    _step(engine, rank, 1)
    after = {n: p.detach().full_tensor().clone() for n, p in sharded}

    quiet = _engine(rank, world, nvme)  # the same two steps, nothing read in between
    _step(quiet, rank, 0)
    _step(quiet, rank, 1)
    untouched = {
        n: p.detach().full_tensor().clone() for n, p in quiet.module.named_parameters() if n in outside
    }
    engine.destroy()
    quiet.destroy()
    return {
        "count": len(sharded),
        "evicted_before": evicted_before,
        "still_evicted": still_evicted,
        "outside_equals_inside": all(torch.equal(outside[n], inside[n]) for n in outside),
        "local_nonempty": all(t.numel() > 0 for t in locals_outside.values()),
        "training_unchanged": all(torch.equal(after[n], untouched[n]) for n in after),
    }
