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
"""

from __future__ import annotations

import torch

from shardwise.ops.sparse_attention.block_plan import BlockPlan, RowGroup


def _gather_blocks(x: torch.Tensor, group: RowGroup, plan_heads: int) -> torch.Tensor:
    """``x`` ``(B, H, nb, bs, D)`` -> ``(B, H, n, width * bs, D)``: each row's key blocks."""
    b, h, _, bs, d = x.shape
    n, width = group.cols.shape[1:]
    if plan_heads == 1:
        picked = x.index_select(2, group.cols[0].reshape(-1))
    else:
        head = torch.arange(h, device=x.device)[:, None, None]
        picked = x[:, head, group.cols]
    return picked.reshape(b, h, n, width * bs, d)


def _structure_mask(group: RowGroup, bs: int, causal: bool) -> torch.Tensor:
    """True where a score must be dropped: padding blocks, and future keys when causal."""
    heads, n, _ = group.cols.shape
    drop = (~group.valid).repeat_interleave(bs, dim=-1)[:, :, None, :]  # (heads, n, 1, width*bs)
    if causal:
        q_pos = group.rows[:, None] * bs + torch.arange(bs, device=group.rows.device)  # (n, bs)
        k_pos = (group.cols[..., None] * bs + torch.arange(bs, device=group.cols.device)).reshape(
            heads, n, -1
        )
        drop = drop | (k_pos[:, :, None, :] > q_pos[None, :, :, None])
    return drop


def _pair_bias(bias: torch.Tensor, group: RowGroup, bs: int) -> torch.Tensor:
    """A ``(L, L)`` additive bias -> ``(heads, n, bs, width * bs)`` for this group's blocks."""
    nb = bias.shape[0] // bs
    tiles = bias.reshape(nb, bs, nb, bs).permute(0, 2, 1, 3)  # (q block, k block, bs, bs)
    picked = tiles[group.rows[None, :, None], group.cols]  # (heads, n, width, bs, bs)
    heads, n, width = group.cols.shape
    return picked.permute(0, 1, 3, 2, 4).reshape(heads, n, bs, width * bs)


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
    outs = []
    for group in plan.groups:
        n = group.rows.numel()
        if group.width == 0:
            outs.append(query.new_zeros(b, h, n, block, d))
            continue
        q = qb.index_select(2, group.rows) * scale  # (B, H, n, bs, D)
        if group.dense:
            k, v = key.unsqueeze(2), value.unsqueeze(2)  # (B, H, 1, L, D): every key, no copy
        else:
            k, v = _gather_blocks(kb, group, plan.heads), _gather_blocks(vb, group, plan.heads)
        scores = q @ k.transpose(-1, -2)  # (B, H, n, bs, width*bs)
        if key_bias is not None:
            kbias = key_bias.reshape(b, nb, block)
            picked = kbias[:, group.cols] if not group.dense else kbias[:, None, None]  # (B,heads,n,w,bs)
            scores = scores + picked.reshape(b, -1, picked.shape[2], 1, scores.shape[-1])
        if pair_bias is not None:
            if group.dense:
                scores = scores + pair_bias.reshape(nb, block, length)[group.rows]
            else:
                scores = scores + _pair_bias(pair_bias, group, block)
        if causal or not group.dense:
            scores = scores.masked_fill(_structure_mask(group, block, causal), float("-inf"))
        low = scores.dtype in (torch.float16, torch.bfloat16)  # softmax in fp32 for half types
        probs = torch.softmax(scores.float() if low else scores, dim=-1).to(value.dtype)
        outs.append(probs @ v)
    out = torch.cat(outs, dim=2).index_select(2, plan.order)
    return out.reshape(b, h, length, d)
