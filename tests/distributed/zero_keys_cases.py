"""Per-rank scenarios for test_zero_keys.py: each remaining zero_optimization key's effect."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from zero_reference import BETAS, EPS, LR, WD, batch, config, make_model

import shardwise
from shardwise.comm.comms_logger import COMMS_LOGGER
from shardwise.utils.logging import logger
from shardwise.zero.unused_parameters import UnusedParametersError


def _loss(engine: Any, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, 0, rank, 2)
    logits = engine(x)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))


def train_counting(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train 3 steps with the comms logger on; the collective calls made after start-up and the weights."""
    cfg = config(case["stage"], "fp32", 1, 2, world, **case.get("zero", {}))
    cfg.update(case.get("top", {}))
    cfg["comms_logger"] = {"enabled": True}
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    shardwise.comm.reset_log()
    losses = []
    for step in range(3):
        loss = _loss(engine, step, rank)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    calls = {op: sum(len(v) for v in sizes.values()) for op, sizes in COMMS_LOGGER.records.items()}
    sent = {op: sum(n * len(v) for n, v in sizes.items()) for op, sizes in COMMS_LOGGER.records.items()}
    shardwise.comm.configure(enabled=False)
    weights = [p.detach().clone() for p in engine.module.parameters()]
    engine.destroy()
    return {"calls": calls, "bytes": sent, "weights": weights, "losses": losses}


class _WithUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()
        self.spare = torch.nn.Linear(4, 4)  # never used in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def unused_parameters(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """A model with an unused Linear: the step raises naming it (false) or trains (true)."""
    cfg = config(case["stage"], "fp32", 1, 2, world, **case.get("zero", {}))
    engine, *_ = shardwise.initialize(model=_WithUnused(), config=cfg)
    engine.backward(_loss(engine, 0, rank))
    try:
        engine.step()
    except UnusedParametersError as error:
        return {"error": str(error)}
    finally:
        engine.destroy()
    return {"error": None}


def load_from_fp32(rank: int, world: int, case: dict[str, Any], tmp: str) -> dict[str, Any]:
    """bf16: save after 2 steps, load into a fresh engine with load_from_fp32_weights as given;
    the masters saved and the masters after the load."""
    cfg = config(case["stage"], "bf16", 1, 2, world)
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    for step in range(2):
        engine.backward(_loss(engine, step, rank))
        engine.step()
    engine.save_checkpoint(tmp, tag="t")
    saved_masters = _masters(engine)
    engine.destroy()
    cfg = config(case["stage"], "bf16", 1, 2, world, load_from_fp32_weights=case["fp32"])
    engine, *_ = shardwise.initialize(model=make_model(seed=5), config=cfg)
    engine.load_checkpoint(tmp, tag="t")
    out = {
        "masters": _masters(engine),
        "saved_masters": saved_masters,
    }
    engine.destroy()
    return out


def _masters(engine: Any) -> list[torch.Tensor]:
    """This rank's fp32 master shards (stages 1-2)."""
    return [m.detach().clone() for flat in engine.optimizer.groups for m in flat.master]


def dump_state(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """dump_state: true logs the resolved config once at start-up."""
    lines: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = _Keep(level=logging.INFO)
    logger.addHandler(handler)
    try:
        cfg = config(1, "fp32", 1, 2, world)
        cfg["dump_state"] = case["dump"]
        engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
        engine.destroy()
    finally:
        logger.removeHandler(handler)
    return {"dumps": [line for line in lines if "dump_state" in line]}


class _CustomAdamW(torch.optim.AdamW):
    """AdamW's maths under another class: shardwise cannot know it steps tensor by tensor."""


def _logged_warnings() -> tuple[logging.Handler, list[str]]:
    lines: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    return _Keep(level=logging.WARNING), lines


def sub_groups(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Stage 3, everything sharded: what each inner optimizer step() call sees over 3 steps, this
    rank's shards after them, and the warnings of initialize."""
    cfg = config(3, "fp32", 1, 2, world, stage3_param_persistence_threshold=0, **case.get("zero", {}))
    kwargs: dict[str, Any] = {}
    if case.get("custom"):
        cfg.pop("optimizer")
        cfg["zero_allow_untested_optimizer"] = True
        kwargs["optimizer"] = lambda ps: _CustomAdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    handler, warnings = _logged_warnings()
    logger.addHandler(handler)
    try:
        engine, *_ = shardwise.initialize(model=make_model(), config=cfg, **kwargs)
    finally:
        logger.removeHandler(handler)
    inner = engine.optimizer.optimizer
    calls: list[list[int]] = []
    inner.register_step_pre_hook(
        lambda o, args, kw: calls.append([t.numel() for g in o.param_groups for t in g["params"]])
    )
    for step in range(3):
        engine.backward(_loss(engine, step, rank))
        engine.step()
    shards = [
        (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in engine.module.parameters()
    ]
    numels = [t.numel() for g in inner.param_groups for t in g["params"]]
    engine.destroy()
    return {"calls": calls, "numels": numels, "shards": shards, "warnings": warnings}


def run_case(rank: int, world: int, case: dict[str, Any], tmp: str) -> dict[str, Any]:
    kind = case["kind"]
    if kind == "sub_groups":
        return sub_groups(rank, world, case)
    if kind == "count":
        return train_counting(rank, world, case)
    if kind == "unused":
        return unused_parameters(rank, world, case)
    if kind == "dump":
        return dump_state(rank, world, case)
    return load_from_fp32(rank, world, case, f"{tmp}/{case['name']}")
