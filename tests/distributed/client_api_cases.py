"""Per-rank scenarios for test_client_api.py: what the HF clients read from the engine and optimizer."""

from __future__ import annotations

from typing import Any

import torch
from zero_reference import batch, make_model

import shardwise


def client_reads(rank: int, world: int, stage: int) -> dict[str, Any]:
    """fp16, accumulation 2: ``optimizer.overflow``, pending micro batches, ``config.get``, the ZeRO-3 export."""
    torch.set_num_threads(1)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,
        "steps_per_print": float("inf"),  # what accelerate writes
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "fp16": {"enabled": True, "initial_scale_power": 4},
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
    }
    engine, optimizer, _, _ = shardwise.initialize(model=make_model(), config=cfg)
    pending, overflow = [], []
    for step in range(3):
        for micro in range(2):
            x, y = batch(step, micro, rank, 2)
            loss = engine(x, y)
            if step == 1 and rank == 1:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
            pending.append(engine.pending_micro_batches)
        overflow.append(optimizer.overflow)
    full = engine._zero3_consolidated_16bit_state_dict()
    return {
        "pending": pending,
        "overflow": overflow,
        "stage_from_config": engine.config.get("zero_optimization", {}).get("stage"),
        "fp16_in_config": "fp16" in engine.config,
        "gather_on_save": engine.zero_gather_16bit_weights_on_model_save(),
        "steps_per_print": engine.steps_per_print(),
        "accessors": (
            engine.fp16_enabled(),
            engine.bfloat16_enabled(),
            engine.gradient_clipping(),
            engine.mp_world_size,
        ),
        "full": {k: v.float() for k, v in full.items()},
        "dtypes": sorted({str(v.dtype) for v in full.values()}),
    }
