"""Block-sparse attention in chunks of query rows, with a recomputing backward (flash attention's scheme).

Why written by hand: torch has no fused CPU kernel for block-sparse attention. The fused CPU
kernel of ``scaled_dot_product_attention`` takes only a dense ``L x L`` mask and reads every key
block; ``flex_attention`` is fused only when compiled, which needs inductor's C++/Triton JIT
build (shardwise does not run one for the user), and in eager mode it materialises the ``L x L``
scores. So the memory scheme of a fused kernel is written out here, in plain torch ops.

Autograd through :func:`~.block_sparse.block_sparse_attention` keeps every gathered key/value
block and the full sparse score and probability tensors alive until the backward: several times
the memory of the fused dense kernel. :class:`ChunkedBlockSparseAttention` instead runs each row
group of the plan (:mod:`.block_plan`) in chunks of query-block rows, under no autograd graph,
and reads each chunk's keys in tiles of about :data:`TILE_KEYS` keys (the shared columns, or
every key for a dense row, then the row's own gathered blocks): masked scores per tile, an
online softmax across the tiles (running maximum and sum, the output accumulator rescaled), then
the chunk's output and per-row log-sum-exp. It saves only ``q``, ``k``, ``v``, the output and
the log-sum-exp ``(B, H, L)``. The backward recomputes each tile's scores, takes the
probabilities as ``P = exp(S - lse)`` and forms ``dV += P^T dO``, ``dS = P * (dO V^T - rowsum(dO * O))``,
``dQ += scale * dS K`` and ``dK += dS^T (scale * Q)``, scatter-adding the gathered blocks'
gradients into ``dK``/``dV``. The extra memory is one chunk-by-tile working set, sized from a
byte budget (:func:`rows_per_chunk`), whatever the sequence length or the layout's density.

The biases (key padding, attention mask, relative position) get no gradient here: when one of
them requires grad, :func:`sparse_attention` runs the autograd path instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from shardwise.ops.sparse_attention.block_plan import BlockPlan, RowGroup
from shardwise.ops.sparse_attention.block_sparse import _part_scores, _rows_matmul, block_sparse_attention

CHUNK_BYTES = 4 * 2**20
"""Default working-set budget of one chunk of query rows against one key tile, in bytes."""

TILE_KEYS = 256
"""Keys per tile: a chunk reads its keys in tiles of about this many (online softmax across tiles)."""


@dataclass(frozen=True)
class _Tile:
    """Keys a chunk reads at once: ``"rows"`` (gathered per query row) or ``"common"`` (one set for all rows)."""

    kind: str
    keys: torch.Tensor  # (B, H, n or 1, keys, D)
    values: torch.Tensor
    cols: torch.Tensor  # (heads, n, blocks): the key blocks, for the masks and the gradients
    valid: torch.Tensor | None  # None: every block is real


def tile_blocks(block: int) -> int:
    """Key blocks per tile (:data:`TILE_KEYS` keys, at least one block)."""
    return max(1, TILE_KEYS // block)


def rows_per_chunk(
    group: RowGroup, plan: BlockPlan, batch_heads: int, block: int, head_dim: int, item_size: int, budget: int
) -> int:
    """Query-block rows of ``group`` per chunk so that one chunk's working set fits ``budget`` bytes.

    Per query-block row and key tile of ``K`` keys (:func:`tile_blocks`), per batch and head: four
    ``block x K`` fp32 tensors (scores, probabilities, ``dP``, ``dS``); the row's own gathered
    keys, values and their gradients (``4 * K_rows * head_dim`` items); and its queries, output
    gradient, output, softmax accumulator and ``dQ`` (``5 * block * head_dim`` fp32). At least one row.
    """
    tile = tile_blocks(block)
    common = plan.num_blocks if group.dense else plan.shared.numel()
    rows_keys = 0 if group.dense else min(tile, group.width) * block
    keys = max(min(tile, common) * block, rows_keys)
    per_row = batch_heads * (16 * block * keys + 4 * rows_keys * head_dim * item_size + 20 * block * head_dim)
    return max(1, budget // max(per_row, 1))


def _gather(xb: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``xb`` ``(B, H, nb, bs, D)``, ``cols`` ``(heads, n, w)`` -> ``(B, H, n, w * bs, D)``."""
    b, h, _, bs, d = xb.shape
    heads, n, w = cols.shape
    if heads == 1:
        picked = xb.index_select(2, cols.reshape(-1))
    else:  # indexing, not a (B, H * nb) view: that would copy all of a non-contiguous ``xb``
        picked = xb[:, torch.arange(h, device=cols.device)[:, None, None], cols]  # (B, H, n, w, bs, D)
    return picked.reshape(b, h, n, w * bs, d)


def _scatter_add(acc: torch.Tensor, cols: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` ``(B, H, n, w * bs, D)`` into the blocks ``cols`` of ``acc`` ``(B, H, nb, bs, D)``."""
    b, h, nb, bs, d = acc.shape
    heads, n, w = cols.shape
    grad = grad.to(acc.dtype)
    if heads == 1:
        acc.index_add_(2, cols.reshape(-1), grad.reshape(b, h, n * w, bs, d))
    else:
        flat = (torch.arange(h, device=cols.device)[:, None, None] * nb + cols).reshape(-1)
        acc.view(b, h * nb, bs, d).index_add_(1, flat, grad.reshape(b, h * n * w, bs, d))


def _chunks(group: RowGroup, size: int) -> list[RowGroup]:
    """``group`` cut into consecutive row slices of at most ``size`` rows."""
    total = group.rows.numel()
    if size >= total:
        return [group]
    return [
        RowGroup(
            group.rows[i : i + size],
            group.cols[:, i : i + size],
            group.valid[:, i : i + size],
            group.shared_valid[:, i : i + size],
            group.dense,
            group.all_valid,
            group.all_shared,
        )
        for i in range(0, total, size)
    ]


class _Inputs:
    """The blocked views every chunk reads (forward and backward), and the chunk's key tiles."""

    def __init__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: BlockPlan, block: int
    ) -> None:
        b, h, _, d = query.shape
        self.plan, self.block, self.tile = plan, block, tile_blocks(block)
        self.qb = query.reshape(b, h, plan.num_blocks, block, d)
        self.kb = key.reshape(b, h, plan.num_blocks, block, d)
        self.vb = value.reshape(b, h, plan.num_blocks, block, d)
        self.all_blocks = torch.arange(plan.num_blocks, device=query.device)

    def tiles(self, chunk: RowGroup) -> Iterator[_Tile]:
        """The key tiles of ``chunk``, gathered one at a time (only one tile's keys are alive)."""
        n, tile = chunk.rows.numel(), self.tile
        common = self.all_blocks if chunk.dense else self.plan.shared
        for start in range(0, common.numel(), tile):
            cols = common[start : start + tile]
            b, h, _, bs, d = self.kb.shape
            keys = self.kb.index_select(2, cols).reshape(b, h, 1, cols.numel() * bs, d)
            values = self.vb.index_select(2, cols).reshape(b, h, 1, cols.numel() * bs, d)
            valid = (
                None if chunk.dense or chunk.all_shared else chunk.shared_valid[:, :, start : start + tile]
            )
            yield _Tile("common", keys, values, cols.expand(1, n, cols.numel()), valid)
        if chunk.dense:
            return
        for start in range(0, chunk.width, tile):
            cols = chunk.cols[:, :, start : start + tile]
            valid = None if chunk.all_valid else chunk.valid[:, :, start : start + tile]
            yield _Tile("rows", _gather(self.kb, cols), _gather(self.vb, cols), cols, valid)


def _scores(q: torch.Tensor, chunk: RowGroup, tile: _Tile, block: int, masks: tuple) -> torch.Tensor:
    """The chunk's masked scores against one tile, in fp32 ``(B, H, n, bs, keys)``."""
    key_bias, pair_bias, causal = masks
    scores = _part_scores(q, tile.keys, chunk.rows, tile.cols, tile.valid, block, key_bias, pair_bias, causal)
    return scores.float()


class ChunkedBlockSparseAttention(torch.autograd.Function):
    """Block-sparse attention saving only ``q, k, v``, the output and the log-sum-exp (see the module)."""

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_bias: torch.Tensor | None,
        pair_bias: torch.Tensor | None,
        plan: BlockPlan,
        block: int,
        scale: float,
        causal: bool,
        chunk_rows: Callable[[RowGroup], int],
    ) -> torch.Tensor:
        b, h, length, d = query.shape
        inputs = _Inputs(query, key, value, plan, block)
        out = query.new_zeros(b, h, plan.num_blocks, block, d)
        lse = torch.full((b, h, plan.num_blocks, block), float("-inf"), device=query.device)
        masks = (key_bias, pair_bias, causal)
        for group in plan.groups:
            for chunk in _chunks(group, chunk_rows(group)):
                q = inputs.qb.index_select(2, chunk.rows) * scale
                top = torch.full(q.shape[:-1], float("-inf"), device=q.device)  # running max
                total = torch.zeros(q.shape[:-1], device=q.device)  # running sum of exp(s - top)
                acc = torch.zeros(q.shape, device=q.device)
                seen = False
                for tile in inputs.tiles(chunk):  # online softmax across the tiles
                    seen = True
                    scores = _scores(q, chunk, tile, block, masks)
                    new_top = torch.maximum(top, scores.amax(-1))
                    shift = new_top.masked_fill(new_top == float("-inf"), 0.0)  # nothing kept yet
                    probs = scores.sub_(shift[..., None]).exp_()
                    rescale = (top - shift).exp_()
                    total = total.mul_(rescale).add_(probs.sum(-1))
                    part = _rows_matmul(probs.to(value.dtype), tile.values)
                    acc = acc.mul_(rescale[..., None]).add_(part)
                    top = new_top
                if not seen:
                    continue  # a row with no block: output 0, as the gathered path gives
                # a row whose every score is dropped: 0 / 0 = NaN, as dense attention gives
                out.index_copy_(2, chunk.rows, (acc / total[..., None]).to(out.dtype))
                lse.index_copy_(2, chunk.rows, top + total.log())
        out = out.reshape(b, h, length, d)
        ctx.save_for_backward(query, key, value, out, lse, key_bias, pair_bias)
        ctx.plan, ctx.block, ctx.scale, ctx.causal, ctx.chunk_rows = plan, block, scale, causal, chunk_rows
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, lse, key_bias, pair_bias = ctx.saved_tensors
        plan, block, scale = ctx.plan, ctx.block, ctx.scale
        b, h, length, d = query.shape
        inputs = _Inputs(query, key, value, plan, block)
        acc_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
        dq = torch.zeros(b, h, plan.num_blocks, block, d, dtype=acc_dtype, device=query.device)
        dk, dv = torch.zeros_like(dq), torch.zeros_like(dq)
        grad_out = grad_out.reshape(b, h, plan.num_blocks, block, d)
        out = out.reshape(b, h, plan.num_blocks, block, d)
        masks = (key_bias, pair_bias, ctx.causal)
        for group in plan.groups:
            for chunk in _chunks(group, ctx.chunk_rows(group)):
                n = chunk.rows.numel()
                q = inputs.qb.index_select(2, chunk.rows) * scale
                d_out = grad_out.index_select(2, chunk.rows)
                delta = (d_out.float() * out.index_select(2, chunk.rows).float()).sum(-1)  # rowsum(dO * O)
                row_lse = lse.index_select(2, chunk.rows)
                chunk_dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
                for tile in inputs.tiles(chunk):
                    probs = _scores(q, chunk, tile, block, masks).sub_(row_lse[..., None]).exp_()
                    d_probs = _rows_matmul(d_out, tile.values.transpose(-1, -2)).float()
                    d_scores = d_probs.sub_(delta[..., None]).mul_(probs)
                    probs_v, d_scores_v = probs.to(value.dtype), d_scores.to(value.dtype)
                    chunk_dq.add_(_rows_matmul(d_scores_v, tile.keys))
                    if tile.kind == "rows":  # per-row blocks: (B, H, n, w * bs, D), scattered back
                        _scatter_add(dk, tile.cols, d_scores_v.transpose(-1, -2) @ q)
                        _scatter_add(dv, tile.cols, probs_v.transpose(-1, -2) @ d_out)
                        continue
                    # common keys: one GEMM over all the chunk's queries
                    ds_t = d_scores_v.reshape(b, h, n * block, -1).transpose(-1, -2)
                    p_t = probs_v.reshape(b, h, n * block, -1).transpose(-1, -2)
                    cols = tile.cols[0, 0]
                    shape = (b, h, cols.numel(), block, d)
                    dk.index_add_(
                        2, cols, (ds_t @ q.reshape(b, h, n * block, d)).reshape(shape).to(acc_dtype)
                    )
                    dv.index_add_(
                        2, cols, (p_t @ d_out.reshape(b, h, n * block, d)).reshape(shape).to(acc_dtype)
                    )
                dq.index_copy_(2, chunk.rows, chunk_dq.mul_(scale))
        grads = (t.reshape(b, h, length, d).to(query.dtype) for t in (dq, dk, dv))
        return (*grads, None, None, None, None, None, None, None)


def sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: BlockPlan,
    block: int,
    scale: float,
    key_bias: torch.Tensor | None = None,
    pair_bias: torch.Tensor | None = None,
    causal: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Block-sparse attention of ``(B, H, L, D)`` tensors, chunked (arguments as
    :func:`~.block_sparse.block_sparse_attention`).

    Args:
        chunk_bytes: the working-set budget of one chunk (:func:`rows_per_chunk`).
        chunk_rows: query-block rows per chunk, overriding ``chunk_bytes`` (tests, tuning).

    A bias that requires grad (a learned relative position bias) sends the call through the
    autograd path of :func:`~.block_sparse.block_sparse_attention`, which gives it its gradient.
    """
    if any(t is not None and t.requires_grad for t in (key_bias, pair_bias)) and torch.is_grad_enabled():
        return block_sparse_attention(query, key, value, plan, block, scale, key_bias, pair_bias, causal)
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows}: use a positive number of query-block rows")
    batch_heads, head_dim = query.shape[0] * query.shape[1], query.shape[-1]

    def rows_for(group: RowGroup) -> int:
        if chunk_rows is not None:
            return chunk_rows
        return rows_per_chunk(group, plan, batch_heads, block, head_dim, query.element_size(), chunk_bytes)

    out: torch.Tensor = ChunkedBlockSparseAttention.apply(
        query, key, value, key_bias, pair_bias, plan, block, scale, causal, rows_for
    )
    return out
