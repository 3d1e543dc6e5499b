"""Per-rank scenarios for test_overlap_gather.py: stages 1-2 with ``overlap_comm: true`` (the
post-step all-gather left in flight for the next forward) against ``overlap_comm: false``."""

from __future__ import annotations

import os
from typing import Any

import torch
from zero_reference import batch, config, make_model, train_step

import shardwise
from shardwise.zero import param_access as pa


def _config(case: dict[str, Any], world: int, overlap: bool) -> dict[str, Any]:
    cfg = config(
        case["stage"],
        case["precision"],
        case["gas"],
        2,
        world,
        clip=case.get("clip", 0.0),
        overlap_comm=overlap,
    )
    if case.get("fused"):
        cfg["optimizer"]["params"].update({"torch_adam": True, "fused": True})
    return cfg


def _state(engine: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _eval_logits(engine: Any, rank: int) -> torch.Tensor:
    engine.eval()
    with torch.no_grad():
        out = engine(batch(99, 0, rank, 2)[0]).detach().clone()
    engine.train()
    return out


def train_both(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train 3 steps with overlap_comm false, then true; after each step (gathers in flight) probe
    with an eval forward, state_dict and the fp32 accessors, alternating which comes first."""
    out: dict[str, Any] = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = case["model"]() if "model" in case else make_model()
        engine, *_ = shardwise.initialize(model=model, config=_config(case, world, overlap))
        losses, probes, busy = [], [], []
        for step in range(3):
            losses.extend(train_step(engine, step, rank, case["gas"]))
            busy.append(
                getattr(engine.optimizer, "gathers", None) is not None and engine.optimizer.gathers.busy
            )
            if step == 0:
                probes.append(("eval", _eval_logits(engine, rank)))
                probes.append(("state", _state(engine)))
            elif step == 1:
                probes.append(("state", _state(engine)))
                probes.append(("fp32", [pa.safe_get_full_fp32_param(p) for p in engine.module.parameters()]))
        final = _state(engine)  # after the last step: state_dict waits for the gathers in flight
        engine.destroy()
        out[str(overlap)] = {"losses": losses, "probes": probes, "final": final, "busy": busy}
    return out


def checkpoint_after_step(rank: int, world: int, case: dict[str, Any], tmp: str) -> dict[str, Any]:
    """Save right after step() (gathers in flight), with and without overlap; load each into a fresh
    synchronous engine; also load into an overlapped engine right after its step (a gather in flight
    must not overwrite the loaded values) and train on."""
    out: dict[str, Any] = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        engine, *_ = shardwise.initialize(model=make_model(), config=_config(case, world, overlap))
        for step in range(2):
            train_step(engine, step, rank, case["gas"])
        path = os.path.join(tmp, f"overlap-{overlap}")
        engine.save_checkpoint(path, tag="t")
        after_save = train_step(engine, 2, rank, case["gas"])  # the save left the step intact
        engine.load_checkpoint(path, tag="t")  # right after a step: its gather is in flight
        resumed = train_step(engine, 2, rank, case["gas"])
        final = _state(engine)
        engine.destroy()
        fresh, *_ = shardwise.initialize(model=make_model(seed=1), config=_config(case, world, False))
        fresh.load_checkpoint(path, tag="t")
        params = list(fresh.module.parameters())
        loaded = {
            "state": _state(fresh),
            "fp32": [pa.safe_get_full_fp32_param(p) for p in params],
            "exp_avg": [pa.safe_get_full_optimizer_state(p, "exp_avg") for p in params],
        }
        fresh.destroy()
        out[str(overlap)] = {"after_save": after_save, "resumed": resumed, "final": final, "loaded": loaded}
    return out


class ReadsChildWeight(torch.nn.Module):
    """Reads ``proj.weight`` directly without calling ``proj`` (its forward pre-hook never runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()
        self.proj = torch.nn.Linear(64, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) @ self.proj.weight.t()


def reads_child_weight() -> torch.nn.Module:
    """The model factory of the direct-read case (module level: picklable)."""
    return ReadsChildWeight()
