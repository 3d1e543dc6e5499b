"""TiledLinear: a linear layer as a grid of tiles computes what nn.Linear computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.zero.tiling import TiledLinear, TiledLinearReturnBias


@pytest.mark.parametrize(("in_f", "out_f", "in_splits", "out_splits"), [(7, 5, 1, 1), (7, 5, 3, 2), (8, 9, 8, 9)])
@pytest.mark.parametrize("bias", [True, False])
def test_tiled_linear_matches_linear(in_f: int, out_f: int, in_splits: int, out_splits: int, bias: bool) -> None:
    torch.manual_seed(0)
    base = nn.Linear(in_f, out_f, bias=bias).double()
    tiled = TiledLinear(in_f, out_f, bias=bias, in_splits=in_splits, out_splits=out_splits, init_linear=base,
                        dtype=torch.float64)
    x = torch.randn(2, 3, in_f, dtype=torch.float64, requires_grad=True)
    out = tiled(x)
    # float64 sums over at most 8 input pieces: far below 1e-12 apart from one matmul
    torch.testing.assert_close(out, base(x), rtol=1e-12, atol=1e-12)
    assert sum(t.bias is not None for row in tiled.linears for t in row) == (out_splits if bias else 0)
    out.sum().backward()
    assert x.grad is not None and tiled.linears[0][0].weight.grad is not None
    assert tiled.in_parts[-1] == in_f and tiled.out_parts[-1] == out_f
    assert max(b - a for a, b in zip(tiled.in_parts, tiled.in_parts[1:], strict=False)) - min(
        b - a for a, b in zip(tiled.in_parts, tiled.in_parts[1:], strict=False)) <= 1


def test_tiled_linear_split_input_and_uncombined_output() -> None:
    base = nn.Linear(6, 4)
    tiled = TiledLinear(6, 4, in_splits=2, out_splits=2, init_linear=base, input_is_already_split=True,
                        combine_out_splits=False)
    x = torch.randn(3, 6)
    rows = tiled(list(torch.split(x, [3, 3], dim=-1)))
    torch.testing.assert_close(torch.cat(rows, dim=-1), base(x))
    with pytest.raises(RuntimeError, match="expected 2 input pieces"):
        tiled([x])


@pytest.mark.parametrize("splits", [0, 33])
def test_tiled_linear_refuses_splits_out_of_range(splits: int) -> None:
    with pytest.raises(RuntimeError, match="in_splits"):
        TiledLinear(32, 32, in_splits=splits)
    with pytest.raises(RuntimeError, match="out_splits"):
        TiledLinear(32, 32, out_splits=splits)
    with pytest.raises(ValueError, match="shape"):
        TiledLinear(4, 4, init_linear=nn.Linear(4, 5))


class _BiasReturned(nn.Linear):
    """A linear layer that leaves its bias add to the caller."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # type: ignore[override]
        return nn.functional.linear(x, self.weight), self.bias


def test_tiled_linear_return_bias() -> None:
    base = nn.Linear(6, 4)
    tiled = TiledLinearReturnBias(6, 4, in_splits=3, out_splits=2, linear_cls=_BiasReturned, init_linear=base)
    x = torch.randn(5, 6)
    out, bias = tiled(x)
    torch.testing.assert_close(bias, base.bias.detach())
    torch.testing.assert_close(out + bias, base(x))
