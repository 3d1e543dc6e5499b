"""Top-1, top-2 and top-k gating of a mixture of experts: routing, capacity and the balancing loss.

Every function takes the router's ``logits`` ``[S, E]`` (S tokens, E experts) and returns
``(l_aux, combine_weights, dispatch_mask, exp_counts)``, DeepSpeed's tuple (with ``sparse_routes``
DeepSpeed's sparse form ``(l_aux, capacity, E, indices, locations, gates, exp_counts)``: per route
``[k, S]``, the expert (-1 when dropped), its slot and its weight; :mod:`shardwise.moe.dispatch`
moves tokens with it in ``O(S k M)`` instead of the dense ``O(S E C M)``):

- ``combine_weights`` ``[S, E, C]``: the weight of token ``s`` in slot ``c`` of expert ``e``
  (zero where the token is not there); ``dispatch_mask`` is its boolean support. ``C`` is the
  capacity: how many tokens one expert takes from this rank.
- ``l_aux``: the load-balancing loss, ``E * sum_e(mean_gate_e * fraction_routed_e)`` for top-1
  (Switch Transformer) and ``E^2 * mean_e(...)`` for top-2 (GShard), ``E^2/k * mean_e`` for top-k,
  where the fraction counts first choices only (top-2) or every choice (top-k).
- ``exp_counts`` ``[E]``: tokens routed to each expert before any is dropped for capacity.

Capacity (``capacity``): ``ceil(S / E * capacity_factor * k)``, at least ``min_capacity``. Tokens
past an expert's capacity are dropped (their combine weight is zero; the residual path of the
model carries them). With ``drop_tokens=False`` the capacity is the largest count of any expert on
any rank of the expert-parallel group (one MAX all-reduce, so every rank sends equal-sized
all-to-all blocks).

Which tokens an expert keeps when it is over capacity: top-1 with ``use_rts`` (Random Token
Selection) keeps a uniformly random subset, else the first tokens in order; top-2 keeps them in
order, first choices before second choices; top-k keeps the tokens with the highest gate values
(``drop_policy="probs"``) or the first in order (``"position"``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from shardwise.comm import collectives
from shardwise.comm.group_type import Group

GateOutput = tuple[Tensor, Tensor, Tensor, Tensor]
SparseGateOutput = tuple[Tensor, int, int, Tensor, Tensor, Tensor, Tensor]


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """Slots per expert: ``ceil(num_tokens / num_experts * capacity_factor)``, at least ``min_capacity``.

    Example:
        >>> capacity(16, 4, 1.0, 0), capacity(16, 4, 2.0, 0), capacity(16, 4, 1.0, 8)
        (4, 8, 8)
    """
    return max(math.ceil(num_tokens / num_experts * capacity_factor), int(min_capacity))


def gumbel_noise(shape: torch.Size, device: torch.device) -> Tensor:
    """Standard Gumbel samples (``-log(-log(U))``) from torch's generator for ``device``."""
    return torch.distributions.Gumbel(
        torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
    ).rsample(shape)


def _max_count_capacity(exp_counts: Tensor, ep_group: Group, ep_size: int) -> int:
    """``drop_tokens=False``: the largest per-expert count over the expert-parallel group."""
    largest = exp_counts.max().reshape(1).clone()
    if ep_size > 1:
        collectives.all_reduce(largest, op="max", group=ep_group)
    return max(int(largest.item()), 1)


def _weighted_slots(weight: Tensor, mask: Tensor, slot: Tensor, cap: int) -> Tensor:
    """``[S, E, C]``: ``weight[s]`` where token ``s`` sits in slot ``slot[s]`` of the expert ``mask``
    marks for it (one expert per token, or none)."""
    slots = F.one_hot(slot.clamp(0, cap - 1).long(), num_classes=cap).to(weight.dtype)
    return (weight.unsqueeze(1) * mask.to(weight.dtype)).unsqueeze(-1) * slots.unsqueeze(1)


def _output(
    l_aux: Tensor,
    cap: int,
    num_experts: int,
    chosen: Tensor,
    slots: Tensor,
    weights: Tensor,
    exp_counts: Tensor,
    sparse: bool,
) -> GateOutput | SparseGateOutput:
    """The gate's result from its routes (``[k, S]``: expert or -1 when dropped, slot, weight): dense
    ``(l_aux, combine, dispatch, counts)``, or with ``sparse`` DeepSpeed's sparse form
    ``(l_aux, capacity, E, indices, locations, gates, counts)`` (int32 indices and locations)."""
    if sparse:
        return l_aux, cap, num_experts, chosen.to(torch.int32), slots.to(torch.int32), weights, exp_counts
    combine = sum(
        _weighted_slots(w, F.one_hot(e.clamp(min=0), num_experts) * e.ge(0).unsqueeze(1), slot, cap)
        for e, slot, w in zip(chosen, slots, weights)
    )
    assert isinstance(combine, Tensor)
    return l_aux, combine, combine.bool(), exp_counts


def _one_hot_slots(locations: Tensor, mask: Tensor, cap: int) -> Tensor:
    """``[S, E, C]``: 1 where token ``s`` sits in slot ``c`` of expert ``e`` (its mask is set)."""
    slots = F.one_hot(locations.clamp(0, cap - 1).long(), num_classes=cap).to(torch.float32)
    return slots * mask.unsqueeze(-1).to(torch.float32)


def top1gating(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group: Group = None,
    sparse_routes: bool = False,
    use_tutel: bool = False,
    *,
    ep_size: int = 1,
) -> GateOutput | SparseGateOutput:
    """Switch-Transformer routing: each token to its highest-gate expert, with weight that gate."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    chooser = logits + gumbel_noise(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    mask = F.one_hot(torch.argmax(chooser, dim=1), num_classes=num_experts)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts
    if drop_tokens:
        cap = capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    else:
        cap = min(_max_count_capacity(exp_counts, ep_group, ep_size), num_tokens)
    if use_rts:
        priority = mask * torch.rand(mask.shape, device=mask.device)
        keep_idx = torch.topk(priority, k=min(cap, num_tokens), dim=0).indices
        kept = torch.zeros_like(mask).scatter_(0, keep_idx, 1)
        mask = mask * kept
    else:
        mask = mask * torch.lt(torch.cumsum(mask, dim=0) - 1, cap)
    locations = torch.sum((torch.cumsum(mask, dim=0) - 1) * mask, dim=1)
    routed = mask.any(dim=1)
    chosen = torch.where(routed, mask.argmax(dim=1), torch.full_like(locations, -1))
    gate = torch.sum(gates * mask.float(), dim=1)
    return _output(l_aux, cap, num_experts, chosen[None], locations[None], gate[None], exp_counts, sparse_routes)


def top2gating(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: Group = None,
    top2_2nd_expert_sampling: bool = True,
    sparse_routes: bool = False,
    *,
    ep_size: int = 1,
) -> GateOutput | SparseGateOutput:
    """GShard routing: each token to its two best experts (the second chosen with Gumbel noise
    when ``top2_2nd_expert_sampling``), weights the two gates renormalised to sum to one."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=num_experts)
    chooser = logits + gumbel_noise(logits.shape, logits.device) if top2_2nd_expert_sampling else logits
    second = torch.argmax(chooser.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        cap = capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(locations1, cap)
        mask2 = mask2 * torch.lt(locations2, cap)
    else:
        cap = _max_count_capacity(exp_counts, ep_group, ep_size)
    gate1 = torch.sum(gates * mask1.float(), dim=1)
    gate2 = torch.sum(gates * mask2.float(), dim=1)
    denominator = torch.clamp(gate1 + gate2, min=torch.finfo(gates.dtype).eps)
    gate1, gate2 = gate1 / denominator, gate2 / denominator
    slot1 = torch.sum(locations1 * mask1, dim=1)
    slot2 = torch.sum(locations2 * mask2, dim=1)
    none = torch.full_like(first, -1)
    chosen = torch.stack([torch.where(mask1.any(dim=1), first, none), torch.where(mask2.any(dim=1), second, none)])
    return _output(
        l_aux, cap, num_experts, chosen, torch.stack([slot1, slot2]), torch.stack([gate1, gate2]), exp_counts,
        sparse_routes,
    )


def topkgating(
    logits: Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: Group = None,
    drop_policy: str = "probs",
    sparse_routes: bool = False,
    *,
    ep_size: int = 1,
) -> GateOutput | SparseGateOutput:
    """Each token to its ``k`` best experts, weights renormalised over the kept ones."""
    if drop_policy not in ("probs", "position"):
        raise ValueError(f"topkgating: drop_policy={drop_policy!r}; use 'probs' or 'position'")
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts * num_experts / k
    if drop_tokens:
        cap = capacity(num_tokens, num_experts, capacity_factor * k, min_capacity)
        if drop_policy == "probs":
            chosen = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
            keep_idx = torch.topk(chosen, k=min(cap, num_tokens), dim=0).indices
            mask = mask & torch.zeros_like(mask).scatter_(0, keep_idx, True)
        else:
            mask = mask & torch.lt(torch.cumsum(mask.long(), dim=0) - 1, cap)
    else:
        cap = _max_count_capacity(exp_counts, ep_group, ep_size)
    locations = torch.cumsum(mask.long(), dim=0) - 1
    kept = gates * mask
    kept = kept / torch.clamp(kept.sum(dim=-1, keepdim=True), min=torch.finfo(gates.dtype).eps)
    if not sparse_routes:
        combine = kept.unsqueeze(-1) * _one_hot_slots(locations, mask, cap)
        return l_aux, combine, combine.bool(), exp_counts
    routed = mask.gather(1, top_idx)
    chosen = torch.where(routed, top_idx, torch.full_like(top_idx, -1)).t()
    slots = (locations.gather(1, top_idx) * routed).t()
    return _output(l_aux, cap, num_experts, chosen, slots, kept.gather(1, top_idx).t(), exp_counts, True)
