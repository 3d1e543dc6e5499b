"""The step multiplier folded into fused Adam/AdamW: only where exact, and then bit for bit."""

from __future__ import annotations

import pytest
import torch

from shardwise.zero.grad_fold import folded_multiplier, power_of_two_reciprocal, scaled_step


def test_power_of_two_reciprocal_only_for_exact_powers_of_two() -> None:
    assert power_of_two_reciprocal(0.5) == 2.0
    assert power_of_two_reciprocal(2.0**-9) == 512.0
    assert power_of_two_reciprocal(4.0) == 0.25
    for not_exact in (0.3, 1.0 / 3.0, 0.5 * (1 + 2.0**-20), 1.0, 0.0, -0.5, float("inf"), float("nan")):
        assert power_of_two_reciprocal(not_exact) is None, not_exact
    # the reciprocal must stay a normal fp32 number
    assert power_of_two_reciprocal(2.0**-126) == 2.0**126
    assert power_of_two_reciprocal(2.0**-128) is None
    assert power_of_two_reciprocal(2.0**127) is None


def _grads(seed: int, sizes: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=gen) * 1e-3 for n in sizes]
    # subnormal, zero, huge and tiny values: the division must round exactly as the multiply
    grads[0][:8] = torch.tensor([1e-40, -1e-39, 3e-38, 1e-45, 0.0, -0.0, 1e30, 5e-39])
    return grads


def _run(
    kind: type[torch.optim.Optimizer], fold: bool, multiplier: float, **kwargs: object
) -> list[torch.Tensor]:
    sizes = [1003, 64, 4099]
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen) for n in sizes]
    opt = kind(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, **kwargs)
    for step in range(3):
        grads = _grads(step + 1, sizes)
        for p, g in zip(params, grads):
            p.grad = g
        if fold:
            assert scaled_step(opt, grads, multiplier, lambda: pytest.fail("multiplied although folded"))
        else:
            torch._foreach_mul_(grads, multiplier)
            opt.step()
    out = [*params, *(p.grad for p in params)]  # the fused kernel stores the scaled gradient back
    for p in params:
        out.extend(v for v in opt.state[p].values())
    return out


@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("multiplier", [0.5, 2.0**-9, 4.0])
def test_folded_step_is_bitwise_the_multiplied_step(
    kind: type[torch.optim.Optimizer], multiplier: float
) -> None:
    folded = _run(kind, True, multiplier, fused=True)
    multiplied = _run(kind, False, multiplier, fused=True)
    assert len(folded) == len(multiplied)
    for a, b in zip(folded, multiplied):
        assert torch.equal(a, b)


def _optimizer(**kwargs: object) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    params = [torch.randn(10), torch.randn(20)]
    grads = [torch.randn(10), torch.randn(20)]
    for p, g in zip(params, grads):
        p.grad = g
    opts = {"lr": 1e-3, **kwargs}
    kind = opts.pop("kind", torch.optim.AdamW)
    return kind(params, **opts), grads  # type: ignore[operator]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"fused": False},  # the foreach/for-loop paths take no grad_scale
        {"foreach": True},
        {"kind": torch.optim.SGD},
    ],
)
def test_not_folded_without_the_fused_kernel(kwargs: dict[str, object]) -> None:
    opt, grads = _optimizer(**kwargs)
    with folded_multiplier(opt, grads, 0.5) as folded:
        assert not folded
        assert getattr(opt, "grad_scale", None) is None


def test_not_folded_when_not_exact_or_not_the_same_gradients() -> None:
    opt, grads = _optimizer(fused=True)
    with folded_multiplier(opt, grads, 0.3) as folded:  # a clipping multiplier
        assert not folded
    with folded_multiplier(opt, grads[:1], 0.5) as folded:  # the optimizer reads one more gradient
        assert not folded
    with folded_multiplier(opt, [g.clone() for g in grads], 0.5) as folded:  # other tensors
        assert not folded
    opt.grad_scale = torch.tensor(8.0)  # someone else's AMP scaling: left alone
    with folded_multiplier(opt, grads, 0.5) as folded:
        assert not folded
    assert float(opt.grad_scale) == 8.0


def test_not_folded_for_16_bit_tensors() -> None:
    params = [torch.randn(16, dtype=torch.bfloat16)]
    params[0].grad = torch.randn(16, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    with folded_multiplier(opt, [params[0].grad], 0.5) as folded:
        assert not folded


def test_grad_scale_is_removed_after_the_step_even_when_it_fails() -> None:
    opt, grads = _optimizer(fused=True)
    with pytest.raises(RuntimeError, match="boom"), folded_multiplier(opt, grads, 0.25) as folded:
        assert folded and float(opt.grad_scale) == 4.0  # type: ignore[attr-defined]
        raise RuntimeError("boom")
    assert not hasattr(opt, "grad_scale")
    called = []
    assert not scaled_step(opt, grads, 0.3, lambda: called.append(True))
    assert called == [True]
