"""DeepSpeed's Muon by name: the parameter split, the per-half settings, and MuonWithAdamW's
update equal to torch.optim.Muon + torch.optim.AdamW bit for bit (whole tensors)."""

from __future__ import annotations

import pytest
import torch

from shardwise.optim import build_optimizer, is_zero_supported
from shardwise.optim.muon import MuonWithAdamW
from shardwise.optim.muon_groups import muon_param_groups, tag_muon_parameters, uses_muon


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(10, 6)
        self.hidden = torch.nn.Linear(6, 6)
        self.conv = torch.nn.Conv1d(6, 4, 3)
        self.lm_head = torch.nn.Linear(4, 10, bias=False)


def test_deepspeeds_rule_matrices_but_not_embeddings_or_the_head() -> None:
    net = _Net()
    assert tag_muon_parameters(net) == 2
    flags = {name: p.use_muon for name, p in net.named_parameters()}
    assert flags == {
        "embed_tokens.weight": False,
        "hidden.weight": True,
        "hidden.bias": False,
        "conv.weight": True,
        "conv.bias": False,
        "lm_head.weight": False,
    }
    assert uses_muon("x.weight", (3, 4)) and not uses_muon("x.weight", (3,))


def test_halves_take_their_keys_and_lr_overrides_most_specific_last() -> None:
    net = _Net()
    tag_muon_parameters(net)
    settings = {"lr": 0.1, "muon_lr": 0.02, "adam_lr": 0.003, "momentum": 0.9, "betas": (0.8, 0.9), "eps": 1e-6}
    groups = muon_param_groups(
        [{"params": [net.hidden.weight, net.hidden.bias], "weight_decay": 0.0},
         {"params": [net.conv.weight, net.lm_head.weight], "lr": 0.5}],
        settings,
    )
    summary = [(g["name"], g["use_muon"], g["lr"], g.get("momentum"), g.get("eps"), g.get("weight_decay")) for g in groups]
    assert summary == [
        ("group0-muon-params", True, 0.02, 0.9, None, 0.0),
        ("group0-adam-params", False, 0.003, None, 1e-6, 0.0),
        ("group1-muon-params", True, 0.5, 0.9, None, None),
        ("group1-adam-params", False, 0.5, None, 1e-6, None),
    ]
    stray = torch.nn.Parameter(torch.ones(2, 2))
    with pytest.raises(ValueError, match="use_muon"):
        muon_param_groups([{"params": [stray]}], settings)


def _pair(seed: int) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    torch.manual_seed(seed)
    shapes = [(16, 8), (8, 24), (3, 4, 2), (8,), (5,)]
    ours = [torch.nn.Parameter(torch.randn(*s) * 0.1) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    return ours, theirs


def test_update_is_torch_muon_and_adamw_bit_for_bit() -> None:
    ours, theirs = _pair(0)
    opt = MuonWithAdamW(
        [{"params": ours[:2], "use_muon": True, "lr": 0.02, "momentum": 0.9, "weight_decay": 0.1, "ns_method": "standard"},
         {"params": ours[3:], "use_muon": False, "lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01}],
        adam_kernel={"fused": True},
    )
    muon = torch.optim.Muon(theirs[:2], lr=0.02, momentum=0.9, weight_decay=0.1)
    adamw = torch.optim.AdamW(theirs[3:], lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, fused=True)
    for step in range(4):
        torch.manual_seed(100 + step)
        for a, b in zip(ours, theirs):
            g = torch.randn(a.shape)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        muon.step()
        adamw.step()
    for a, b in zip(ours[:2] + ours[3:], theirs[:2] + theirs[3:]):
        assert torch.equal(a, b)
    assert (opt.newton_schulz_matrices, opt.newton_schulz_iterations) == (8, 40)
    assert all(sorted(opt.state[p]) == ["momentum_buffer"] for p in ours[:2])  # one buffer per matrix
    assert sorted(opt.state[ours[3]]) == ["exp_avg", "exp_avg_sq", "step"]


def test_more_dimensions_are_rows_by_the_rest_and_state_round_trips() -> None:
    ours, _ = _pair(1)
    opt = MuonWithAdamW([{"params": [ours[2]], "use_muon": True}])
    ours[2].grad = torch.ones(3, 4, 2)
    opt.step()
    saved = opt.state_dict()
    again = MuonWithAdamW([{"params": [ours[2]], "use_muon": True}])
    again.load_state_dict(saved)
    assert torch.equal(again.state[ours[2]]["momentum_buffer"], opt.state[ours[2]]["momentum_buffer"])


def test_refusals_name_what_is_wrong() -> None:
    w = torch.nn.Parameter(torch.ones(2, 2))
    with pytest.raises(ValueError, match="ns_method"):
        MuonWithAdamW([{"params": [w], "use_muon": True, "ns_method": "svd"}])
    flat = torch.nn.Parameter(torch.ones(4))
    opt = MuonWithAdamW([{"params": [flat], "use_muon": True}])
    flat.grad = torch.ones(4)
    with pytest.raises(RuntimeError, match="no map to its matrices"):
        opt.step()


def test_by_name_with_deepspeeds_keys_and_zero_supported() -> None:
    net = torch.nn.Linear(4, 4)
    opt = build_optimizer(
        "Muon", {"lr": 0.1, "muon_lr": 0.02, "adam_lr": 0.001, "momentum": 0.9, "ns_method": "gram"}, net.parameters()
    )
    assert [(g["use_muon"], g["lr"]) for g in opt.param_groups] == [(True, 0.02), (False, 0.001)]
    assert is_zero_supported(opt)
    with pytest.raises(ValueError, match=r"optimizer\.params\.nesterov"):
        build_optimizer("Muon", {"nesterov": False}, net.parameters())
