"""deepspeed.moe.utils' parameter split, and the MoE layer's argument checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.moe.layer import MoE
from shardwise.moe.utils import (
    has_moe_layers,
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
    split_params_into_shared_and_expert_params,
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), MoE(4, nn.Linear(4, 4), num_experts=2, k=1))


def test_expert_parameters_are_marked_and_split_into_their_own_group() -> None:
    model = _model()
    shared, expert = split_params_into_shared_and_expert_params(list(model.parameters()))
    assert len(expert) == 4 and all(is_moe_param(p) and p.group_name == "ep_size_1" for p in expert)
    assert len(shared) == 3  # the dense Linear (2) and the gate (1)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense", "lr": 0.1}
    )
    assert [g["name"] for g in groups] == ["dense", "ep_size_1"]
    assert groups[1]["moe"] is True and groups[1]["lr"] == 0.1 and len(groups[1]["params"]) == 4
    assert len(groups[0]["params"]) == 3
    assert has_moe_layers(model) == (True, 2)


def test_max_group_size_cuts_expert_groups() -> None:
    model = _model()
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(model.parameters()), "name": "dense"}], max_group_size=20
    )
    # expert tensors: 16, 4, 16, 4 elements -> runs of at most 20
    assert [sum(p.numel() for p in g["params"]) for g in groups[1:]] == [20, 20]


def test_moe_argument_errors_name_the_rule() -> None:
    with pytest.raises(ValueError, match="multiple of ep_size"):
        MoE(4, nn.Linear(4, 4), num_experts=3, ep_size=2)
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        MoE(4, nn.Linear(4, 4), num_experts=2, noisy_gate_policy="Gaussian")
    with pytest.raises(NotImplementedError, match="enable_expert_tensor_parallelism"):
        MoE(4, nn.Linear(4, 4), num_experts=2, enable_expert_tensor_parallelism=True)


def test_layer_with_ep_size_above_one_needs_its_group_first() -> None:
    layer = MoE(4, nn.Linear(4, 4), num_experts=2, ep_size=2)
    with pytest.raises(RuntimeError, match="set_deepspeed_parallelism"):
        layer(torch.zeros(1, 3, 4))
