"""A linear layer stored as a grid of smaller linear layers (tiles): ``TiledLinear``.

``TiledLinear(in_features, out_features, in_splits=i, out_splits=o)`` holds ``o x i`` linear
modules; tile ``[r][c]`` maps input columns ``in_parts[c]:in_parts[c+1]`` to output rows
``out_parts[r]:out_parts[r+1]`` (the parts split as evenly as possible, the first ones one larger).
Only the last tile of each row has a bias. The forward sums each row's tiles and concatenates the
rows, so the layer computes what one ``nn.Linear`` with the same weights computes (up to the
order of the floating-point sums over the input splits).

Each tile is its own module with its own parameters: at ZeRO stage 3 a tile is gathered when
it runs, so a layer too large to gather whole can be split into tiles that are. This is
DeepSpeed's ``deepspeed.zero.TiledLinear`` (same arguments and attributes); ``TiledLinearReturnBias``
is the variant for a ``linear_cls`` whose forward returns ``(output, bias)``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn


def _parts(features: int, splits: int) -> list[int]:
    """``splits + 1`` boundaries cutting ``features`` into near-equal parts (the first ones larger)."""
    size, extra = divmod(features, splits)
    bounds = [0]
    for part in range(splits):
        bounds.append(bounds[-1] + size + (1 if part < extra else 0))
    return bounds


class TiledLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` split into ``out_splits x in_splits`` tiles.

    Args:
        in_features, out_features, bias: as for ``nn.Linear``.
        in_splits, out_splits: tiles along the input and output dimensions, each in
            ``[1, features]`` (else ``RuntimeError``).
        input_is_already_split: the forward receives a list of ``in_splits`` input pieces.
        combine_out_splits: concatenate the output rows (else return the list of row outputs).
        linear_cls: the module class of each tile (called as ``linear_cls(in, out, bias=..., **kwargs)``).
        init_linear: a linear module whose weight (and bias) the tiles copy.

    Example:
        >>> base = nn.Linear(6, 4)
        >>> tiled = TiledLinear(6, 4, in_splits=2, out_splits=2, init_linear=base)
        >>> x = torch.randn(3, 6)
        >>> torch.allclose(tiled(x), base(x), atol=1e-6)
        True
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls: type[nn.Module] = nn.Linear, init_linear: nn.Module | None = None,
                 **kwargs: Any) -> None:
        super().__init__()
        if not 1 <= in_splits <= in_features:
            raise RuntimeError(f"in_splits = {in_splits} must be in [1, in_features = {in_features}]")
        if not 1 <= out_splits <= out_features:
            raise RuntimeError(f"out_splits = {out_splits} must be in [1, out_features = {out_features}]")
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split, self.combine_out_splits = input_is_already_split, combine_out_splits
        self.in_parts = _parts(in_features, in_splits)
        self.out_parts = _parts(out_features, out_splits)
        self.linears = nn.ModuleList()
        for out_id in range(out_splits):
            rows = self.out_parts[out_id + 1] - self.out_parts[out_id]
            row = nn.ModuleList()
            for in_id in range(in_splits):
                cols = self.in_parts[in_id + 1] - self.in_parts[in_id]
                row.append(linear_cls(cols, rows, bias=bias and in_id == in_splits - 1, **kwargs))
            self.linears.append(row)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_: torch.Tensor | list[torch.Tensor]) -> Any:
        """Each row's tiles summed, the rows concatenated along the last dimension."""
        if self.input_is_already_split:
            pieces = list(input_)
            if len(pieces) != self.in_splits:
                raise RuntimeError(f"expected {self.in_splits} input pieces (in_splits), got {len(pieces)}")
        else:
            assert isinstance(input_, torch.Tensor)
            sizes = [b - a for a, b in zip(self.in_parts, self.in_parts[1:], strict=False)]
            pieces = list(torch.split(input_, sizes, dim=-1))
        outputs = []
        for row in self._rows():
            total: Any = None
            for in_id, tile in enumerate(row):
                total = self._add_tile(total, tile(pieces[in_id]))
            outputs.append(total)
        return self._combine(outputs) if self.combine_out_splits else outputs

    def _rows(self) -> list[list[nn.Module]]:
        return [list(cast(nn.ModuleList, row)) for row in self.linears]

    def _add_tile(self, total: Any, out: Any) -> Any:
        return out if total is None else total + out

    def _combine(self, outputs: list[Any]) -> Any:
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Copy ``other.weight`` (``[out_features, in_features]``) and ``other.bias`` into the tiles."""
        weight = cast(torch.Tensor, other.weight)
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"init_linear.weight has shape {tuple(weight.shape)}; this layer needs "
                             f"{(self.out_features, self.in_features)}")
        bias = cast("torch.Tensor | None", getattr(other, "bias", None))
        if self.use_bias and bias is None:
            raise ValueError("this layer has a bias (bias=True) but init_linear has none")
        for out_id, row in enumerate(self._rows()):
            r0, r1 = self.out_parts[out_id], self.out_parts[out_id + 1]
            for in_id, tile in enumerate(row):
                c0, c1 = self.in_parts[in_id], self.in_parts[in_id + 1]
                cast(torch.Tensor, tile.weight).copy_(weight[r0:r1, c0:c1])
                tile_bias = cast("torch.Tensor | None", tile.bias)
                if tile_bias is not None and bias is not None:
                    tile_bias.copy_(bias[r0:r1])


class TiledLinearReturnBias(TiledLinear):
    """``TiledLinear`` over a ``linear_cls`` whose forward returns ``(output, bias)`` (a layer that
    leaves the bias add to its caller): the outputs are summed and concatenated as in
    ``TiledLinear``; the biases (one per row, from its last tile) are concatenated alike."""

    def _rows(self) -> list[list[nn.Module]]:
        return [list(cast(nn.ModuleList, row)) for row in self.linears]

    def _add_tile(self, total: Any, out: Any) -> Any:
        tensor, bias = out
        if total is None:
            return tensor, bias
        return total[0] + tensor, bias if bias is not None else total[1]

    def _combine(self, outputs: list[Any]) -> Any:
        tensors = [t for t, _ in outputs]
        biases = [b for _, b in outputs if b is not None]
        tensor = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=-1)
        bias = None if not biases else biases[0] if len(biases) == 1 else torch.cat(biases, dim=-1)
        return tensor, bias
