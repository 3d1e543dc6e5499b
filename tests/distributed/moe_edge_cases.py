"""Rank-side cases: MoE routing that leaves experts without tokens, and ZeRO-3 leaf modules."""

from __future__ import annotations

import tempfile
from typing import Any

HIDDEN, EXPERTS = 8, 4



def _model(ep_size: int, drop_tokens: bool) -> Any:
    import torch
    from torch import nn

    from shardwise.moe.layer import MoE

    class OneMoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            expert = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN))
            self.moe = MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=ep_size, k=1, min_capacity=0,
                           use_rts=False, drop_tokens=drop_tokens)
            with torch.no_grad():  # the router sends every token with a positive feature 0 to expert 0
                self.moe.deepspeed_moe.gate.wg.weight.zero_()
                self.moe.deepspeed_moe.gate.wg.weight[0, 0] = 10.0

        def forward(self, x: Any) -> tuple[Any, Any]:
            out, l_aux, counts = self.moe(x)
            return out.square().mean() + 0.01 * l_aux, counts

    torch.manual_seed(0)
    return OneMoE()


def idle_experts(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """EP=2: every token of both ranks goes to expert 0 (rank 0's); rank 1's experts get nothing.
    Training steps must complete (no rank waits for tokens that never come) and leave the idle
    experts exactly as they were (their gradient is exactly zero)."""
    import torch

    import shardwise
    from shardwise.comm import groups, mesh

    mesh.reset_layout()
    groups.clear_topology()
    model = _model(2, case["drop_tokens"])
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "deepspeed_experts" in n}
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": case["stage"]},
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = shardwise.initialize(model=model, config=config)
    counts = []
    for step in range(3):
        x = torch.rand(4, 5, HIDDEN, generator=torch.Generator().manual_seed(10 * rank + step)) + 0.1
        loss, count = engine(x)
        engine.backward(loss)
        engine.step()
        counts.append(count.tolist())
    changed = {n: not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters() if n in before}
    engine.destroy()
    return {"counts": counts, "changed": changed}


def leaf_units(rank: int, world: int, case: dict[str, Any]) -> list[str]:
    """Stage 3 with the MoE layer's experts flagged as leaves: the shard units chosen."""
    import torch

    import shardwise
    from shardwise.comm import groups, mesh
    from shardwise.zero.fsdp_wrap import sharded_record
    from shardwise.zero.leaf_modules import set_z3_leaf_modules

    mesh.reset_layout()
    groups.clear_topology()
    model = _model(1, True)
    if case["leaf"]:
        from shardwise.moe.experts import Experts

        set_z3_leaf_modules(model, [Experts])
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = shardwise.initialize(model=model, config=config)
    loss, _ = engine(torch.rand(4, 5, HIDDEN) + 0.1)
    engine.backward(loss)
    engine.step()
    record = sharded_record(model)
    names = {id(m): n for n, m in model.named_modules()}
    units = sorted(names[id(u)] for u in record.units) if record is not None else []
    engine.destroy()
    return units


def full_expert_gradients(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """``safe_get_full_grad`` / ``safe_get_full_fp32_param`` of expert parameters at ``case["ep"]``,
    by global expert index (the same tokens on both runs)."""
    import torch

    import shardwise
    from shardwise.comm import groups, mesh
    from shardwise.zero.param_access import safe_get_full_fp32_param, safe_get_full_grad

    mesh.reset_layout()
    groups.clear_topology()
    model = _model(case["ep"], drop_tokens=False)
    with torch.no_grad():  # route by the input: a spread over all experts
        model.moe.deepspeed_moe.gate.wg.weight.copy_(torch.eye(EXPERTS, HIDDEN) * 5.0)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": case["stage"]},
    }
    engine, *_ = shardwise.initialize(model=model, config=config)
    x = torch.randn(4, 5, HIDDEN, generator=torch.Generator().manual_seed(rank))
    loss, _ = engine(x)
    engine.backward(loss)
    ep_rank = mesh.current_layout().rank_in("ep") if case["ep"] > 1 else 0
    layer = model.moe.deepspeed_moe.experts
    out = {}
    for local, expert in enumerate(layer.deepspeed_experts):
        index = ep_rank * layer.num_local_experts + local
        out[f"grad{index}"] = safe_get_full_grad(expert[0].weight)
        out[f"param{index}"] = safe_get_full_fp32_param(expert[0].weight)
    engine.step()
    engine.destroy()
    return out


def expert_buffers(rank: int, world: int, case: dict[str, Any]) -> dict[str, float]:
    """A buffer in each expert, set per rank before ``initialize``: dense buffers take rank 0's,
    expert buffers stay each expert-parallel rank's own (its experts are not rank 0's)."""
    import torch
    from torch import nn

    import shardwise
    from shardwise.comm import groups, mesh
    from shardwise.moe.layer import MoE

    mesh.reset_layout()
    groups.clear_topology()

    class Tagged(nn.Linear):
        def __init__(self) -> None:
            super().__init__(HIDDEN, HIDDEN)
            self.register_buffer("tag", torch.zeros(()))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.moe = MoE(HIDDEN, Tagged(), num_experts=EXPERTS, ep_size=2, k=1, min_capacity=0)
            self.register_buffer("dense_tag", torch.zeros(()))

        def forward(self, x: Any) -> Any:
            return self.moe(x)[0].sum()

    model = Net()
    with torch.no_grad():
        model.dense_tag.fill_(float(rank))
        for local, expert in enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts):
            expert.tag.fill_(10.0 * rank + local)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}}
    engine, *_ = shardwise.initialize(model=model, config=config)
    tags = {"dense": float(model.dense_tag)}
    for local, expert in enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts):
        tags[f"expert{local}"] = float(expert.tag)
    try:  # one file from rank 0 cannot hold the other rank's experts: refused by name
        engine.save_16bit_model(tempfile.mkdtemp(prefix="moe16_"))
        tags["refused_16bit"] = 0.0
    except ValueError as error:
        tags["refused_16bit"] = float("ep_size > 1" in str(error))
    engine.destroy()
    return tags
