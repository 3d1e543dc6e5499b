"""The fused gate/up layout: classified from shapes, cut into w1/w2/w3, and used by detection and
repacking so that a model storing its experts hidden-first converts to the same weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.autoep.config import AutoEPConfig
from shardwise.autoep.detect import AutoEP
from shardwise.autoep.fused_layout import classify_fused_gate_up_layout, split_fused_gate_up
from shardwise.autoep.repack import repack_expert_weights

E, H, F = 4, 6, 10


@pytest.mark.parametrize(
    ("w1", "w2", "expected"),
    [
        ((E, 2 * F, H), (E, H, F), ("gate_up_first", H, F, False)),
        ((E, H, 2 * F), (E, F, H), ("hidden_first", H, F, True)),
        ((E, 2 * F, H), (E + 1, H, F), None),  # a different expert count is no pair
        ((E, 2 * F, H), (E, H, F + 1), None),
        ((E, 2 * F + 1, H), (E, H, F), None),
        ((2 * F, H), (H, F), None),
    ],
)
def test_layouts_are_told_apart_by_shape(w1: tuple, w2: tuple, expected: tuple | None) -> None:
    layout = classify_fused_gate_up_layout(w1, w2)
    got = None if layout is None else (layout.layout, layout.hidden_size, layout.ffn_hidden_size, layout.needs_transpose)
    assert got == expected


def test_hidden_first_cuts_into_the_transposed_gate_up_first_pieces() -> None:
    torch.manual_seed(0)
    gate_up, down = torch.randn(E, 2 * F, H), torch.randn(E, H, F)
    w1, w2, w3 = split_fused_gate_up(gate_up, down)
    assert torch.equal(w1, gate_up[:, :F]) and torch.equal(w3, gate_up[:, F:]) and torch.equal(w2, down)
    t1, t2, t3 = split_fused_gate_up(gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous())
    assert torch.equal(t1, w1) and torch.equal(t2, w2) and torch.equal(t3, w3)
    assert t1.is_contiguous() and t2.is_contiguous() and t3.is_contiguous()
    with pytest.raises(ValueError, match=r"rule: \[E, 2F, H\] with \[E, H, F\]"):
        split_fused_gate_up(gate_up, down[:, :, :-1], "layer x")


def _model(hidden_first: bool, gate_up: torch.Tensor, down: torch.Tensor) -> nn.Module:
    block = nn.Module()
    block.gate = nn.Linear(H, E, bias=False)
    block.experts = nn.Module()
    block.experts.gate_up_proj = nn.Parameter(gate_up.transpose(1, 2).contiguous() if hidden_first else gate_up)
    block.experts.down_proj = nn.Parameter(down.transpose(1, 2).contiguous() if hidden_first else down)
    model = nn.Module()
    model.config = type("Config", (), {"model_type": "mixtral", "num_local_experts": E, "num_experts_per_tok": 2})()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.Module()])
    model.model.layers[0].mlp = block
    return model


def test_a_hidden_first_model_is_detected_and_repacked_like_its_gate_up_first_twin() -> None:
    torch.manual_seed(0)
    gate_up, down = torch.randn(E, 2 * F, H), torch.randn(E, H, F)
    packed = []
    for hidden_first in (False, True):
        model = _model(hidden_first, gate_up, down)
        spec = AutoEP(model, AutoEPConfig(enabled=True, autoep_size=2)).ep_parser()[0]
        assert (spec.hidden_size, spec.ffn_hidden_size, spec.num_experts) == (H, F, E)
        packed.append(repack_expert_weights(model.model.layers[0].mlp.experts, spec, ep_rank=1, ep_size=2))
    for ours, theirs in zip(*packed, strict=True):
        assert ours.shape[0] == E // 2 and torch.equal(ours, theirs)


def test_an_unpaired_fused_layout_is_refused_at_detection() -> None:
    model = _model(False, torch.randn(E, 2 * F, H), torch.randn(E, H, F + 2))
    with pytest.raises(ValueError, match="not a fused gate/up pair"):
        AutoEP(model, AutoEPConfig(enabled=True)).ep_parser()
