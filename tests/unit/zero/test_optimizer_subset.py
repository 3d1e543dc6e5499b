"""shardwise.zero.optimizer_subset: stepping an optimizer in parts."""

from __future__ import annotations

import pytest
import torch

from shardwise.zero.optimizer_subset import (
    restricted,
    split_sub_groups,
    step_in_sub_groups,
    steps_per_tensor,
)


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


def _counting(opt: torch.optim.Optimizer) -> list[list[int]]:
    """The element counts each step() call sees, one list per call."""
    seen: list[list[int]] = []
    opt.register_step_pre_hook(
        lambda o, args, kwargs: seen.append([p.numel() for g in o.param_groups for p in g["params"]])
    )
    return seen


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("size", [1, 7, 40, 45, 1000])
def test_step_in_sub_groups_is_bit_identical_to_one_step_and_bounds_each_call(fused, size):
    whole, parts = _tensors(2), _tensors(2)

    def adamw(ts: list[torch.nn.Parameter]) -> torch.optim.AdamW:
        groups = [{"params": ts[:2]}, {"params": ts[2:], "lr": 3e-2}]
        return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, fused=fused)

    opt_whole, opt_parts = adamw(whole), adamw(parts)
    seen = _counting(opt_parts)
    expected_groups = split_sub_groups([7, 33, 5], size)
    for _ in range(3):
        opt_whole.step()
        assert step_in_sub_groups(opt_parts, size) == len(expected_groups)
    for a, b in zip(whole, parts):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_whole.state[a][key], opt_parts.state[b][key])
    assert len(seen) == 3 * len(expected_groups)
    # each call sees one sub-group: at most `size` elements, unless one tensor alone is larger
    assert all(sum(call) <= size or len(call) == 1 for call in seen), seen
    assert [g["params"] for g in opt_parts.param_groups] == [parts[:2], parts[2:]]  # restored


def test_step_in_sub_groups_keeps_a_folded_divisor_for_every_call():
    from shardwise.zero.grad_fold import divide_, scaled_step

    whole, parts = _tensors(3), _tensors(3)
    opt_whole = torch.optim.AdamW(whole, lr=1e-2, fused=True)
    opt_parts = torch.optim.AdamW(parts, lr=1e-2, fused=True)
    grads_whole = [p.grad for p in whole]
    grads_parts = [p.grad for p in parts]
    divided = grads_whole.copy()
    assert scaled_step(opt_whole, grads_whole, 4.0, lambda: divide_(divided, 4.0))
    calls = []
    folded = scaled_step(
        opt_parts,
        grads_parts,
        4.0,
        lambda: divide_(grads_parts, 4.0),
        lambda: calls.append(step_in_sub_groups(opt_parts, 10)),
    )
    assert folded and calls == [3]
    for a, b in zip(whole, parts):
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad)  # each gradient divided exactly once
