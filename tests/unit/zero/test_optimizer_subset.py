"""shardwise.zero.optimizer_subset: stepping an optimizer in parts."""

from __future__ import annotations

import pytest
import torch

from shardwise.zero.optimizer_subset import restricted, steps_per_tensor


def _tensors(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (7, 33, 5)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


@pytest.mark.parametrize("fused", [False, True])
def test_adamw_stepped_tensor_by_tensor_is_bit_identical_to_one_step(fused):
    whole, parts = _tensors(0), _tensors(0)
    opt_whole = torch.optim.AdamW(whole, lr=1e-2, weight_decay=0.1, fused=fused)
    opt_parts = torch.optim.AdamW(parts, lr=1e-2, weight_decay=0.1, fused=fused)
    for _ in range(3):
        opt_whole.step()
        for p in reversed(parts):
            with restricted(opt_parts, {id(p)}):
                opt_parts.step()
    for a, b in zip(whole, parts):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_whole.state[a][key], opt_parts.state[b][key])


def test_restricted_hides_other_groups_and_restores_them():
    a, b, c = _tensors(1)
    opt = torch.optim.SGD([{"params": [a, b]}, {"params": [c], "lr": 0.5}], lr=1.0)
    before = [t.detach().clone() for t in (a, b, c)]
    with restricted(opt, {id(b)}):
        assert [g["params"] for g in opt.param_groups] == [[b]]
        opt.step()
    assert [g["params"] for g in opt.param_groups] == [[a, b], [c]]
    assert torch.equal(a, before[0]) and torch.equal(c, before[2]) and not torch.equal(b, before[1])


def test_steps_per_tensor_accepts_torch_elementwise_optimizers_only():
    p = torch.nn.Parameter(torch.zeros(2))

    class Custom(torch.optim.AdamW):
        pass

    assert steps_per_tensor(torch.optim.Adam([p]))
    assert not steps_per_tensor(Custom([p]))  # a subclass may couple tensors in its step
    assert not steps_per_tensor(torch.optim.LBFGS([p]))
