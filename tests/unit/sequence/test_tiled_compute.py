"""ALST's tiled compute on one process: equal to the untiled computation, gradients included."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.sequence.tiled import (
    AutogradComputeMLP,
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 32, bias=False)
        self.down = nn.Linear(32, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _grads(run, mlp: _MLP, x: torch.Tensor, upstream: torch.Tensor):
    mlp.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_(True)
    out = run(mlp, leaf)
    out.backward(upstream)
    return out.detach(), leaf.grad, mlp.up.weight.grad.clone(), mlp.down.weight.grad.clone()


@pytest.mark.parametrize("batch", [1, 3])
def test_tiled_mlp_and_sequence_tiled_compute_equal_the_plain_mlp(batch: int) -> None:
    torch.manual_seed(0)
    mlp = _MLP().double()
    x = torch.randn(batch, 13, 8, dtype=torch.float64)  # 13 tokens in 4 tiles: the last is short
    upstream = torch.randn(batch, 13, 8, dtype=torch.float64)
    plain = _grads(lambda m, t: m(t), mlp, x, upstream)
    params = [mlp.up.weight, mlp.down.weight]
    tiled = _grads(lambda m, t: TiledMLP.apply(_MLP.forward, m, t, 4, params), mlp, x, upstream)
    generic = _grads(
        lambda m, t: sequence_tiled_compute(_MLP.forward, 13, 4, {"x": t}, {"self": m}, "x", params, 1, None),
        mlp,
        x,
        upstream,
    )
    whole = _grads(lambda m, t: AutogradComputeMLP.apply(_MLP.forward, m, t), mlp, x, upstream)
    for other in (tiled, generic, whole):
        for a, b in zip(plain, other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert all(p.ds_grad_is_ready for p in params)  # released after the last tile


def test_tiles_hold_back_gradient_hooks_until_the_last_tile() -> None:
    mlp = _MLP()
    seen = []
    mlp.up.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.ds_grad_is_ready))
    x = torch.randn(1, 12, 8, requires_grad=True)
    TiledMLP.apply(_MLP.forward, mlp, x, 3, [mlp.up.weight, mlp.down.weight]).sum().backward()
    assert seen == [False, False, True]  # what ZeRO's reducer waits for


def test_sequence_tiled_compute_reductions() -> None:
    x = torch.randn(2, 10, 4, dtype=torch.float64, requires_grad=True)

    def square(x: torch.Tensor) -> torch.Tensor:
        return x * x

    for reduction, plain in (("mean", (x * x).mean()), ("sum", (x * x).sum())):
        tiled = sequence_tiled_compute(square, 10, 3, {"x": x}, {}, "x", None, 1, reduction)
        torch.testing.assert_close(tiled, plain)
        (grad,) = torch.autograd.grad(tiled, x)
        (expected,) = torch.autograd.grad(plain, x)
        torch.testing.assert_close(grad, expected)
    with pytest.raises(ValueError, match="output_reduction='max'"):
        sequence_tiled_compute(square, 10, 3, {"x": x}, {}, "x", None, 1, "max")
    with pytest.raises(ValueError, match="grad_requiring_tensor_key='y'"):
        SequenceTiledCompute.apply(square, 10, 3, ["x"], [], "y", None, 1, None, x)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_tiled_fused_logits_loss_equals_the_plain_loss_under_any_incoming_gradient(reduction: str) -> None:
    torch.manual_seed(0)
    head = nn.Linear(8, 11, bias=False).double()
    x = torch.randn(2, 10, 8, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 11, (2, 10))

    def loss_fn(self: nn.Module, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self(h), t.reshape(-1))

    tiles = [
        loss_fn(head, x.reshape(-1, 8)[i * 10 : (i + 1) * 10], y.reshape(-1)[i * 10 : (i + 1) * 10])
        for i in range(2)
    ]
    plain = torch.stack(tiles).mean() if reduction == "mean" else torch.stack(tiles).sum()
    (3.0 * plain).backward()  # a loss scale / accumulation factor must reach every gradient
    expected = (x.grad.clone(), head.weight.grad.clone())
    x.grad, head.weight.grad = None, None
    loss = TiledFusedLogitsLoss.apply(loss_fn, head, x, y, None, 2, [head.weight], reduction)
    torch.testing.assert_close(loss, plain.detach())
    (3.0 * loss).backward()
    torch.testing.assert_close(x.grad, expected[0])
    torch.testing.assert_close(head.weight.grad, expected[1])


def test_tiled_fused_logits_loss_checks_its_inputs() -> None:
    x = torch.randn(2, 10, 8)
    with pytest.raises(ValueError, match="output_reduction=None"):
        TiledFusedLogitsLoss.apply(None, None, x, torch.zeros(2, 10), None, 2, [], None)
    with pytest.raises(ValueError, match=r"x \(2, 10, 8\) and y \(2, 9\)"):
        TiledFusedLogitsLoss.apply(None, None, x, torch.zeros(2, 9), None, 2, [], "mean")
    with pytest.raises(ValueError, match=r"mask \(2, 9\)"):
        TiledFusedLogitsLoss.apply(None, None, x, torch.zeros(2, 10), torch.ones(2, 9), 2, [], "mean")
