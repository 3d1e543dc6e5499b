"""Declaring a model's expert parallelism: what ``shardwise.initialize`` does with its MoE layers."""

from __future__ import annotations

from torch import nn

from shardwise.moe.layer import MoE
from shardwise.moe.parallelism import expert_parallel_group


def expert_parallel_degree(module: nn.Module) -> int:
    """The largest ``ep_size`` of ``module``'s MoE layers (1 without any); no collective."""
    return max((sub.ep_size for sub in module.modules() if isinstance(sub, MoE)), default=1)


def declare_expert_parallelism(module: nn.Module) -> int:
    """Give every MoE layer of ``module`` its expert-parallel group; returns the expert-parallel
    degree (1 without MoE layers). Collective: ``initialize`` calls it on every rank."""
    degree = 1
    for name, sub in module.named_modules():
        if isinstance(sub, MoE):
            source = f"MoE layer {name or '<root>'} (ep_size={sub.ep_size})"
            sub.deepspeed_moe._set_ep_group(*expert_parallel_group(sub.ep_size, source=source))
            degree = max(degree, sub.ep_size)
    return degree
