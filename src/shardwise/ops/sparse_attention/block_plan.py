"""From a block layout to the gather plan of block-sparse attention (pure, vectorised).

Two kinds of key blocks are told apart:

* **shared columns**: key blocks that at least half of the query-block rows attend to (the
  global columns of ``fixed``, ``bigbird``, ``bslongformer`` and ``variable``). Every row reads
  them in one shared key set, without a per-row gather, and drops them where its layout row
  does not have them;
* **per-row blocks**: the rest of each row (local windows, sliding windows, random blocks),
  gathered per row.

Query-block rows are grouped by how many per-row blocks they have; each group holds, per row,
the ascending key-block indices padded to the group's width and which of them are real. The
width is the count rounded up to ``m * 2**e`` with ``m`` in 4..8 (exact up to 8), so padding
costs at most a quarter of a group's work while the number of groups stays small (about
``4 * log2(num_blocks)``). Rows that attend to every block (global rows) form a group marked
``dense``: they read all keys in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SHARED_COLUMN_SHARE = 0.5
"""A key block attended by at least this share of the rows is read once for all rows."""


@dataclass(frozen=True)
class RowGroup:
    """Query-block rows that share one padded width.

    Attributes:
        rows: ``(n,)`` query-block indices.
        cols: ``(heads, n, width)`` per-row key-block indices, ascending, padding set to 0.
        valid: ``(heads, n, width)`` True where ``cols`` is a real block of the layout.
        shared_valid: ``(heads, n, shared)`` which of the plan's shared columns each row attends.
        dense: every row attends to every block: read all keys in place (no shared/per-row split).
        all_valid: ``valid`` is all True (no padding to mask).
        all_shared: ``shared_valid`` is all True (every row attends every shared column).
    """

    rows: torch.Tensor
    cols: torch.Tensor
    valid: torch.Tensor
    shared_valid: torch.Tensor
    dense: bool
    all_valid: bool = False
    all_shared: bool = False

    @property
    def width(self) -> int:
        """Per-row key blocks read per row, padding included."""
        return int(self.cols.shape[-1])

    def to(self, device: torch.device) -> RowGroup:
        """The same group with its tensors on ``device``."""
        return RowGroup(
            self.rows.to(device),
            self.cols.to(device),
            self.valid.to(device),
            self.shared_valid.to(device),
            self.dense,
            self.all_valid,
            self.all_shared,
        )


@dataclass(frozen=True)
class BlockPlan:
    """Every query-block row of a layout, grouped (see the module docstring).

    Attributes:
        num_blocks: blocks per sequence.
        heads: 1 when every head shares the layout, else the number of heads.
        shared: ``(S,)`` the shared key-block columns, ascending.
        groups: the row groups, in the order their outputs are concatenated.
        order: ``(num_blocks,)``: where each query-block row sits in that concatenation.
        nonzero_blocks: the layout's block count (summed over the layout heads).
    """

    num_blocks: int
    heads: int
    shared: torch.Tensor
    groups: tuple[RowGroup, ...]
    order: torch.Tensor
    nonzero_blocks: int

    def to(self, device: torch.device) -> BlockPlan:
        """The same plan with its index tensors on ``device``."""
        groups = tuple(g.to(device) for g in self.groups)
        return BlockPlan(
            self.num_blocks,
            self.heads,
            self.shared.to(device),
            groups,
            self.order.to(device),
            self.nonzero_blocks,
        )


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
    """Split ``layout`` (``(heads, nb, nb)``, nonzero = attend) into shared columns and row groups."""
    layout = shared_layout(layout).cpu()
    heads, num_blocks, _ = layout.shape
    dense_rows = layout.all(-1).all(0)  # (nb,)
    share = layout.any(0).float().mean(0)  # per column: the share of rows attending it
    shared = (share >= SHARED_COLUMN_SHARE).nonzero().flatten()
    rest = layout.clone()
    rest[:, :, shared] = False
    counts = rest.sum(-1).amax(0).masked_fill(dense_rows, num_blocks)
    widths = torch.tensor([padded_width(int(c), num_blocks) for c in counts.tolist()])
    # ones first, in ascending column order: a stable descending sort of each row
    ranked = torch.sort(rest.to(torch.uint8), dim=-1, descending=True, stable=True).indices
    groups = []
    for is_dense in (False, True):
        for width in sorted(set(widths[dense_rows == is_dense].tolist())):
            rows = ((widths == width) & (dense_rows == is_dense)).nonzero().flatten()
            if is_dense:
                cols = torch.arange(num_blocks).expand(1, rows.numel(), num_blocks)
                valid = torch.ones(1, rows.numel(), num_blocks, dtype=torch.bool)
                shared_valid = torch.zeros(1, rows.numel(), 0, dtype=torch.bool)
            else:
                cols = ranked[:, rows, :width]
                valid = torch.gather(rest[:, rows], -1, cols)
                cols = cols.masked_fill(~valid, 0)
                shared_valid = layout[:, rows][:, :, shared]
            all_valid, all_shared = bool(valid.all()), bool(shared_valid.all())
            groups.append(RowGroup(rows, cols, valid, shared_valid, is_dense, all_valid, all_shared))
    concat = torch.cat([g.rows for g in groups]) if groups else torch.empty(0, dtype=torch.long)
    order = torch.empty(num_blocks, dtype=torch.long)
    order[concat] = torch.arange(num_blocks)
    return BlockPlan(num_blocks, heads, shared, tuple(groups), order, int(layout.sum()))
