"""From a block layout to the gather plan of block-sparse attention (pure, vectorised).

Query-block rows are grouped by how many key blocks they attend to; each group holds, per row,
the ascending key-block indices padded to the group's width, and which of them are real. The
width is the row count rounded up to ``m * 2**e`` with ``m`` in 4..8 (exact up to 8), so
padding costs at most a quarter of a group's work while the number of groups stays small
(about ``4 * log2(num_blocks)``). Rows that attend to every block (global rows) form a group
marked ``dense``: they read the keys in place, without a gather.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowGroup:
    """Query-block rows that share one padded width.

    Attributes:
        rows: ``(n,)`` query-block indices.
        cols: ``(heads, n, width)`` key-block indices, ascending, padding set to 0.
        valid: ``(heads, n, width)`` True where ``cols`` is a real block of the layout.
        dense: every row attends to every block (``cols`` is ``arange``): read keys in place.
    """

    rows: torch.Tensor
    cols: torch.Tensor
    valid: torch.Tensor
    dense: bool

    @property
    def width(self) -> int:
        """Key blocks read per row, padding included."""
        return int(self.cols.shape[-1])


@dataclass(frozen=True)
class BlockPlan:
    """Every query-block row of a layout, grouped (see the module docstring).

    Attributes:
        num_blocks: blocks per sequence.
        heads: 1 when every head shares the layout, else the number of heads.
        groups: the row groups, in the order their outputs are concatenated.
        order: ``(num_blocks,)``: where each query-block row sits in that concatenation.
        nonzero_blocks: the layout's block count (per head, summed over the layout heads).
    """

    num_blocks: int
    heads: int
    groups: tuple[RowGroup, ...]
    order: torch.Tensor
    nonzero_blocks: int

    def to(self, device: torch.device) -> BlockPlan:
        """The same plan with its index tensors on ``device``."""
        groups = tuple(
            RowGroup(g.rows.to(device), g.cols.to(device), g.valid.to(device), g.dense) for g in self.groups
        )
        return BlockPlan(self.num_blocks, self.heads, groups, self.order.to(device), self.nonzero_blocks)


def padded_width(count: int, num_blocks: int) -> int:
    """``count`` rounded up to ``m * 2**e`` (``m`` in 4..8), exact up to 8, at most ``num_blocks``."""
    if count <= 8:
        return count
    step = 2 ** (int(math.log2(count)) - 2)
    return min(num_blocks, -(-count // step) * step)


def shared_layout(layout: torch.Tensor) -> torch.Tensor:
    """``layout`` as a bool ``(heads, nb, nb)``, reduced to one head when every head is the same."""
    layout = layout.bool()
    if layout.shape[0] > 1 and (layout.stride(0) == 0 or bool((layout == layout[:1]).all())):
        layout = layout[:1]
    return layout


def build_block_plan(layout: torch.Tensor) -> BlockPlan:
    """Group the rows of ``layout`` (``(heads, nb, nb)``, nonzero = attend) by padded width."""
    layout = shared_layout(layout).cpu()
    heads, num_blocks, _ = layout.shape
    counts = layout.sum(-1).amax(0)  # per row, the widest head
    widths = torch.tensor([padded_width(int(c), num_blocks) for c in counts.tolist()])
    # ones first, in ascending column order: a stable descending sort of the row
    ranked = torch.sort(layout.to(torch.uint8), dim=-1, descending=True, stable=True).indices
    groups = []
    for width in sorted(set(widths.tolist())):
        rows = (widths == width).nonzero().flatten()
        cols = ranked[:, rows, :width]
        valid = torch.gather(layout[:, rows], -1, cols)
        cols = cols.masked_fill(~valid, 0)
        dense = width == num_blocks and bool(valid.all())
        groups.append(RowGroup(rows, cols, valid, dense))
    concat = torch.cat([g.rows for g in groups]) if groups else torch.empty(0, dtype=torch.long)
    order = torch.empty(num_blocks, dtype=torch.long)
    order[concat] = torch.arange(num_blocks)
    return BlockPlan(num_blocks, heads, tuple(groups), order, int(layout.sum()))
