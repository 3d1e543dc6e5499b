"""AutoEP layers on one process: routing, the split plan's arithmetic, detection and replacement of
a hand-built MoE model, the converted layer against the block it replaces, checkpoint helpers."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from shardwise.autoep import layer as layer_module
from shardwise.autoep.config import AutoEPConfig
from shardwise.autoep.convert import repoint
from shardwise.autoep.detect import AutoEP
from shardwise.autoep.layer import AutoEPMoELayer, combine_from_routed, compute_split_plan
from shardwise.autoep.repack import repack_expert_weights
from shardwise.autoep.router import TokenChoiceTopKRouter
from shardwise.autoep.universal import _zero12_fragment_path, consolidate_autoep_zero12_expert_states

H, F, E = 8, 12, 4


class FusedBlock(nn.Module):
    """A Mixtral-shaped block: softmax top-2 routing renormalised, SwiGLU experts in [E, 2F, H] / [E, H, F]."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.randn(E, 2 * F, H) / 3)
        self.experts.down_proj = nn.Parameter(torch.randn(E, H, F) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, H)
        scores = torch.softmax(self.gate(flat).float(), dim=-1)
        top, idx = torch.topk(scores, 2, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for t in range(flat.shape[0]):
            for slot in range(2):
                e = int(idx[t, slot])
                gate, up = (self.experts.gate_up_proj[e] @ flat[t]).chunk(2)
                out[t] += top[t, slot] * (self.experts.down_proj[e] @ (nn.functional.silu(gate) * up))
        return out.reshape(x.shape)


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(H, F, False), nn.Linear(H, F, False), nn.Linear(F, H, False)


class ListBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))
        self.shared_experts = Expert()


def _model(block: type[nn.Module], model_type: str) -> nn.Module:
    model = nn.Module()
    model.config = type("Config", (), {"model_type": model_type, "num_local_experts": E, "n_routed_experts": E,
                                       "num_experts_per_tok": 2})()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList(nn.Module() for _ in range(2))
    for layer in model.model.layers:
        layer.mlp = block()
    return model


def test_router_scales_and_limits_to_groups() -> None:
    torch.manual_seed(0)
    base = TokenChoiceTopKRouter(H, 8, 4, 1, 2, "softmax", False, 1.0, False)
    scaled = TokenChoiceTopKRouter(H, 8, 4, 1, 2, "softmax", False, 2.5, False)
    scaled.load_state_dict(base.state_dict())
    x = torch.randn(20, H)
    scores, experts, counts = base(x)
    scaled_scores, scaled_experts, _ = scaled(x)
    assert torch.equal(experts, scaled_experts) and torch.allclose(scaled_scores, 2.5 * scores)
    assert torch.equal(experts // 2, (experts // 2)[:, :1].expand_as(experts))  # one group of 2 experts per token
    assert counts.dtype == torch.int32 and int(counts.sum()) == 40


def test_converted_layer_computes_what_the_block_computes() -> None:
    torch.manual_seed(0)
    model = _model(FusedBlock, "mixtral")
    x = torch.randn(2, 5, H)
    expected = model.model.layers[0].mlp(x)
    auto_ep = AutoEP(model, AutoEPConfig(enabled=True, use_grouped_mm=False))
    specs = auto_ep.ep_parser()
    assert [s.moe_module_name for s in specs] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert (specs[0].num_experts, specs[0].hidden_size, specs[0].ffn_hidden_size, specs[0].top_k) == (E, H, F, 2)
    layer = auto_ep.replace_moe_layer(specs[0], ep_size=1, ep_rank=0)
    assert model.model.layers[0].mlp is layer
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)
    layer(x).sum().backward()
    assert all(p.grad is not None for p in layer.parameters())
    assert layer.experts.w1.allreduce is False and layer.experts.w1.group_name == "ep_size_1"


def test_module_list_experts_are_sliced_per_rank_and_flags_checked() -> None:
    torch.manual_seed(0)
    model = _model(ListBlock, "deepseek_v3")
    block = model.model.layers[0].mlp
    spec = AutoEP(model, AutoEPConfig(enabled=True, autoep_size=2)).ep_parser()[0]
    assert spec.expert_storage == "module_list" and spec.has_shared_experts and spec.score_func == "sigmoid"
    w1, w2, w3 = repack_expert_weights(block.experts, spec, ep_rank=1, ep_size=2)
    torch.testing.assert_close(w1, torch.stack([block.experts[e].gate_proj.weight for e in (2, 3)]))
    torch.testing.assert_close(w2, torch.stack([block.experts[e].down_proj.weight for e in (2, 3)]))
    torch.testing.assert_close(w3, torch.stack([block.experts[e].up_proj.weight for e in (2, 3)]))
    block.experts[0].gate_proj.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="mixed requires_grad flags"):
        AutoEPMoELayer(spec, block, 2, 0, AutoEPConfig(enabled=True, autoep_size=2))


def test_split_plan_from_one_exchange(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = torch.tensor([3, 0, 5, 1], dtype=torch.int32)
    plan = compute_split_plan(torch.repeat_interleave(torch.arange(4), counts.long()), 4, 1, 4, None)
    assert plan.input_splits == plan.output_splits == [9] and torch.equal(plan.local_counts, counts)
    others = torch.tensor([[1, 2], [7, 0]], dtype=torch.int32)  # what ranks 0 and 1 send to this rank's 2 experts
    sent = []

    def exchange(output: torch.Tensor, tensor: torch.Tensor, group: object = None) -> None:
        sent.append(tensor.clone())
        output.copy_(others.reshape(-1))

    monkeypatch.setattr(layer_module.dist, "all_to_all_single", exchange)
    plan = compute_split_plan(torch.repeat_interleave(torch.arange(4), counts.long()), 4, 2, 2, None)
    assert len(sent) == 1 and torch.equal(sent[0], counts)
    assert plan.input_splits == [3, 6] and plan.output_splits == [3, 7]
    assert torch.equal(plan.local_counts, torch.tensor([8, 2])) and torch.equal(plan.local_counts_by_source, others)


def test_combine_weights_each_slot() -> None:
    out = combine_from_routed(torch.ones(4, 3), torch.tensor([[0.6, 0.4], [0.7, 0.1]]), torch.tensor([3, 0, 1, 2]),
                              2, "post", "weighted_sum", (1, 2, 3))
    torch.testing.assert_close(out[0], torch.tensor([[1.0] * 3, [0.8] * 3]))


@pytest.mark.parametrize(("data_first", "order"), [(False, [0, 2, 1, 3]), (True, [0, 1, 2, 3])])
def test_zero12_expert_fragments_join_in_expert_order(tmp_path: object, data_first: bool, order: list[int]) -> None:
    temp, out, name = os.path.join(str(tmp_path), "t"), os.path.join(str(tmp_path), "u"), "m.experts.w1"
    os.makedirs(os.path.join(temp, name, "0"))
    for key in ("fp32", "exp_avg", "exp_avg_sq", "step"):
        for rank in range(4):
            torch.save(torch.tensor([float(rank)]), _zero12_fragment_path(temp, name, key, rank))
    meta = {name: {"num_experts": 4, "num_local_experts": 2, "ep_size": 2}}
    consolidate_autoep_zero12_expert_states(temp, out, meta, {name: (2, 1)}, 4, 1, data_first)
    saved = torch.load(os.path.join(out, "zero", name, "exp_avg.pt"), weights_only=False)
    assert saved["is_expert_param"] and saved["ep_num_experts"] == 4
    torch.testing.assert_close(saved["param"], torch.tensor(order, dtype=torch.float32).view(4, 1))


def test_parameter_lists_are_repointed() -> None:
    old, new_a, new_b, other = (nn.Parameter(torch.zeros(1)) for _ in range(4))
    replaced = {id(old): [new_a, new_b]}
    assert repoint([old, other], replaced) == [new_a, new_b, other]
    assert repoint([{"params": [old], "lr": 0.1}], replaced)[0]["params"] == [new_a, new_b]
