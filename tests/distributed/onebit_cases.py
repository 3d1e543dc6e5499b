"""Per-rank scenarios for test_onebit_adam_engine.py: OneBitAdam through the real engine, stage 0.

The reference optimizer is ``Adam`` with ``bias_correction: false`` (AdamNoBiasCorrection, AdamW
form): DeepSpeed's 1-bit Adam update, so during warm-up the two must agree bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from checkpoint_cases import build, full_optimizer_state, full_params, train

from shardwise.comm.comms_logger import COMMS_LOGGER

HYPER = {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}


def onebit(freeze_step: int) -> dict[str, Any]:
    return {"type": "OneBitAdam", "params": {**HYPER, "freeze_step": freeze_step}}


ADAM = {"type": "Adam", "params": {**HYPER, "bias_correction": False}}


def _params(engine: Any) -> dict[str, torch.Tensor]:
    return full_params(engine)


def warm_up_is_adam(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """``freeze_step`` steps of OneBitAdam equal Adam's; the step after them does not."""
    freeze, precision = case["freeze"], case["precision"]
    out: dict[str, Any] = {}
    runs = {}
    for name, opt in (("onebit", onebit(freeze)), ("adam", ADAM)):
        engine, batches = build(0, world, precision, optimizer=opt, scheduler=None)
        losses = train(engine, batches, freeze)
        warm = _params(engine)
        later = train(engine, batches, 2)
        runs[name] = (losses, warm, later, _params(engine))
        engine.destroy()
    a, b = runs["onebit"], runs["adam"]
    out["warm_losses_equal"] = a[0] == b[0]
    out["warm_params_equal"] = all(torch.equal(v, b[1][k]) for k, v in a[1].items())
    out["after_params_differ"] = any(not torch.equal(v, b[3][k]) for k, v in a[3].items())
    out["after_losses"] = (a[2], b[2])
    return out


def _step_bytes(engine: Any, batches: Any) -> int:
    COMMS_LOGGER.reset()
    train(engine, batches, 1)
    total = 0
    for sizes in COMMS_LOGGER.summary().values():
        for size, row in sizes.items():
            total += size * row["count"]
    return total


def bytes_per_step(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Bytes one rank puts on the wire per optimizer step, in warm-up and after it."""
    engine, batches = build(
        0, world, "fp32", optimizer=onebit(2), scheduler=None, comms_logger={"enabled": True}
    )
    numel = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    train(engine, batches, 1)
    warm = _step_bytes(engine, batches)  # step 2: still the fp32 all-reduce
    compressed = [_step_bytes(engine, batches) for _ in range(2)]  # steps 3, 4: 1-bit
    ops = sorted(COMMS_LOGGER.summary())
    engine.destroy()
    COMMS_LOGGER.configure(None)
    COMMS_LOGGER.reset()
    return {"numel": numel, "warm": warm, "compressed": compressed, "ops": ops}


def resume_is_bit_exact(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train 4 steps (2 warm-up, 2 compressed), save, train 3; versus a fresh engine loading and training 3."""
    root = Path(case["dir"])
    engine, batches = build(0, world, case["precision"], optimizer=onebit(2), scheduler=None)
    train(engine, batches, 4)
    engine.save_checkpoint(root)
    reference = train(engine, batches, 3)
    ref_params = _params(engine)
    ref_state = full_optimizer_state(engine)
    errors = engine.optimizer.optimizer.rank_state_dict()["exchange"]
    engine.destroy()
    resumed, batches2 = build(0, world, case["precision"], seed=1, optimizer=onebit(2), scheduler=None)
    resumed.load_checkpoint(root)
    again = train(resumed, batches2, 3)
    state = full_optimizer_state(resumed)
    errors2 = resumed.optimizer.optimizer.rank_state_dict()["exchange"]
    return {
        "losses": (reference, again),
        "params_equal": all(torch.equal(v, _params(resumed)[k]) for k, v in ref_params.items()),
        "optimizer_equal": all(
            torch.equal(v, state[k]) if torch.is_tensor(v) else v == state[k]
            for k, v in ref_state.items()
            if k != "optim/param_groups"
        ),
        "errors_equal": torch.equal(errors["worker_error"], errors2["worker_error"])
        and torch.equal(errors["server_error"], errors2["server_error"]),
        "errors_nonzero": bool(errors["worker_error"].abs().sum() > 0),
    }


def converges_like_adam(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Losses of OneBitAdam and Adam over ``steps`` steps on the demo GPT."""
    out = {}
    for name, opt in (("onebit", onebit(case["freeze"])), ("adam", ADAM)):
        engine, batches = build(0, world, "fp32", optimizer=opt, scheduler=None)
        out[name] = train(engine, batches, case["steps"])
        engine.destroy()
    return out


def later_stage_is_refused(rank: int, world: int, case: dict[str, Any]) -> str:
    try:
        build(case["stage"], world, "fp32", optimizer=onebit(2), scheduler=None)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"
