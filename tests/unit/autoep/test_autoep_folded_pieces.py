"""The pure pieces of AutoEP folded over AutoTP: the whole config feeding the folding rules, the lanes'
shares of the combined output adding up to the whole, and AutoTP leaving an AutoEP layer's router whole."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from shardwise.autoep.convert import autoep_config
from shardwise.autoep.folded import routed_payload
from shardwise.autoep.tp_dispatch import combine_lane_rows, partition_assignments
from shardwise.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, TPGroup
from shardwise.tensor_parallel.partitioner import split_model

FOLDED = SimpleNamespace(world_size=4, dims=SimpleNamespace(pp=1, tp=2), sp_size=1)
SECTION = {"enabled": True, "autoep_size": 2}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"zero_optimization": {"stage": 3}}, "stage=3 with AutoEP\\+AutoTP folding"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "offload"),
        ({"zero_optimization": {"stage": 1, "offload_param": {"device": "nvme"}}}, "offload"),
        ({"compile": {"deepcompile": True}}, "DeepCompile"),
        ({"use_data_before_expert_parallel_": True}, "use_data_before_expert_parallel_"),
        ({"tensor_parallel": {"autotp_size": 2, "preset_model": "llama"}}, "preset_model"),
    ],
)
def test_the_whole_config_feeds_the_folding_rules(extra: dict, message: str) -> None:
    raw = {"expert_parallel": {**SECTION, "preset_model": "mixtral"}, **extra}
    with pytest.raises(ValueError, match=message):
        autoep_config(raw, FOLDED)


def test_a_folded_config_at_stages_0_to_2_without_offload_is_accepted() -> None:
    for stage in (0, 1, 2):
        raw = {"expert_parallel": SECTION, "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "none"}}}
        assert autoep_config(raw, FOLDED).autoep_size == 2
    # without tensor parallelism stage 3 is not a folding question
    assert autoep_config({"expert_parallel": SECTION, "zero_optimization": {"stage": 3}},
                         SimpleNamespace(world_size=4, dims=SimpleNamespace(pp=1, tp=1), sp_size=1)) is not None


@pytest.mark.parametrize("tp_size", [2, 3, 4])
def test_the_lanes_shares_add_up_to_the_whole_combine(tp_size: int) -> None:
    torch.manual_seed(0)
    tokens, top_k, experts, hidden = 7, 2, 4, 3
    selected = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    scores = torch.rand(tokens * top_k)
    payload = routed_payload(selected, scores, top_k, num_local_experts=2, ep_size=2, post_weights=True)
    results = torch.randn(tokens * top_k, hidden)  # one result per payload row
    whole = torch.zeros(tokens, hidden)
    for row in range(tokens * top_k):
        whole[payload.token_indices[row]] += payload.combine_weights[row] * results[row]
    shares, owned = torch.zeros(tokens, hidden), []
    for lane in range(tp_size):
        local, ctx = partition_assignments(payload, tp_group=None, tp_rank=lane, tp_size=tp_size)
        assert local.input_splits == [int((local.expert_indices // 2 == r).sum()) for r in range(2)]
        owned += ctx.local_indices.tolist()
        shares += combine_lane_rows(results[ctx.local_indices], ctx)
    assert sorted(owned) == list(range(tokens * top_k))  # every assignment on exactly one lane
    torch.testing.assert_close(shares, whole, rtol=1e-6, atol=1e-6)


def test_autotp_splits_an_autoep_layers_shared_experts_and_leaves_its_router_whole() -> None:
    class SharedMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(16, 8)

    class AutoEPLike(nn.Module):
        _is_autoep_layer = True

        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Module()
            self.router.gate = nn.Linear(8, 4, bias=False)
            self.shared_experts = SharedMLP()
            self.shared_experts_gate = nn.Linear(8, 1, bias=False)

    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module()])
    model.layers[0].mlp = AutoEPLike()
    model.layers[0].o_proj = nn.Linear(8, 8)
    report = split_model(model, TPGroup(None, 0, 2), None)
    mlp = model.layers[0].mlp
    assert isinstance(mlp.shared_experts.up_proj, ColumnParallelLinear)
    assert isinstance(mlp.shared_experts.down_proj, RowParallelLinear)
    assert type(mlp.router.gate) is nn.Linear and type(mlp.shared_experts_gate) is nn.Linear
    assert set(report.kinds) == {"layers.0.mlp.shared_experts.up_proj", "layers.0.mlp.shared_experts.down_proj",
                                 "layers.0.o_proj"}


def test_a_layer_spec_never_reaches_an_autoep_layers_router() -> None:
    from shardwise.tensor_parallel.specs import plan_from_dict

    layer = nn.Module()
    layer._is_autoep_layer = True
    layer.router = nn.Module()
    layer.router.gate = nn.Linear(8, 4, bias=False)
    model = nn.Module()
    model.moe = layer
    plan = plan_from_dict({"layer_specs": [{"patterns": [r".*router\.gate\.weight$"], "partition_type": "column"}]})
    report = split_model(model, TPGroup(None, 0, 2), plan)
    assert type(model.moe.router.gate) is nn.Linear and report.kinds == {}
