"""DeepSpeed-Ulysses around any local attention: ``deepspeed.sequence.layer.DistributedAttention``.

Each rank of the sequence-parallel group holds a slice of the sequence. Before attention one
all-to-all per input (q, k, v) scatters the heads and gathers the sequence, so each rank attends
over the whole sequence with its share of the heads; after attention one all-to-all scatters the
sequence and gathers the heads back. The exchanges are :func:`shardwise.comm.sequence_exchange.all_to_all_dims`
(their backward is the inverse exchange), so gradients reach every rank's q/k/v.

Tensors are 4-D, ``[b, s, h, d]`` (``batch_dim_idx=0``) or ``[s, b, h, d]`` (``batch_dim_idx=1``).
As in DeepSpeed, ``scatter_idx >= 2`` means "scatter heads, gather sequence" and ``scatter_idx < 2``
the inverse; the sequence dimension is the one that is not the batch dimension.

Example (a group of one rank is the identity around the local attention):
    >>> import torch
    >>> attention = DistributedAttention(lambda q, k, v: q + k + v, sequence_process_group=None)
    >>> q = torch.ones(1, 4, 2, 8)
    >>> attention(q, q, q, batch_dim_idx=0).sum().item()
    192.0
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from shardwise.comm.group_type import Group
from shardwise.comm.sequence_exchange import all_gather_sizes, all_to_all_dims, group_rank, group_size
from shardwise.sequence.layout import HEAD_DIM, head_shard_sizes, sequence_dim

__all__ = ["DistributedAttention", "_SeqAllToAll", "apply_rotary_pos_emb", "seq_all_to_all"]


def seq_all_to_all(
    group: Group,
    x: Tensor,
    scatter_idx: int,
    batch_dim_idx: int,
    num_kv_heads: int | None = None,
    head_sizes: list[int] | None = None,
) -> Tensor:
    """One Ulysses exchange of a 4-D tensor (differentiable).

    Args:
        group: the sequence-parallel group.
        x: ``[b, s, h, d]`` or ``[s, b, h, d]``.
        scatter_idx: >= 2 scatters heads and gathers the sequence; < 2 the inverse.
        batch_dim_idx: 0 or 1, where the batch is.
        num_kv_heads: the key/value head count the head split follows (heads-scatter direction).
        head_sizes: every rank's head count (sequence-scatter direction); asked of the group when None.
    """
    if x.dim() != 4:
        raise ValueError(
            f"Ulysses all-to-all takes 4-D tensors [b, s, h, d] or [s, b, h, d], got shape {tuple(x.shape)}"
        )
    world = group_size(group)
    if world == 1:
        return x
    seq = sequence_dim(batch_dim_idx)
    if scatter_idx >= 2:
        sizes = head_shard_sizes(x.shape[HEAD_DIM], world, num_kv_heads)
        return all_to_all_dims(x, HEAD_DIM, seq, group, scatter_sizes=sizes, world_size=world)
    if head_sizes is None:
        head_sizes = all_gather_sizes(x.shape[HEAD_DIM], group, x.device)
    return all_to_all_dims(x, seq, HEAD_DIM, group, gather_sizes=head_sizes, world_size=world)


class _SeqAllToAll:
    """DeepSpeed's ``_SeqAllToAll.apply(group, input, scatter_idx, gather_idx, batch_dim_idx, ...)``.

    Autograd comes from the exchange itself; the stream/handle overlap arguments of DeepSpeed's
    CUDA path are accepted and have no effect (one synchronous exchange).
    """

    @staticmethod
    def apply(
        group: Group,
        input: Tensor,
        scatter_idx: int,
        gather_idx: int,
        batch_dim_idx: int,
        stream: Any = None,
        handle: Any = None,
        type: Any = None,
        is_fwd: bool = True,
        num_kv_heads: int | None = None,
    ) -> Tensor:
        """Exchange ``input`` (see :func:`seq_all_to_all`); ``gather_idx`` is implied by the layout."""
        del gather_idx, stream, handle, type, is_fwd
        return seq_all_to_all(group, input, scatter_idx, batch_dim_idx, num_kv_heads=num_kv_heads)


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(t: Tensor, freqs_cos: Tensor, freqs_sin: Tensor) -> Tensor:
    """Rotary embedding on the first ``freqs_cos.shape[-1]`` channels of ``t`` (the rest pass through)."""
    rot = freqs_cos.shape[-1]
    head, rest = t[..., :rot], t[..., rot:]
    head = head * freqs_cos + _rotate_half(head) * freqs_sin
    return head if rest.shape[-1] == 0 else torch.cat((head, rest), dim=-1)


class DistributedAttention(nn.Module):
    """Ulysses sequence parallelism around ``local_attention`` (DeepSpeed's signature).

    Args:
        local_attention: called as ``local_attention(q, k, v, *args, **kwargs)`` on the
            head-sharded, full-sequence tensors.
        sequence_process_group: the sequence-parallel group
            (``deepspeed.utils.groups._get_sequence_parallel_group()``).
        scatter_idx: 2 (DeepSpeed's default): scatter heads before attention.
        gather_idx: 0 (DeepSpeed's default); the sequence dimension follows ``batch_dim_idx``.
        sp_stream: DeepSpeed's CUDA overlap stream; must be None here (the exchanges are synchronous).
        num_kv_heads: key/value heads before sharding (default: read off ``key`` each forward).
    """

    def __init__(
        self,
        local_attention: Any,
        sequence_process_group: Group,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        if sp_stream is not None:
            raise ValueError(
                "DistributedAttention(sp_stream=...): overlapping the exchanges on a side stream is not "
                "implemented in shardwise; pass sp_stream=None (the exchanges then run in order)"
            )
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.num_kv_heads = num_kv_heads
        self.sp_stream = None
        self.sp_overlap_comm = False

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        batch_dim_idx: int,
        rotary_pos_emb: tuple[Tensor, Tensor] | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Tensor:
        """Attention over the whole sequence; returns this rank's sequence slice of the context."""
        group, world = self.spg, group_size(self.spg)
        kv = self.num_kv_heads if self.num_kv_heads is not None else key.shape[HEAD_DIM]
        q, k, v = (
            seq_all_to_all(group, t, self.scatter_idx, batch_dim_idx, num_kv_heads=kv)
            for t in (query, key, value)
        )
        if rotary_pos_emb is not None:
            cos, sin = (f.permute(1, 0, 2, 3) for f in rotary_pos_emb)
            q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        if self.scatter_idx < 2:  # the inputs arrived head-sharded: the output goes back the same way
            return seq_all_to_all(group, context, HEAD_DIM, batch_dim_idx, num_kv_heads=kv)
        head_sizes = head_shard_sizes(query.shape[HEAD_DIM], world, kv) if world > 1 else None
        return seq_all_to_all(group, context, 0, batch_dim_idx, head_sizes=head_sizes)

    def extra_repr(self) -> str:
        """The group's size and this rank's place in it."""
        return f"sp_size={group_size(self.spg)}, sp_rank={group_rank(self.spg)}"
