"""``AutoEPMoELayer``: a model's MoE block rebuilt for expert parallelism, and the routing pieces
it is made of (the split plan of the all-to-all, score application, the combine).

The layer keeps this rank's ``num_experts / ep_size`` experts (a run of consecutive global
indices). Routing is dropless: a token's every route travels, in variable-sized all-to-alls whose
row counts come from one exchange of the per-expert histogram (:func:`compute_split_plan`).
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

import shardwise.comm as dist
from shardwise.autoep.config import AutoEPConfig
from shardwise.autoep.experts import GroupedExperts
from shardwise.autoep.folded import folded_routed_output
from shardwise.autoep.presets import MoELayerSpec
from shardwise.autoep.repack import gathered_source, repack_expert_requires_grad_flags, repack_expert_weights
from shardwise.autoep.router import TokenChoiceTopKRouter, count_tokens_per_expert
from shardwise.comm.group_type import Group
from shardwise.moe.dispatch import AllToAllV

EXPERT_FAMILY = "autoep_expert"
"""``ds_zero_placement_family`` of expert weights (sharded over their expert-data-parallel group)."""
REPLICATED_FAMILY = "replicated"
"""``ds_zero_placement_family`` of router and shared-expert weights (reduced over all data ranks)."""


class SplitPlan(NamedTuple):
    """Row counts of one layer's all-to-all: ``input_splits[r]`` rows go to rank ``r``,
    ``output_splits[r]`` come from it; ``local_counts [L]`` rows per local expert in all,
    ``local_counts_by_source [ep, L]`` of them from each rank."""

    input_splits: list[int]
    output_splits: list[int]
    local_counts: Tensor
    local_counts_by_source: Tensor


def _plan_from_counts(counts: Tensor, ep_size: int, num_local_experts: int, ep_group: Group) -> SplitPlan:
    counts = counts.to(torch.int32).contiguous()
    if ep_size == 1:
        total = int(counts.sum())
        return SplitPlan([total], [total], counts, counts.view(1, num_local_experts))
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=ep_group)  # one exchange: [ep, L] per rank
    by_source = received.view(ep_size, num_local_experts)
    return SplitPlan(counts.view(ep_size, num_local_experts).sum(dim=1).tolist(), by_source.sum(dim=1).tolist(),
                     by_source.sum(dim=0), by_source)


def compute_split_plan(selected_experts: Tensor, num_experts: int, ep_size: int, num_local_experts: int,
                       ep_group: Group, num_tokens_per_expert: Tensor | None = None) -> SplitPlan:
    """The split plan of routes ``selected_experts`` (any shape, global expert indices); collective
    over ``ep_group`` when ``ep_size > 1`` (one all-to-all of ``num_experts`` int32 counts)."""
    counts = num_tokens_per_expert if num_tokens_per_expert is not None else count_tokens_per_expert(
        selected_experts, num_experts)
    return _plan_from_counts(counts, ep_size, num_local_experts, ep_group)


def compute_split_plan_from_expert_indices(expert_indices: Tensor, num_experts: int, ep_size: int,
                                           num_local_experts: int, ep_group: Group) -> SplitPlan:
    """:func:`compute_split_plan` from a flat list of routes' expert indices."""
    return _plan_from_counts(count_tokens_per_expert(expert_indices, num_experts), ep_size, num_local_experts,
                             ep_group)


def resolve_score_apply_mode(spec: MoELayerSpec, config_override: str) -> str:
    """``"pre"`` (scores scale the expert input) or ``"post"`` (they weight the outputs): the
    config's choice, or the family's for ``"auto"``."""
    return spec.score_apply if config_override == "auto" else config_override


def apply_scores_before_experts_if_enabled(routed_input: Tensor, top_scores: Tensor, score_apply: str) -> Tensor:
    """``routed_input [N, H]`` times its route's score (in fp32) for ``"pre"``; unchanged for ``"post"``."""
    if score_apply != "pre":
        return routed_input
    return (routed_input.float() * top_scores.reshape(-1, 1)).to(routed_input.dtype)


def combine_from_routed(expert_output: Tensor, top_scores: Tensor, token_indices_sorted: Tensor, top_k: int,
                        score_apply: str, combine_impl: str, shape: tuple[int, int, int]) -> Tensor:
    """Each token's ``top_k`` expert results back in place and summed (weighted by their scores, in
    fp32, for ``"post"``): ``[B, S, H]``. ``token_indices_sorted[i]`` is the flat route (token * k +
    slot) of ``expert_output[i]``."""
    batch, seq, hidden = shape
    tokens = batch * seq
    slots = expert_output.new_zeros(tokens * top_k, hidden)
    slots[token_indices_sorted] = expert_output
    slots = slots.view(tokens, top_k, hidden)
    if score_apply == "post":
        weights = top_scores.reshape(tokens, 1, top_k).float()
        if combine_impl == "legacy_bmm":
            out = torch.bmm(weights, slots.float()).squeeze(1)
        else:
            out = (slots.float() * weights.transpose(1, 2)).sum(dim=1)
        out = out.to(expert_output.dtype)
    else:
        out = slots.sum(dim=1)
    return out.view(batch, seq, hidden)


def _by_local_expert(by_source: Tensor) -> Tensor:
    """Order that regroups received rows (by source rank, then local expert) by local expert, then source."""
    sources, local = by_source.shape
    flat = by_source.reshape(-1).tolist()
    starts, offset = [], 0
    for count in flat:
        starts.append(offset)
        offset += count
    order = [starts[s * local + j] + i for j in range(local) for s in range(sources)
             for i in range(flat[s * local + j])]
    return torch.tensor(order, dtype=torch.long, device=by_source.device)


def _collector() -> Any:
    """transformers' active output collector (what its ``OutputRecorder`` hooks append to), or None."""
    module = sys.modules.get("transformers.utils.output_capturing")
    holder = getattr(module, "_active_collector", None)
    return holder.get() if holder is not None else None


def _mark(params: Any, **marks: object) -> None:
    for param in params:
        for key, value in marks.items():
            setattr(param, key, value)


class AutoEPMoELayer(nn.Module):
    """A MoE block converted for expert parallelism: ``router`` (:class:`TokenChoiceTopKRouter`
    with the source's gate weights), ``experts`` (:class:`GroupedExperts`, this rank's slice),
    and the source's shared experts when the family has them. ``forward([B, S, H]) -> [B, S, H]``.

    Expert weights are marked as expert parameters (``allreduce=False``, ``group_name=ep_group_name``)
    so ZeRO reduces their gradients over the expert-data-parallel group; for transformers models whose
    router logits the model records (the balancing loss), the layer records its router's logits in
    the same place.
    """

    _is_autoep_layer = True

    def __init__(self, spec: MoELayerSpec, source_module: nn.Module, ep_size: int, ep_rank: int,
                 config: AutoEPConfig) -> None:
        super().__init__()
        if not spec.supports_expert_bias and config.load_balance_coeff is not None:
            raise ValueError(
                f"expert_parallel.load_balance_coeff = {config.load_balance_coeff!r}: the '{spec.model_family}' "
                "family does not support load_balance_coeff/expert_bias; fix: set load_balance_coeff to null"
            )
        if spec.num_experts % ep_size:
            raise ValueError(f"expert_parallel.autoep_size = {ep_size}: layer {spec.moe_module_name!r} has "
                             f"{spec.num_experts} experts; rule: autoep_size divides them; fix: choose a divisor")
        self.model_family, self.top_k = spec.model_family, spec.top_k
        self.num_experts, self.ep_size, self.ep_rank = spec.num_experts, ep_size, ep_rank
        self.num_local_experts = spec.num_experts // ep_size
        self.hidden_size = spec.hidden_size
        self.ep_group_name = f"ep_size_{ep_size}"
        self.ep_group: Group = None
        self.folding_group_handles: Any = None  # FoldingGroupHandles when folded over AutoTP
        self.tp_group: Group = None
        self.tp_size, self.tp_rank = 1, 0
        self.score_apply = resolve_score_apply_mode(spec, config.score_apply)
        self.combine_impl = "weighted_sum" if config.combine_impl == "auto" else config.combine_impl
        self.record_router_logits = spec.router_logits_capture_target == "router"
        self.checkpoint_router_alias = spec.checkpoint_router_alias  # DeepSpeed's second name of the router
        route_norm = spec.route_norm if config.route_norm is None else config.route_norm

        gate = getattr(source_module, spec.router_name)
        self.router = TokenChoiceTopKRouter(spec.hidden_size, spec.num_experts, spec.num_expert_groups,
                                            spec.num_limited_groups, spec.top_k, spec.score_func, route_norm,
                                            spec.route_scale, spec.gate_bias, spec.group_score_func)
        with gathered_source([gate.weight, getattr(gate, "bias", None), getattr(gate, "e_score_correction_bias", None)]):
            # inside, zero.Init placeholders are replaced by their gathered values: read them here
            bias = getattr(gate, "bias", None)
            correction = getattr(gate, "e_score_correction_bias", None)
            self.router.to(device=gate.weight.device, dtype=gate.weight.dtype)
            self.router.gate.weight.data.copy_(gate.weight.detach())
            self.router.gate.weight.requires_grad_(gate.weight.requires_grad)
            if spec.gate_bias and bias is not None:
                self.router.gate.bias.data.copy_(bias.detach())
                self.router.gate.bias.requires_grad_(bias.requires_grad)
            if correction is not None:
                copy = correction.detach().clone()
                if isinstance(correction, nn.Parameter):
                    self.router.e_score_correction_bias = nn.Parameter(copy, requires_grad=correction.requires_grad)
                else:
                    self.router.register_buffer("e_score_correction_bias", copy)

        experts_source = getattr(source_module, spec.experts_name)
        flags = repack_expert_requires_grad_flags(experts_source, spec, ep_rank, ep_size)
        weights = repack_expert_weights(experts_source, spec, ep_rank, ep_size)
        self.experts = GroupedExperts(spec.hidden_size, spec.ffn_hidden_size, self.num_local_experts,
                                      config.use_grouped_mm, spec.expert_activation, config.gate_up_impl)
        for name, tensor, flag in zip(("w1", "w2", "w3"), weights, flags):
            setattr(self.experts, name, nn.Parameter(tensor, requires_grad=flag))
        self.shared_experts = getattr(source_module, spec.shared_experts_name, None) \
            if spec.has_shared_experts and spec.shared_experts_name else None
        self.shared_experts_gate = getattr(source_module, spec.shared_experts_gate_name, None) \
            if spec.has_shared_experts and spec.shared_experts_gate_name else None

        _mark(self.experts.parameters(), allreduce=False, group_name=self.ep_group_name,
              ds_zero_placement_family=EXPERT_FAMILY, ds_zero_partition_group_name=self.ep_group_name)
        shared = [m for m in (self.shared_experts, self.shared_experts_gate) if m is not None]
        _mark([p for m in (self.router, *shared) for p in m.parameters()], allreduce=True,
              ds_zero_placement_family=REPLICATED_FAMILY)

    def set_ep_group(self, group: Group) -> None:
        """The expert-parallel group this layer's all-to-alls run over (None for ``ep_size`` 1)."""
        self.ep_group = group

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False,
                                  folding_group_handles: Any = None) -> None:
        """Bind this layer's groups. With ``folding_group_handles`` (a
        :class:`~shardwise.autoep.folding.FoldingGroupHandles`: AutoEP folded over AutoTP) the layer
        runs over its ``ep_group`` and ``tp_group`` and computes each routed assignment on one TP lane;
        without them it takes the process layout's expert-parallel group."""
        if use_data_before_expert_parallel_:
            raise ValueError("use_data_before_expert_parallel_=True: shardwise's expert groups are runs of "
                             "consecutive ranks of the process layout; fix: leave it False")
        if folding_group_handles is None:
            from shardwise.comm import mesh

            layout = mesh.ensure_layout(ep=self.ep_size, source=f"AutoEPMoELayer(ep_size={self.ep_size})")
            self.set_ep_group(layout.group_of("ep") if self.ep_size > 1 else None)
            return
        tp_size = int(folding_group_handles.spec.tp_size)
        if tp_size > 1 and self.combine_impl == "fused_weighted_sum":
            raise ValueError(f'expert_parallel.combine_impl="fused_weighted_sum" with tensor_parallel.autotp_size='
                             f'{tp_size}: folded layers combine each lane\'s rows themselves; fix: leave '
                             'combine_impl unset (or "weighted_sum")')
        self.folding_group_handles = folding_group_handles
        self.ep_group_name = folding_group_handles.ep_group_name
        self.ep_group = folding_group_handles.ep_group
        self.tp_group = folding_group_handles.tp_group
        self.tp_size = tp_size
        self.tp_rank = list(folding_group_handles.tp_ranks).index(dist.get_rank()) if tp_size > 1 else 0
        ep_rank = dist.get_rank(group=self.ep_group)
        if ep_rank != self.ep_rank:
            raise ValueError(f"AutoEPMoELayer holds the experts of expert-parallel rank {self.ep_rank}, but this rank is "
                             f"{ep_rank} of the folding handles' ep group {folding_group_handles.ep_ranks}; fix: build "
                             "the layer with ep_rank from the same layout (shardwise.autoep.convert does)")

    def experts_over_ranks(self, routed: Tensor, counts: Tensor, selected: Tensor) -> Tensor:
        """Rows ``routed`` (in expert order, ``counts`` per global expert) through their experts over the
        expert-parallel group and back, in the same order."""
        if self.ep_size == 1:
            return self.experts(routed, counts)
        plan = compute_split_plan(selected, self.num_experts, self.ep_size, self.num_local_experts, self.ep_group,
                                  num_tokens_per_expert=counts)
        received = AllToAllV.apply(self.ep_group, routed, plan.input_splits, plan.output_splits)
        order = _by_local_expert(plan.local_counts_by_source)
        computed = self.experts(received[order], plan.local_counts)
        restored = torch.empty_like(computed).index_copy(0, order, computed) if order.numel() else computed
        return AllToAllV.apply(self.ep_group, restored, plan.output_splits, plan.input_splits)

    def forward(self, hidden_states: Tensor) -> Tensor:
        """Route, run the experts over the expert-parallel group, combine; plus shared experts."""
        batch, seq, hidden = hidden_states.shape
        x = hidden_states.reshape(-1, hidden)
        logits = self.router.gate(x)
        if self.record_router_logits:
            collected = _collector()
            if collected is not None and "router_logits" in collected:
                collected["router_logits"].append(logits)
        top_scores, selected, counts = self.router.route(logits)
        if self.tp_size > 1:  # folded over AutoTP: each assignment computed on one lane
            output = folded_routed_output(self, x, top_scores, selected).view(batch, seq, hidden)
        else:
            routes = torch.argsort(selected.reshape(-1), stable=True)  # by expert: by destination, then expert
            routed = apply_scores_before_experts_if_enabled(x[routes // self.top_k],
                                                            top_scores.reshape(-1)[routes], self.score_apply)
            expert_output = self.experts_over_ranks(routed, counts, selected)
            output = combine_from_routed(expert_output, top_scores, routes, self.top_k, self.score_apply,
                                         self.combine_impl, (batch, seq, hidden))
        if self.shared_experts is not None:
            shared = self.shared_experts(hidden_states)
            if self.shared_experts_gate is not None:
                shared = torch.sigmoid(self.shared_experts_gate(hidden_states)) * shared
            output = output + shared
        return output
