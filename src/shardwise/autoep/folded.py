"""The routed half of a folded AutoEP layer's forward (AutoEP beside AutoTP, ``autotp_size`` > 1).

Every rank of a tensor-parallel (TP) group holds the same tokens and the same router, so every lane
routes alike. Each routed (token, top-k slot) assignment is then computed once, by one lane
(:func:`shardwise.autoep.tp_dispatch.partition_assignments`); the lane sends its rows over the folded
expert-parallel group, combines the results it gets back into its share of the output
(:func:`~shardwise.autoep.tp_dispatch.combine_lane_rows`) and the shares are summed over the TP group.

Gradients are exact on every lane with no correction afterwards (Megatron's ``f``/``g`` pair,
:mod:`shardwise.tensor_parallel.functions`):

* ``g`` (sum forward, identity backward) on the summed output: every lane gets the output's whole
  gradient and hands each of its rows exactly that row's gradient, so an expert's gradient counts
  each assignment once;
* ``f`` (identity forward, sum backward) on the expert path's input and, once, on the routing scores
  the lane uses: each lane's gradient there covers only its own rows, and the sum over lanes covers
  them all. The router, layer norms and every TP-replicated weight before the layer then get the
  same whole gradient on every lane, which data parallelism reduces as usual.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from shardwise.autoep.tp_dispatch import (
    RoutedAssignmentPayload,
    assignment_ordinals_by_expert,
    combine_lane_rows,
    partition_assignments,
)
from shardwise.tensor_parallel.functions import copy_to_group, reduce_from_group

if TYPE_CHECKING:
    from shardwise.autoep.layer import AutoEPMoELayer

__all__ = ["folded_routed_output", "routed_payload"]


def routed_payload(selected: Tensor, scores: Tensor, top_k: int, num_local_experts: int, ep_size: int,
                   post_weights: bool) -> RoutedAssignmentPayload:
    """Every assignment of ``selected [T, k]`` (global expert indices) as one payload row, in expert
    order (so by expert-parallel destination). ``scores [T * k]`` (flat, slot-major per token) weight
    the rows when ``post_weights``; otherwise the rows are added unweighted (scores applied before)."""
    flat = selected.reshape(-1)
    routes = torch.argsort(flat, stable=True)
    experts = flat.index_select(0, routes).to(torch.long)
    weights = scores.index_select(0, routes) if post_weights else torch.ones(
        routes.numel(), dtype=torch.float32, device=routes.device)
    none = torch.zeros(routes.numel(), dtype=torch.bool, device=routes.device)
    splits = torch.bincount(experts // num_local_experts, minlength=ep_size)
    return RoutedAssignmentPayload(
        token_indices=routes // top_k, expert_indices=experts, assignment_indices=assignment_ordinals_by_expert(experts),
        capacity_slots=routes % top_k, combine_weights=weights, drop_mask=none, pad_mask=none.clone(),
        input_splits=[int(n) for n in splits.tolist()], output_splits=[],
        extra={"num_tokens": int(selected.shape[0]), "routes": routes},
    )


def folded_routed_output(layer: AutoEPMoELayer, x: Tensor, top_scores: Tensor, selected: Tensor) -> Tensor:
    """The routed experts' combined output ``[T, H]`` for tokens ``x [T, H]`` (the same on every lane
    of ``layer.tp_group``), each assignment computed by one lane; collective over the TP and the
    folded expert-parallel groups."""
    tp_group, tp_size = layer.tp_group, layer.tp_size
    post = layer.score_apply == "post"
    scores = copy_to_group(top_scores, tp_group, tp_size).reshape(-1)  # f: each lane's score grads are partial
    payload = routed_payload(selected, scores, layer.top_k, layer.num_local_experts, layer.ep_size, post)
    local, ctx = partition_assignments(payload, tp_group=tp_group, tp_rank=layer.tp_rank, tp_size=tp_size)
    x_experts = copy_to_group(x, tp_group, tp_size)  # f: each lane's rows are a part of the input's gradient
    routed = x_experts.index_select(0, local.token_indices)
    if not post:
        mine = local.extra["routes"]
        routed = (routed.float() * scores.index_select(0, mine).reshape(-1, 1)).to(routed.dtype)
    counts = torch.bincount(local.expert_indices, minlength=layer.num_experts)
    expert_output = layer.experts_over_ranks(routed, counts, local.expert_indices)
    share = combine_lane_rows(expert_output.float(), ctx)  # in fp32 through the TP sum, rounded once after
    if expert_output.shape[0] == 0 and expert_output.requires_grad:
        # A lane that owns no assignment must still run every collective of the backward, in the same
        # order as the others (the all-to-alls' and both f's): keep its empty results and scores in the
        # graph (an empty sum is an exact 0).
        share = share + expert_output.sum() + scores.index_select(0, local.extra["routes"]).sum()
    return reduce_from_group(share, tp_group, tp_size).to(x.dtype)  # g
