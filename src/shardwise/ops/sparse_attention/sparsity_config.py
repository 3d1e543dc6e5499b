"""DeepSpeed's block-sparsity layouts, generated with vectorised tensor ops.

A layout is an int64 tensor ``(num_heads, num_blocks, num_blocks)``: entry ``[h, i, j]`` is 1
when the queries of block ``i`` attend to the keys of block ``j`` in head ``h``. The patterns
follow DeepSpeed's ``sparsity_config.py`` (0.19.6 and earlier); the differences are deliberate:

* random blocks come from a ``torch.Generator`` seeded with ``seed``, so every rank builds the
  same layout without a broadcast, and the same seed gives the same layout;
* unidirectional random blocks are drawn from the allowed columns ``0..row``; a row with fewer
  allowed columns than ``num_random_blocks`` takes all of them (DeepSpeed raised there).

Layouts are cached per sequence length; ``make_layout`` returns the cached tensor (expanded over
the heads when they share one layout), so treat it as read-only.
"""

from __future__ import annotations

import torch

Layout = torch.Tensor
_ATTENTIONS = ("unidirectional", "bidirectional")


def _check_attention(attention: str, horizontal_global_attention: bool = False) -> None:
    if attention not in _ATTENTIONS:
        raise NotImplementedError(f"attention={attention!r}: only 'unidirectional' and 'bidirectional' exist")
    if attention != "bidirectional" and horizontal_global_attention:
        raise ValueError("horizontal_global_attention=True needs attention='bidirectional'")


def _check_global_ranges(starts: list[int], ends: list[int] | None) -> None:
    if ends is None:
        return
    if len(starts) != len(ends):
        raise ValueError(
            f"global_block_end_indices has {len(ends)} entries but global_block_indices has {len(starts)};"
            " give one end per start"
        )
    for start, end in zip(starts, ends, strict=True):
        if start >= end:
            raise ValueError(f"global block start {start} must be smaller than its end {end}")


def _global_blocks(starts: list[int], ends: list[int] | None, num_blocks: int) -> torch.Tensor:
    """A bool ``(num_blocks,)``: the blocks named global; those past the sequence are left out."""
    marked = torch.zeros(num_blocks, dtype=torch.bool)
    spans = zip(starts, ends, strict=True) if ends is not None else ((s, s + 1) for s in starts)
    for start, end in spans:
        if start < num_blocks:
            marked[start : min(end, num_blocks)] = True
    return marked


class SparsityConfig:
    """The shared part of every layout: heads, block size, one layout or one per head.

    Args:
        num_heads: attention heads of the layer.
        block: the block size; sequence lengths must be multiples of it.
        different_layout_per_head: give each head its own layout (random blocks, global patterns).
        seed: seeds the random blocks (``variable``, ``bigbird``); layouts with none ignore it.

    Subclasses implement :meth:`layout_for_head`.
    """

    def __init__(
        self, num_heads: int, block: int = 16, different_layout_per_head: bool = False, seed: int = 0
    ):
        if num_heads < 1 or block < 1:
            raise ValueError(f"num_heads={num_heads} and block={block} must be positive")
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1
        self.seed = seed
        self._cache: dict[int, Layout] = {}

    def num_blocks(self, seq_len: int) -> int:
        """``seq_len // block``; a ValueError when ``seq_len`` is not a multiple of the block."""
        if seq_len % self.block != 0:
            raise ValueError(f"Sequence Length, {seq_len}, needs to be dividable by Block size {self.block}!")
        return seq_len // self.block

    def layout_for_head(self, head: int, num_blocks: int, generator: torch.Generator) -> torch.Tensor:
        """The bool ``(num_blocks, num_blocks)`` layout of one head."""
        raise NotImplementedError(f"{type(self).__name__} does not define a layout")

    def make_layout(self, seq_len: int) -> Layout:
        """The int64 layout ``(num_heads, num_blocks, num_blocks)`` for ``seq_len`` (cached, read-only)."""
        if seq_len not in self._cache:
            num_blocks = self.num_blocks(seq_len)
            generator = torch.Generator().manual_seed(self.seed)
            heads = [self.layout_for_head(h, num_blocks, generator) for h in range(self.num_layout_heads)]
            layout = torch.stack(heads).to(torch.int64)
            self._cache[seq_len] = layout.expand(self.num_heads, num_blocks, num_blocks)
        return self._cache[seq_len]

    def _sliding(self, num_blocks: int, window: int) -> torch.Tensor:
        if num_blocks < window:
            raise ValueError(
                f"Number of sliding window blocks, {window}, must be smaller than overall number of blocks"
                f" in a row, {num_blocks}!"
            )
        pos = torch.arange(num_blocks)
        return (pos[:, None] - pos[None, :]).abs() <= window // 2

    def _random(self, num_blocks: int, count: int, generator: torch.Generator, causal: bool) -> torch.Tensor:
        if num_blocks < count:
            raise ValueError(
                f"Number of random blocks, {count}, must be smaller than overall number of blocks in a row,"
                f" {num_blocks}!"
            )
        out = torch.zeros(num_blocks, num_blocks, dtype=torch.bool)
        if count == 0:
            return out
        keys = torch.rand(num_blocks, num_blocks, generator=generator)
        if causal:
            pos = torch.arange(num_blocks)
            keys = keys.masked_fill(pos[None, :] > pos[:, None], -1.0)
        picked_keys, picked = keys.topk(count, dim=1)
        out.scatter_(1, picked, picked_keys >= 0)
        return out

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


class DenseSparsityConfig(SparsityConfig):
    """Every block attends to every block: dense attention, for comparison."""

    def layout_for_head(self, head: int, num_blocks: int, generator: torch.Generator) -> torch.Tensor:
        """All ones."""
        return torch.ones(num_blocks, num_blocks, dtype=torch.bool)


class FixedSparsityConfig(SparsityConfig):
    """The "fixed" pattern of Sparse Transformers (arXiv:1904.10509), as DeepSpeed customised it.

    Windows of ``num_local_blocks`` blocks attend within themselves; the last ``num_global_blocks``
    of each window (counting back by pattern: head ``h`` uses pattern ``h % num_different_global_patterns``)
    are global columns every row attends to (rows from the window on, when unidirectional), and
    global rows too with ``horizontal_global_attention``.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_local_blocks: int = 4,
        num_global_blocks: int = 1,
        attention: str = "bidirectional",
        horizontal_global_attention: bool = False,
        num_different_global_patterns: int = 1,
        seed: int = 0,
    ):
        super().__init__(num_heads, block, different_layout_per_head, seed)
        if num_global_blocks < 1 or num_local_blocks % num_global_blocks != 0:
            raise ValueError(
                f"Number of blocks in a local window, {num_local_blocks}, must be dividable by number of"
                f" global blocks, {num_global_blocks}!"
            )
        _check_attention(attention, horizontal_global_attention)
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError(
                "num_different_global_patterns > 1 needs different_layout_per_head=True (one layout cannot"
                " hold several patterns)"
            )
        if num_different_global_patterns > num_local_blocks // num_global_blocks:
            raise ValueError(
                f"num_different_global_patterns, {num_different_global_patterns}, cannot be larger than"
                f" num_local_blocks / num_global_blocks = {num_local_blocks // num_global_blocks}"
            )
        self.num_local_blocks = num_local_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention
        self.num_different_global_patterns = num_different_global_patterns

    def layout_for_head(self, head: int, num_blocks: int, generator: torch.Generator) -> torch.Tensor:
        """Local windows, then the global columns (and rows) of this head's pattern."""
        pos = torch.arange(num_blocks)
        window = pos // self.num_local_blocks
        layout = window[:, None] == window[None, :]
        if self.attention == "unidirectional":
            layout &= pos[None, :] <= pos[:, None]
        first = (
            self.num_local_blocks - (1 + head % self.num_different_global_patterns) * self.num_global_blocks
        )
        full_end = num_blocks - num_blocks % self.num_local_blocks
        starts = list(range(first, full_end, self.num_local_blocks))
        if full_end < num_blocks:  # the short last window keeps a global group inside the sequence
            starts.append(max(0, min(full_end + first, num_blocks - self.num_global_blocks)))
        first_row = torch.full((num_blocks,), num_blocks)  # the first row attending each global column
        for start in starts:
            cols = slice(start, start + self.num_global_blocks)
            row = 0 if self.attention == "bidirectional" else start
            first_row[cols] = torch.clamp(first_row[cols], max=row)
            if self.horizontal_global_attention:
                layout[cols, :] = True
        return layout | (pos[:, None] >= first_row[None, :])


class VariableSparsityConfig(SparsityConfig):
    """Fixed's generalisation: random blocks, listed local window sizes, listed global blocks.

    ``local_window_blocks`` gives the sizes of the first windows; the last size repeats to the end.
    ``global_block_indices`` (with ``global_block_end_indices``: half-open ranges) name the global
    columns (rows too with ``horizontal_global_attention``); indices past the sequence are ignored.
    Random blocks are drawn over the whole row, as in DeepSpeed, whatever ``attention`` says.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_random_blocks: int = 0,
        local_window_blocks: list[int] | None = None,
        global_block_indices: list[int] | None = None,
        global_block_end_indices: list[int] | None = None,
        attention: str = "bidirectional",
        horizontal_global_attention: bool = False,
        seed: int = 0,
    ):
        super().__init__(num_heads, block, different_layout_per_head, seed)
        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = list(local_window_blocks) if local_window_blocks is not None else [4]
        if not self.local_window_blocks or min(self.local_window_blocks) < 1:
            raise ValueError(f"local_window_blocks={self.local_window_blocks} needs positive window sizes")
        self.global_block_indices = list(global_block_indices) if global_block_indices is not None else [0]
        _check_global_ranges(self.global_block_indices, global_block_end_indices)
        self.global_block_end_indices = global_block_end_indices
        _check_attention(attention, horizontal_global_attention)
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention

    def window_ids(self, num_blocks: int) -> torch.Tensor:
        """The local window of each block: listed sizes first, then the last size repeated."""
        starts, start = [], 0
        for size in self.local_window_blocks:
            starts.append(start)
            start += size
        starts.extend(range(start, num_blocks, self.local_window_blocks[-1]))
        return torch.searchsorted(torch.tensor(starts), torch.arange(num_blocks), right=True) - 1

    def layout_for_head(self, head: int, num_blocks: int, generator: torch.Generator) -> torch.Tensor:
        """Random blocks, local windows, then the global columns (and rows)."""
        pos = torch.arange(num_blocks)
        layout = self._random(num_blocks, self.num_random_blocks, generator, causal=False)
        window = self.window_ids(num_blocks)
        local = window[:, None] == window[None, :]
        if self.attention == "unidirectional":
            local &= pos[None, :] <= pos[:, None]
        layout |= local
        marked = _global_blocks(self.global_block_indices, self.global_block_end_indices, num_blocks)
        if self.horizontal_global_attention:
            layout |= marked[:, None]
        if self.attention == "bidirectional":
            return layout | marked[None, :]
        # unidirectional: a global range is attended from its own first row on
        first_row = torch.full((num_blocks,), num_blocks)
        starts = self.global_block_indices
        ends = self.global_block_end_indices or [s + 1 for s in starts]
        for start, end in zip(starts, ends, strict=True):
            if start < num_blocks:
                span = slice(start, min(end, num_blocks))
                first_row[span] = torch.clamp(first_row[span], max=start)
        return layout | (pos[:, None] >= first_row[None, :])


class BigBirdSparsityConfig(SparsityConfig):
    """BigBird (arXiv:2007.14062), block-sparse: random blocks, a sliding window, global first blocks.

    The first ``num_global_blocks`` blocks are global rows and columns; ``unidirectional`` keeps
    the lower triangle and draws the random blocks from it.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_random_blocks: int = 1,
        num_sliding_window_blocks: int = 3,
        num_global_blocks: int = 1,
        attention: str = "bidirectional",
        seed: int = 0,
    ):
        super().__init__(num_heads, block, different_layout_per_head, seed)
        _check_attention(attention)
        self.num_random_blocks = num_random_blocks
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention

    def layout_for_head(self, head: int, num_blocks: int, generator: torch.Generator) -> torch.Tensor:
        """Random blocks, the sliding window, the global rows and columns, then the causal cut."""
        causal = self.attention == "unidirectional"
        layout = self._random(num_blocks, self.num_random_blocks, generator, causal)
        layout |= self._sliding(num_blocks, self.num_sliding_window_blocks)
        if num_blocks < self.num_global_blocks:
            raise ValueError(
                f"Number of global blocks, {self.num_global_blocks}, must be smaller than overall number of"
                f" blocks in a row, {num_blocks}!"
            )
        layout[: self.num_global_blocks, :] = True
        layout[:, : self.num_global_blocks] = True
        return layout.tril() if causal else layout


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer (arXiv:2004.05150): a sliding window plus global blocks.

    ``global_block_indices`` (with ``global_block_end_indices``: half-open ranges) are global rows
    and columns; indices past the sequence are ignored; ``unidirectional`` keeps the lower triangle.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_sliding_window_blocks: int = 3,
        global_block_indices: list[int] | None = None,
        global_block_end_indices: list[int] | None = None,
        attention: str = "bidirectional",
        seed: int = 0,
    ):
        super().__init__(num_heads, block, different_layout_per_head, seed)
        _check_attention(attention)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.global_block_indices = list(global_block_indices) if global_block_indices is not None else [0]
        _check_global_ranges(self.global_block_indices, global_block_end_indices)
        self.global_block_end_indices = global_block_end_indices
        self.attention = attention

    def layout_for_head(self, head: int, num_blocks: int, generator: torch.Generator) -> torch.Tensor:
        """The sliding window, the global rows and columns, then the causal cut."""
        layout = self._sliding(num_blocks, self.num_sliding_window_blocks)
        marked = _global_blocks(self.global_block_indices, self.global_block_end_indices, num_blocks)
        layout |= marked[:, None] | marked[None, :]
        return layout.tril() if self.attention == "unidirectional" else layout
