"""The client's optimizer object adopted over ZeRO's tensors (shardwise.optim.client)."""

from __future__ import annotations

import pytest
import torch

from shardwise.optim.client import adopt_client_optimizer, client_param_groups


def _client() -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.2, "weight_decay": 0.5}])
    return opt, [a, b]


def test_groups_are_re_pointed_in_place_keeping_hyperparameters_and_dropping_state():
    opt, (a, b) = _client()
    a.grad, b.grad = torch.ones(3), torch.ones(2)
    opt.step()
    assert len(opt.state) == 2
    groups_before = list(opt.param_groups)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    masters = [torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)]
    given = [{**g, "params": [m]} for g, m in zip(client_param_groups(opt), masters)]
    assert adopt_client_optimizer(opt, given) is opt
    assert [g["params"] for g in opt.param_groups] == [[masters[0]], [masters[1]]]
    assert all(mine is before for mine, before in zip(opt.param_groups, groups_before))  # same dicts
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.1]  # the scheduler's values stay
    assert opt.param_groups[1]["weight_decay"] == 0.5 and opt.param_groups[0]["initial_lr"] == 0.1
    assert len(opt.state) == 0
    masters[0].grad, masters[1].grad = torch.ones(3), torch.ones(2)
    opt.step()
    sched.step()
    assert set(opt.state) == set(masters)  # the adopted tensors are the ones that step
    assert sched.get_last_lr() == [g["lr"] for g in opt.param_groups]


def test_client_param_groups_copies_every_group_in_order():
    opt, (a, b) = _client()
    groups = client_param_groups(opt)
    assert [g["params"] for g in groups] == [[a], [b]] and [g["lr"] for g in groups] == [0.1, 0.2]
    groups[0]["params"].append(b)
    assert opt.param_groups[0]["params"] == [a]  # a copy: ZeRO may edit its own lists


def test_a_different_number_of_groups_is_an_error():
    opt, _ = _client()
    with pytest.raises(ValueError, match="2 param groups but ZeRO built 1"):
        adopt_client_optimizer(opt, [{"params": [torch.zeros(1)]}])
