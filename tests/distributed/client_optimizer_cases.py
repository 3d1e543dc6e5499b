"""Scenarios for test_client_optimizer.py: the client's optimizer object is the one that steps."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from zero_reference import BETAS, EPS, LR, WD, _full_masters, batch, config, make_model

import shardwise

STEPS = 3


def _lambda(step: int) -> float:
    return 1.0 + step  # the lr grows every step: a scheduler that does not drive the optimizer shows


def _config(case: dict[str, Any], world: int) -> dict[str, Any]:
    cfg = config(case["stage"], "fp32", 1, 2, world)
    cfg.pop("optimizer")
    if case.get("offload"):
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False  # a torch AdamW with offload: DeepSpeed's opt-in
    return cfg


def _stepping(engine: Any) -> Any:
    """The optimizer object whose ``step`` updates the weights (inside an offload proxy if any)."""
    inner = engine.optimizer.optimizer
    return getattr(inner, "inner", inner)


def _train(engine: Any, rank: int, sched: Any, steps: range, script_steps_scheduler: bool) -> None:
    for step in steps:
        x, y = batch(step, 0, rank, 2)
        engine.backward(engine(x, y))
        engine.step()
        if script_steps_scheduler:
            sched.step()


def _lrs(engine: Any, client: torch.optim.Optimizer, sched: Any) -> dict[str, Any]:
    return {
        "engine": engine.get_lr(),
        "client": [g["lr"] for g in client.param_groups],
        "scheduler": sched.get_last_lr(),
        "stepping_is_client": _stepping(engine) is client,
        "client_has_state": len(client.state) > 0,
    }


def client_optimizer_steps(rank: int, world: int, case: dict[str, Any], tmp: str) -> dict[str, Any]:
    """Client AdamW + LambdaLR built on it, passed to initialize or stepped by the script."""
    torch.set_num_threads(1)
    model = make_model()
    client = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    sched = torch.optim.lr_scheduler.LambdaLR(client, _lambda)
    passed = case["pass_scheduler"]
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, returned, _, returned_sched = shardwise.initialize(
            model=model, optimizer=client, lr_scheduler=sched if passed else None, config=_config(case, world)
        )
        # DeepSpeed's choice: the client's own object at stage 0 in fp32, the ZeRO wrapper above
        out["returned_is_deepspeeds_choice"] = returned is (client if case["stage"] == 0 else engine.optimizer)
        out["returned_scheduler_is_client"] = returned_sched is sched if passed else returned_sched is None
        _train(engine, rank, sched, range(STEPS), not passed)
        out["trained"] = _lrs(engine, client, sched)
        path = os.path.join(tmp, f"stage{case['stage']}-{int(passed)}-{int(bool(case.get('offload')))}")
        # a script that steps its own scheduler saves it itself (client_state)
        engine.save_checkpoint(path, tag="t", client_state={"sched": sched.state_dict()})
        _train(engine, rank, sched, range(STEPS, STEPS + 2), not passed)  # move away from the saved state
        _, client_state = engine.load_checkpoint(path, tag="t")
        if not passed:
            sched.load_state_dict(client_state["sched"])
        out["loaded"] = _lrs(engine, client, sched)
        _train(engine, rank, sched, range(STEPS, STEPS + 1), not passed)
        out["after_load_step"] = _lrs(engine, client, sched)
    out["warnings"] = [
        str(w.message)
        for w in caught
        if "lr_scheduler" in str(w.message) or "optimizer.step" in str(w.message)
    ]
    return out


def _weights(engine: Any, stage: int) -> list[torch.Tensor]:
    if stage == 3:
        return engine.optimizer.full_fp32_parameters()
    return _full_masters(engine)


def client_matches_json_optimizer(rank: int, world: int, stage: int) -> dict[str, Any]:
    """The same run with the JSON AdamW and with a client AdamW of the same settings: equal bits."""
    torch.set_num_threads(1)
    results = []
    flags: dict[str, Any] = {}
    for use_client in (False, True):
        model = make_model()
        cfg = config(stage, "fp32", 2, 2, world, clip=0.5)
        client = None
        if use_client:
            cfg.pop("optimizer")
            client = torch.optim.AdamW(
                model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **flags
            )
        engine, _, _, _ = shardwise.initialize(model=model, optimizer=client, config=cfg)
        if not use_client:  # the kernel the JSON optimizer chose (fused / foreach), for the client
            defaults = engine.optimizer.optimizer.defaults
            flags = {k: defaults[k] for k in ("fused", "foreach") if defaults.get(k)}
        for step in range(STEPS):
            for micro in range(2):
                x, y = batch(step, micro, rank, 2)
                engine.backward(engine(x, y))
                engine.step()
        results.append(_weights(engine, stage))
    json_run, client_run = results
    return {
        "flags": flags,
        "equal": all(torch.equal(a, b) for a, b in zip(json_run, client_run)),
        "count": len(json_run),
    }
