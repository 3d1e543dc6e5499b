"""Moving tokens to their experts and back: the expert-parallel all-to-all with autograd.

After gating, each rank holds a ``[E, C, M]`` block: slot ``c`` of expert ``e`` filled with one of
its tokens (or zeros). Experts are owned in runs: rank ``r`` of the expert-parallel group owns the
global experts ``r * L .. r * L + L - 1`` (``L = E / ep_size``). One all-to-all sends the block's
``ep_size`` equal chunks along the expert dimension to their owners, so afterwards a rank holds
``[ep_size, L, C, M]``: for each source rank, its tokens for this rank's experts. The backward of an
all-to-all is the same all-to-all on the gradients. Every rank sends and receives the same number
of bytes whatever the routing (empty slots travel as zeros), so a rank that routes no token to an
expert still takes part: no rank waits for a message that never comes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from shardwise.comm import torch_api
from shardwise.comm.group_type import Group


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over ``group`` along dimension 0, differentiable (backward: the
    same exchange of the gradients)."""

    @staticmethod
    def forward(ctx: Any, group: Group, block: Tensor) -> Tensor:
        ctx.group = group
        block = block.contiguous()
        received = torch.empty_like(block)
        torch_api.all_to_all_single(received, block, group=group)
        return received

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[None, Tensor]:
        return None, AllToAll.apply(ctx.group, grads[0])


def exchange(block: Tensor, group: Group, ep_size: int) -> Tensor:
    """``block`` after the expert-parallel all-to-all (itself, contiguous, without expert parallelism)."""
    if ep_size == 1:
        return block.contiguous()
    return AllToAll.apply(group, block)


def dispatch(tokens: Tensor, dispatch_mask: Tensor) -> Tensor:
    """``[S, M]`` tokens into their ``[E, C, M]`` expert slots (exact: each slot copies one token)."""
    return torch.einsum("sec,sm->ecm", dispatch_mask.to(tokens.dtype), tokens)


def combine(expert_output: Tensor, combine_weights: Tensor) -> Tensor:
    """``[E, C, M]`` expert results back to ``[S, M]`` tokens, each the gate-weighted sum of its slots."""
    return torch.einsum("sec,ecm->sm", combine_weights.to(expert_output.dtype), expert_output)


def all_to_all_bytes(num_experts: int, capacity: int, hidden: int, ep_size: int, element_size: int) -> int:
    """Bytes one rank sends per MoE layer forward (two all-to-alls, the part leaving the rank).

    Example:
        >>> all_to_all_bytes(4, 8, 16, 2, 4)  # half of a [4, 8, 16] fp32 block, twice
        2048
    """
    if ep_size == 1:
        return 0
    block = num_experts * capacity * hidden * element_size
    return 2 * block * (ep_size - 1) // ep_size


def route_slots(indices: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    """``[k, S]`` flat slots ``expert * capacity + location`` of every route; a dropped route
    (expert -1) points at the spare slot ``num_experts * capacity`` (read as zeros, written nowhere)."""
    flat = indices.long() * capacity + locations.long()
    return torch.where(indices >= 0, flat, torch.full_like(flat, num_experts * capacity))


def sparse_encode(tokens: Tensor, slots: Tensor, num_experts: int, capacity: int) -> Tensor:
    """``[S, M]`` tokens into their ``[E, C, M]`` slots by one gather (each filled slot names its
    token; empty ones name a zero row)."""
    num_tokens, hidden = tokens.shape
    source = torch.full((num_experts * capacity + 1,), num_tokens, dtype=torch.long, device=tokens.device)
    token_ids = torch.arange(num_tokens, device=tokens.device).expand_as(slots)
    source.scatter_(0, slots.reshape(-1), token_ids.reshape(-1))
    padded = torch.cat([tokens, tokens.new_zeros(1, hidden)])
    return padded.index_select(0, source[:-1]).view(num_experts, capacity, hidden)


def sparse_decode(expert_output: Tensor, slots: Tensor, gates: Tensor, num_tokens: int) -> Tensor:
    """``[E * C, M]`` expert results back to ``[S, M]`` tokens: each token's routes read from
    their slots, weighted by their gates and summed."""
    hidden = expert_output.shape[-1]
    padded = torch.cat([expert_output, expert_output.new_zeros(1, hidden)])
    routed = padded.index_select(0, slots.reshape(-1)).view(slots.shape[0], num_tokens, hidden)
    return (routed * gates.unsqueeze(-1)).sum(dim=0).to(expert_output.dtype)


class AllToAllV(torch.autograd.Function):
    """``all_to_all_single`` with per-rank row counts (``send`` rows of ``rows`` to each rank, ``recv``
    from each), differentiable: the backward sends the gradients back with the counts swapped."""

    @staticmethod
    def forward(ctx: Any, group: Group, rows: Tensor, send: list[int], recv: list[int]) -> Tensor:
        ctx.group, ctx.send, ctx.recv = group, send, recv
        received = rows.new_empty((sum(recv), *rows.shape[1:]))
        torch_api.all_to_all_single(received, rows.contiguous(), recv, send, group=group)
        return received

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[None, Tensor, None, None]:
        return None, AllToAllV.apply(ctx.group, grads[0].contiguous(), ctx.recv, ctx.send), None, None


def exchange_counts(send: Tensor, group: Group) -> Tensor:
    """Each rank's ``send[r]`` (rows it sends to rank ``r``) to rank ``r``: the rows each rank receives."""
    received = torch.empty_like(send)
    torch_api.all_to_all_single(received, send.contiguous(), group=group)
    return received


def exchange_ids(ids: Tensor, send: list[int], recv: list[int], group: Group) -> Tensor:
    """Integer labels of the rows an all-to-all moves (no gradient), in the same split."""
    received = ids.new_empty(sum(recv))
    torch_api.all_to_all_single(received, ids.contiguous(), recv, send, group=group)
    return received
