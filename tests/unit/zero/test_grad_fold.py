"""The step divisor folded into fused Adam/AdamW: bit for bit the separate division.

Marked ``numeric``: ``make test`` runs these again on the ``default`` and AVX2 CPU kernels, so
the fold is checked on every kernel level, not only this CPU's best one.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.zero.grad_fold import divide_, foldable_divisor, folded_divisor, scaled_step
from shardwise.zero.step_math import fp32

pytestmark = pytest.mark.numeric


def test_only_finite_positive_fp32_divisors_other_than_one_fold() -> None:
    for divisor in (2.0, 0.5, 3.75, fp32(10.000001), fp32(1.0 / 3.0), 2.0**-140, fp32(3e38)):
        assert foldable_divisor(divisor), divisor
    for divisor in (1.0, 0.0, -2.0, float("inf"), float("nan"), 0.1, 1.0 / 3.0, 1e39):
        assert not foldable_divisor(divisor), divisor  # 0.1 and 1/3: not fp32 numbers


def _grads(seed: int, sizes: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=gen) * 1e-3 for n in sizes]
    # subnormal, zero, huge and tiny values: the kernel's division must round as the separate one
    grads[0][:8] = torch.tensor([1e-40, -1e-39, 3e-38, 1e-45, 0.0, -0.0, 1e30, 5e-39])
    return grads


def _run(
    kind: type[torch.optim.Optimizer], fold: bool, divisor: float, device: str = "cpu", **kwargs: object
) -> list[torch.Tensor]:
    """(``device``: the GPU tests run this on CUDA, tests/gpu/cuda_feature_cases.py.)"""
    sizes = [1003, 64, 4099]  # not multiples of any vector width: the kernels' tails run too
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen).to(device) for n in sizes]
    opt = kind(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, **kwargs)
    for step in range(3):
        grads = [g.to(device) for g in _grads(step + 1, sizes)]
        for p, g in zip(params, grads):
            p.grad = g
        if fold:
            assert scaled_step(opt, grads, divisor, lambda: pytest.fail("divided although folded"))
        else:
            divide_(grads, divisor)
            opt.step()
    out = [*params, *(p.grad for p in params)]  # the fused kernel stores the scaled gradient back
    for p in params:
        out.extend(v for v in opt.state[p].values())
    return out


DIVISORS = [2.0, 2.0**9, 0.25, fp32(10.000001), fp32(2.6435 * 256), fp32(1.0 / 0.3), fp32(7e-3)]


@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("divisor", DIVISORS)
def test_folded_step_is_bitwise_the_divided_step(kind: type[torch.optim.Optimizer], divisor: float) -> None:
    folded = _run(kind, True, divisor, fused=True)
    divided = _run(kind, False, divisor, fused=True)
    assert len(folded) == len(divided)
    for a, b in zip(folded, divided):
        assert torch.equal(a, b)


def test_divide_leaves_gradients_alone_for_one() -> None:
    grads = [torch.randn(5)]
    before = grads[0].clone()
    divide_(grads, 1.0)
    assert torch.equal(grads[0], before)
    divide_(grads, 4.0)
    assert torch.equal(grads[0], before / 4.0)


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
    with folded_divisor(opt, grads, 2.0) as folded:
        assert not folded
        assert getattr(opt, "grad_scale", None) is None


def test_not_folded_when_not_an_fp32_divisor_or_not_the_same_gradients() -> None:
    opt, grads = _optimizer(fused=True)
    with folded_divisor(opt, grads, 0.3) as folded:  # not an fp32 number: the kernel would round it
        assert not folded
    with folded_divisor(opt, grads, 1.0) as folded:  # nothing to divide
        assert not folded
    with folded_divisor(opt, grads[:1], 2.0) as folded:  # the optimizer reads one more gradient
        assert not folded
    with folded_divisor(opt, [g.clone() for g in grads], 2.0) as folded:  # other tensors
        assert not folded
    opt.grad_scale = torch.tensor(8.0)  # someone else's AMP scaling: left alone
    with folded_divisor(opt, grads, 2.0) as folded:
        assert not folded
    assert float(opt.grad_scale) == 8.0


def test_not_folded_for_16_bit_tensors() -> None:
    params = [torch.randn(16, dtype=torch.bfloat16)]
    params[0].grad = torch.randn(16, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    with folded_divisor(opt, [params[0].grad], 2.0) as folded:
        assert not folded


def test_grad_scale_is_removed_after_the_step_even_when_it_fails() -> None:
    opt, grads = _optimizer(fused=True)
    with pytest.raises(RuntimeError, match="boom"), folded_divisor(opt, grads, 3.75) as folded:
        assert folded and float(opt.grad_scale) == 3.75  # type: ignore[attr-defined]
        raise RuntimeError("boom")
    assert not hasattr(opt, "grad_scale")
    called = []
    assert not scaled_step(opt, grads, 1.0, lambda: called.append(True))
    assert called == [True]
