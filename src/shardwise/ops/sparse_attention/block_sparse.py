"""Block-sparse attention in plain torch: gather each query block's key blocks, then batched matmuls.

Why not FlexAttention here: in eager mode ``flex_attention`` builds the full ``L x L`` score
matrix (no faster, no smaller than dense), and compiled it needs inductor's C++/Triton JIT,
which shardwise does not run for the user. This path does only the layout's work: for each
group of query blocks (:mod:`.block_plan`) it gathers the attended key/value blocks with index
tensors, computes ``q @ k^T`` on them, masks padding (and the causal triangle, the key-padding
and attention masks), takes the softmax over the gathered keys and multiplies by the gathered
values. Time and memory grow with the layout's block count, not with ``seq_len ** 2``; it runs
on any device torch runs on. :func:`~.block_mask.layout_block_mask` turns the same layout into
a FlexAttention ``BlockMask`` for callers who compile their model.

Autograd through these ops keeps every gathered block and the sparse scores for the backward;
:class:`~.sparse_self_attention.SparseSelfAttention` therefore runs the chunked, recomputing
version (:mod:`.chunked_block_sparse`, which reuses the score helpers below) and comes here only
when a bias (a learned relative position bias) needs its own gradient.
"""

from __future__ import annotations

import torch

from shardwise.ops.sparse_attention.block_plan import BlockPlan


def _gather_all_blocks(x: torch.Tensor, plan: BlockPlan) -> list[torch.Tensor]:
    """``x`` ``(B, H, nb, bs, D)`` -> per group ``(B, H, n, width * bs, D)``: each row's own key blocks.

    One gather for all groups (so the backward is one scatter-add into one gradient tensor), then
    views per group; dense groups get an empty placeholder.
    """
    b, h, _, bs, d = x.shape
    sparse = [g for g in plan.groups if not g.dense]
    if not sparse:
        return [x.new_empty(0) for _ in plan.groups]
    flat = torch.cat([g.cols.reshape(g.cols.shape[0], -1) for g in sparse], dim=-1)  # (heads, sum n*w)
    if plan.heads == 1:
        picked = x.index_select(2, flat[0])
    else:
        picked = x[:, torch.arange(h, device=x.device)[:, None], flat]
    pieces = iter(picked.split([g.cols[0].numel() for g in sparse], dim=2))
    out = []
    for g in plan.groups:
        if g.dense:
            out.append(x.new_empty(0))
        else:
            n, width = g.cols.shape[1:]
            out.append(next(pieces).reshape(b, h, n, width * bs, d))
    return out


def _pair_bias(bias: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, bs: int) -> torch.Tensor:
    """A ``(L, L)`` additive bias -> ``(heads, n, bs, width * bs)`` for these rows' key blocks."""
    nb = bias.shape[0] // bs
    tiles = bias.reshape(nb, bs, nb, bs).permute(0, 2, 1, 3)  # (q block, k block, bs, bs)
    picked = tiles[rows[None, :, None], cols]  # (heads, n, width, bs, bs)
    heads, n, width = cols.shape
    return picked.permute(0, 1, 3, 2, 4).reshape(heads, n, bs, width * bs)


def _rows_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a`` ``(B, H, n, r, x)`` @ ``b`` ``(B, H, n or 1, x, c)``; one GEMM per head when ``b`` is shared."""
    if b.shape[2] == 1 and a.shape[2] > 1:
        bsz, heads, n, r, x = a.shape
        return (a.reshape(bsz, heads, n * r, x) @ b.squeeze(2)).reshape(bsz, heads, n, r, -1)
    return a @ b


def _part_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    valid: torch.Tensor | None,
    bs: int,
    key_bias: torch.Tensor | None,
    pair_bias: torch.Tensor | None,
    causal: bool,
) -> torch.Tensor:
    """Masked scores of query rows ``q`` ``(B, H, n, bs, D)`` against key blocks ``cols`` ``(heads, n, w)``.

    ``k`` is ``(B, H, n or 1, w * bs, D)``; ``valid`` None means every block is real.
    """
    scores = _rows_matmul(q, k.transpose(-1, -2))  # (B, H, n, bs, w*bs)
    b = q.shape[0]
    if key_bias is not None:
        picked = key_bias.reshape(b, -1, bs)[:, cols]  # (B, heads, n, w, bs)
        scores = scores + picked.reshape(b, picked.shape[1], picked.shape[2], 1, -1)
    if pair_bias is not None:
        scores = scores + _pair_bias(pair_bias, rows, cols, bs)
    drop = None
    if valid is not None:
        drop = (~valid).repeat_interleave(bs, dim=-1)[:, :, None, :]  # (heads, n, 1, w*bs)
    if causal:
        q_pos = rows[:, None] * bs + torch.arange(bs, device=rows.device)  # (n, bs)
        k_pos = (cols[..., None] * bs + torch.arange(bs, device=cols.device)).flatten(-2)  # (heads, n, w*bs)
        future = k_pos[:, :, None, :] > q_pos[None, :, :, None]
        drop = future if drop is None else drop | future
    return scores if drop is None else scores.masked_fill(drop, float("-inf"))


def block_sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: BlockPlan,
    block: int,
    scale: float,
    key_bias: torch.Tensor | None = None,
    pair_bias: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Attention of ``(B, H, L, D)`` tensors over the plan's blocks only.

    Args:
        query, key, value: ``(B, H, L, D)``, ``L == plan.num_blocks * block``.
        plan: the grouped layout (:func:`~.block_plan.build_block_plan`), on the tensors' device.
        block: the block size.
        scale: multiplies ``q @ k^T`` before the biases are added.
        key_bias: ``(B, L)`` added to every query's scores for each key (key padding), or None.
        pair_bias: ``(L, L)`` added to the score of each (query, key) pair, or None.
        causal: drop the scores of keys after their query (element level).

    Returns:
        ``(B, H, L, D)``; a query whose every attended score is dropped gets NaN, as dense does.
    """
    b, h, length, d = query.shape
    nb = plan.num_blocks
    qb = query.reshape(b, h, nb, block, d)
    kb = key.reshape(b, h, nb, block, d)
    vb = value.reshape(b, h, nb, block, d)
    num_shared = plan.shared.numel()
    if num_shared:  # read once, used by every non-dense row
        k_shared = kb.index_select(2, plan.shared).reshape(b, h, 1, num_shared * block, d)
        v_shared = vb.index_select(2, plan.shared).reshape(b, h, 1, num_shared * block, d)
    # one gather each for the queries and the per-row keys/values of every group (one backward scatter)
    queries = (qb.index_select(2, torch.cat([g.rows for g in plan.groups])) * scale).split(
        [g.rows.numel() for g in plan.groups], dim=2
    )
    keys, values = _gather_all_blocks(kb, plan), _gather_all_blocks(vb, plan)
    outs = []
    for group, q, k_rows, v_rows in zip(plan.groups, queries, keys, values, strict=True):
        n = group.rows.numel()
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        if group.dense:  # every key, in place
            parts.append((key.unsqueeze(2), value.unsqueeze(2), group.cols, None))
        else:
            if num_shared:
                cols = plan.shared.expand(1, n, num_shared)
                parts.append((k_shared, v_shared, cols, None if group.all_shared else group.shared_valid))
            if group.width:
                parts.append((k_rows, v_rows, group.cols, None if group.all_valid else group.valid))
        if not parts:
            outs.append(query.new_zeros(b, h, n, block, d))
            continue
        scores = torch.cat(
            [
                _part_scores(q, k, group.rows, c, ok, block, key_bias, pair_bias, causal)
                for k, _, c, ok in parts
            ],
            dim=-1,
        )
        low = scores.dtype in (torch.float16, torch.bfloat16)  # softmax in fp32 for half types
        probs = torch.softmax(scores.float() if low else scores, dim=-1).to(value.dtype)
        sizes = [part[0].shape[-2] for part in parts]
        pieces = probs.split(sizes, dim=-1)
        out = _rows_matmul(pieces[0], parts[0][1])
        for piece, part in zip(pieces[1:], parts[1:], strict=True):
            out = out + _rows_matmul(piece, part[1])
        outs.append(out)
    out = torch.cat(outs, dim=2).index_select(2, plan.order)
    return out.reshape(b, h, length, d)
