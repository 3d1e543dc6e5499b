"""Rank side of the ``use_grouped_mm`` test: a tiny bf16 Mixtral with AutoEP at ``autoep_size=2``."""

from __future__ import annotations

from typing import Any

from autoep_cases import VOCAB, _model


def train_bf16(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """4 AdamW steps in bf16 at ZeRO 2 with ``use_grouped_mm`` (and ``gate_up_impl``) as the case says:
    losses, the final weights of this rank, and which kernel each expert module ran ("fused" added
    when its gate and up projections are one product)."""
    import torch

    import shardwise
    from shardwise.autoep.experts import GroupedExperts
    from shardwise.comm import groups, mesh

    mesh.reset_layout()
    groups.clear_topology()
    model = _model("mixtral")
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2},
        "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "mixtral",
                            "use_grouped_mm": case["grouped"], "gate_up_impl": case.get("gate_up", "separate")},
    }
    engine, *_ = shardwise.initialize(model=model, config=config)
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(4):
        ids = torch.randint(0, VOCAB, (2, 12), generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    kernels = sorted({m.kernel for m in experts} | {"fused" for m in experts if m.fused_gate_up})
    weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    engine.destroy()
    return {"loss": losses, "kernels": kernels, "weights": weights}
