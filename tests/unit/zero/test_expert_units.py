"""Which modules stage 3 shards over the expert-data-parallel group, and what it refuses (pure logic)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.config.errors import AssertedConfigError
from shardwise.moe.layer import MoE
from shardwise.zero.expert_units import (
    expert_roots,
    merge_units,
    refuse_unshardable_experts,
    refuse_zero3_expert_parallel,
)
from shardwise.zero.wrap_policy import WrapRules, choose_units, describe_modules


def _mark(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        p.allreduce = False
        p.group_name = "ep_size_2"
    return module


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 2)
        self.experts = _mark(nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))  # no forward of its own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(e(x) for e in self.experts) + self.gate(x).sum()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([Layer(), Layer()])


def test_expert_roots_are_the_outermost_expert_modules_with_a_forward() -> None:
    net = Net()
    roots = expert_roots(net, describe_modules(net))
    # the ModuleList has no forward: its experts are the units
    assert roots == [f"blocks.{b}.experts.{e}" for b in range(2) for e in range(2)]


def test_a_moe_layer_s_experts_module_is_one_root() -> None:
    net = nn.Sequential(nn.Linear(4, 4), MoE(4, nn.Linear(4, 4), num_experts=2, ep_size=1))
    _mark(net[1].deepspeed_moe.experts)
    assert expert_roots(net, describe_modules(net)) == ["1.deepspeed_moe.experts"]


def test_merge_units_nests_expert_roots_after_their_block_and_drops_units_inside_them() -> None:
    net = Net()
    nodes = describe_modules(net)
    roots = expert_roots(net, nodes)
    units = choose_units(nodes, WrapRules(leaf_unit_min_numel=100))  # blocks are units
    assert units == ["blocks.0", "blocks.1"]
    order = [n for n, _ in net.named_modules()]
    names, numels = merge_units(units, [nodes[u].numel for u in units], roots, nodes, order)
    assert names == ["blocks.0", "blocks.0.experts.0", "blocks.0.experts.1",
                     "blocks.1", "blocks.1.experts.0", "blocks.1.experts.1"]
    assert numels == [10, 20, 20, 10, 20, 20]  # a block no longer counts the experts it does not gather
    inner = ["embed", "blocks.0.experts.0"]  # a unit chosen inside an expert root gives way to the root
    names, _ = merge_units(inner, [nodes[u].numel for u in inner], roots, nodes, order)
    assert names == ["embed", *roots]  # the roots under the root unit, in registration order


def test_expert_and_dense_parameters_in_one_module_are_refused() -> None:
    net = Net()
    net.embed.weight.allreduce = False
    with pytest.raises(ValueError, match=r"'embed' \(Linear\) registers expert parameters .* fix:"):
        expert_roots(net, describe_modules(net))


def test_unshardable_expert_parameters_are_refused_by_name() -> None:
    scalar = nn.Parameter(torch.ones(()))
    scalar.allreduce = False
    with pytest.raises(ValueError, match=r"expert parameter 'scale' is a scalar.*fix: give it shape"):
        refuse_unshardable_experts([("scale", scalar)], zero_init=lambda p: None)
    matrix = nn.Parameter(torch.ones(2, 2))
    matrix.allreduce, matrix.use_muon = False, True
    with pytest.raises(ValueError, match=r"'w' with the Muon optimizer.*fix:"):
        refuse_unshardable_experts([("w", matrix)], zero_init=lambda p: None)
    with pytest.raises(ValueError, match=r"'w' was already partitioned by shardwise.zero.Init.*fix:"):
        refuse_unshardable_experts([("w", matrix)], zero_init=lambda p: object())
    dense = nn.Parameter(torch.ones(()))
    refuse_unshardable_experts([("dense", dense)], zero_init=lambda p: object())  # dense ones are not concerned


@pytest.mark.parametrize(
    ("kwargs", "key", "phrase"),
    [
        ({"sequence_parallel_size": 2}, "'sequence_parallel_size' = 2", "does not support sequence parallelism"),
        ({"quantized_gradients": True}, "'zero_optimization.zero_quantized_gradients' = True",
         "does not support zero_quantized_gradients"),
        ({"hpz_partition_size": 2}, "'zero_optimization.zero_hpz_partition_size' = 2", "hpZeRO secondary tensor groups"),
    ],
)
def test_the_zero3_expert_parallel_gate_names_key_value_and_fix(kwargs: dict, key: str, phrase: str) -> None:
    settings = {"ep_size": 2, "sequence_parallel_size": 1, "quantized_gradients": False, "hpz_partition_size": 1}
    refuse_zero3_expert_parallel(**settings)  # the plain case passes
    with pytest.raises(AssertedConfigError) as caught:
        refuse_zero3_expert_parallel(**{**settings, **kwargs})
    assert key in str(caught.value) and phrase in str(caught.value) and "fix:" in str(caught.value)
    assert isinstance(caught.value, AssertionError)  # DeepSpeed's gate raises AssertionError
