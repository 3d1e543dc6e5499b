"""Per-rank scenarios for test_client_api.py: what the HF clients read from the engine and optimizer."""

from __future__ import annotations

from typing import Any

import torch
from zero_reference import batch, config, make_model

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
    summed = torch.tensor([float(rank + 1)])
    shardwise.comm.inference_all_reduce(summed)  # deepspeed.comm's inference all-reduce: a plain sum
    return {
        "inference_all_reduce": float(summed),
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


def _whole(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if hasattr(param, "full_tensor") else param.detach()


def _losses(engine: Any, rank: int, steps: int) -> list[float]:
    out = []
    for step in range(steps):
        x, y = batch(step, 0, rank, 2)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        out.append(float(loss.detach()))
    return out


def load_module_state(rank: int, world: int, case: tuple[int, str]) -> dict[str, Any]:
    """``load_module_state_dict`` with whole tensors: an engine built on model 0 that loads model 1's
    state trains exactly like an engine built on model 1 (the fp32 masters followed the load)."""
    stage, precision = case
    torch.set_num_threads(1)
    cfg = config(stage, precision, 1, 2, world)
    loaded, _, _, _ = shardwise.initialize(model=make_model(0), config=cfg)
    state = make_model(1).state_dict()
    loaded.load_module_state_dict({"module": state})
    matches = all(
        torch.equal(_whole(p).float(), state[n].to(p.dtype).float())
        for n, p in loaded.module.named_parameters()
    )
    errors = []
    for bad in (
        {k: v for k, v in state.items() if k != "lm_head.weight"},
        {**state, "extra": torch.zeros(1)},
    ):
        try:
            loaded.load_module_state_dict({"module": bad})
        except RuntimeError as error:
            errors.append(str(error))
    wrong = {k: (v[:1] if k == "lm_head.weight" else v) for k, v in state.items()}
    try:
        loaded.load_module_state_dict({"module": wrong}, strict=False)
    except RuntimeError as error:
        errors.append(str(error))
    fresh, _, _, _ = shardwise.initialize(model=make_model(1), config=cfg)
    same_training = _losses(loaded, rank, 2) == _losses(fresh, rank, 2)
    same_params = all(
        torch.equal(_whole(a), _whole(b))
        for a, b in zip(loaded.module.parameters(), fresh.module.parameters())
    )
    loaded.destroy()
    fresh.destroy()
    return {"matches": matches, "errors": errors, "same_training": same_training, "same_params": same_params}


def partition_cache(rank: int, world: int, stage: int) -> dict[str, Any]:
    """``empty_partition_cache`` inside an accumulation window frees the units FSDP2 kept gathered
    (``engine.compile``: test_compile_blocks.py)."""
    torch.set_num_threads(1)
    zero = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
    cfg = config(stage, "fp32", 2, 2, world, **zero)

    def sharded_names(engine: Any) -> set[str]:
        return {n for n, p in engine.module.named_parameters() if hasattr(p, "device_mesh")}

    plain, _, _, _ = shardwise.initialize(model=make_model(), config=cfg)
    _losses(plain, rank, 4)  # two accumulation windows
    between_windows = sharded_names(plain)
    x, y = batch(0, 0, rank, 2)
    plain.backward(plain(x, y))  # a window's first micro step: kept units stay gathered
    gathered_mid_window = between_windows - sharded_names(plain)
    plain.empty_partition_cache()
    after_release = sharded_names(plain)
    x, y = batch(0, 1, rank, 2)
    plain.backward(plain(x, y))  # the next forward gathers again, and the window completes
    plain.step()
    result = {
        "between_windows": sorted(between_windows),
        "gathered_mid_window": sorted(gathered_mid_window),
        "after_release": sorted(after_release),
    }
    plain.destroy()
    return result
