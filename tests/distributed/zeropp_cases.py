"""Per-rank scenarios for test_zeropp.py: stage 3 with and without ZeRO++ qwZ/qgZ, and hpZ."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from zero_reference import batch, config, make_model

import shardwise
from shardwise.comm.comms_logger import COMMS_LOGGER

STEPS = 6


def wire_bytes(world: int) -> dict[str, int]:
    """Bytes each rank sent per op, from the comms logger's records (message size x how much leaves)."""
    out: dict[str, int] = {}
    for op, by_size in COMMS_LOGGER.records.items():
        total = sum(size * len(entries) for size, entries in by_size.items())
        # all_gather / reduce_scatter record one rank's part (W-1 parts leave); all_to_all the whole buffer
        share = (world - 1) / world if op == "all_to_all_single" else world - 1
        out[op] = int(total * share)
    return out


def train_stage3(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train the demo GPT at stage 3 (fp32) with the case's ZeRO++ keys; losses and bytes on the wire."""
    torch.manual_seed(0)
    precision, gas = case.get("precision", "fp32"), case.get("gas", 1)
    cfg = config(3, precision, gas, 2, world, stage3_param_persistence_threshold=0, **case.get("zero", {}))
    cfg["comms_logger"] = {"enabled": True}
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    shardwise.comm.reset_log()
    losses = []
    for step in range(STEPS):
        for micro in range(gas):
            x, y = batch(step, micro, rank, 2)
            logits = engine(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
            engine.backward(loss)
            engine.step()
        losses.append(float(loss.detach()))
    sent = wire_bytes(world)
    gathers: dict[int, int] = {}  # ranks taking part -> all-gathers
    for entries in COMMS_LOGGER.records.get("all_gather_into_tensor", {}).values():
        for entry in entries:
            gathers[entry.world_size] = gathers.get(entry.world_size, 0) + 1
    shardwise.comm.configure(enabled=False)
    masters = [p.detach().clone() for p in engine.optimizer.full_fp32_parameters()]
    engine.destroy()
    return {"losses": losses, "bytes": sent, "masters": masters, "gathers": gathers}
