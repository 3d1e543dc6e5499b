"""Per-rank scenarios for test_zero_one_adam_engine.py and test_onebit_lamb_engine.py: ZeroOneAdam
and OneBitLamb through the real engine at ZeRO stage 0 (the demo GPT).

References: ``Adam`` with ``bias_correction: false`` (AdamW form) for 0/1 Adam's variance steps,
``Lamb`` with ``bias_correction: false`` for 1-bit Lamb's warm-up: DeepSpeed's updates, so the
pairs must agree bit for bit there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from checkpoint_cases import build, full_optimizer_state, full_params, train

from shardwise.comm.comms_logger import COMMS_LOGGER

HYPER = {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}
# variance steps 1, 2, 4, 6 (1-bit: 3, 5); after the freeze: syncs at 7, 8, 10, 12, 16, 20 (local: 9, 11, 13-15)
ZERO_ONE_SCHEDULE = {
    "var_freeze_step": 6,
    "var_update_scaler": 2,
    "local_step_scaler": 2,
    "local_step_clipper": 4,
}


def zero_one(**schedule: int) -> dict[str, Any]:
    return {"type": "ZeroOneAdam", "params": {**HYPER, **(schedule or ZERO_ONE_SCHEDULE)}}


def onebit_lamb(freeze_step: int) -> dict[str, Any]:
    return {"type": "OneBitLamb", "params": {**HYPER, "freeze_step": freeze_step}}


ADAM = {"type": "Adam", "params": {**HYPER, "bias_correction": False}}
LAMB = {"type": "Lamb", "params": {**HYPER, "bias_correction": False}}


def _pair(case: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(optimizer, its uncompressed reference, the steps where they must agree)."""
    if case["kind"] == "zero_one":
        return zero_one(var_freeze_step=100, var_update_scaler=case["agree"]), ADAM, case["agree"]
    return onebit_lamb(case["agree"]), LAMB, case["agree"]


def warm_up_is_uncompressed(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """The optimizer equals its reference for ``agree`` steps; the step after them differs."""
    optimizer, reference, agree = _pair(case)
    runs = {}
    for name, opt in (("onebit", optimizer), ("reference", reference)):
        engine, batches = build(0, world, case["precision"], optimizer=opt, scheduler=None)
        losses = train(engine, batches, agree)
        warm = full_params(engine)
        train(engine, batches, 1)
        runs[name] = (losses, warm, full_params(engine))
        engine.destroy()
    a, b = runs["onebit"], runs["reference"]
    return {
        "warm_losses_equal": a[0] == b[0],
        "warm_params_equal": all(torch.equal(v, b[1][k]) for k, v in a[1].items()),
        "after_params_differ": any(not torch.equal(v, b[2][k]) for k, v in a[2].items()),
    }


def traffic_per_step(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Per optimizer step: bytes one rank sends and the number of collectives (comms logger)."""
    optimizer = zero_one() if case["kind"] == "zero_one" else onebit_lamb(2)
    engine, batches = build(
        0, world, "fp32", optimizer=optimizer, scheduler=None, comms_logger={"enabled": True}
    )
    numel = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    steps = []
    for _ in range(case["steps"]):
        COMMS_LOGGER.reset()
        train(engine, batches, 1)
        rows = [
            (size, row["count"]) for sizes in COMMS_LOGGER.summary().values() for size, row in sizes.items()
        ]
        steps.append((sum(size * count for size, count in rows), sum(count for _, count in rows)))
    engine.destroy()
    COMMS_LOGGER.configure(None)
    COMMS_LOGGER.reset()
    return {"numel": numel, "steps": steps}


def _errors(engine: Any) -> dict[str, torch.Tensor]:
    return engine.optimizer.optimizer.rank_state_dict()["exchange"]


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def resume_is_bit_exact(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train ``before`` steps, save, train ``after``; versus a fresh engine loading and training ``after``."""
    root = Path(case["dir"])
    optimizer = zero_one() if case["kind"] == "zero_one" else onebit_lamb(2)
    engine, batches = build(0, world, case["precision"], optimizer=optimizer, scheduler=None)
    train(engine, batches, case["before"])
    at_save = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    gathered = [torch.empty_like(at_save) for _ in range(world)]
    dist.all_gather(gathered, at_save)
    engine.save_checkpoint(root)
    reference = train(engine, batches, case["after"])
    ref_params, ref_state, errors = full_params(engine), full_optimizer_state(engine), _errors(engine)
    engine.destroy()
    resumed, batches2 = build(0, world, case["precision"], seed=1, optimizer=optimizer, scheduler=None)
    resumed.load_checkpoint(root)
    again = train(resumed, batches2, case["after"])
    params, state, errors2 = full_params(resumed), full_optimizer_state(resumed), _errors(resumed)
    resumed.destroy()
    return {
        "losses": (reference, again),
        "ranks_differ_at_save": not torch.equal(gathered[0], gathered[-1]),
        "params_equal": all(torch.equal(v, params[k]) for k, v in ref_params.items()),
        "optimizer_differs": sorted(
            k for k, v in ref_state.items() if k != "optim/param_groups" and not _same(v, state.get(k))
        ),
        "errors_equal": torch.equal(errors["worker_error"], errors2["worker_error"])
        and torch.equal(errors["server_error"], errors2["server_error"]),
        "errors_nonzero": bool(errors["worker_error"].abs().sum() > 0),
    }


def converges(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Losses of the optimizer and its uncompressed reference over ``steps`` steps."""
    if case["kind"] == "zero_one":
        pair = (zero_one(**case["schedule"]), {"type": "Adam", "params": {**HYPER, "bias_correction": False}})
    else:
        pair = (onebit_lamb(case["freeze"]), LAMB)
    out = {}
    for name, opt in zip(("onebit", "reference"), pair):
        engine, batches = build(0, world, "fp32", optimizer=opt, scheduler=None)
        out[name] = train(engine, batches, case["steps"])
        engine.destroy()
    return out
