"""Which process group a parameter's gradient is reduced over: the one place that decides it.

Dense parameters are replicated over the data-parallel ranks: their gradients are summed over the
data-parallel group and their optimizer state sharded over it (the ``"data"`` domain). Expert
parameters (a mixture-of-experts layer's, marked with DeepSpeed's public ``allreduce = False`` and
``group_name``) are replicated only over the expert-data-parallel group (``"edp"``): each rank of an
expert-parallel group holds other experts, so their gradients are summed over ``edp`` only, and
their state sharded over it. ``ExpertLayout`` says what those groups are on this rank.

Scaling (DeepSpeed's convention, ``engine._reduce_expert_gradients``): both domains divide the sum
by the same data-parallel world size. An expert's gradient on its owner already sums the
contributions of the tokens of every rank of its expert-parallel group (the all-to-all's backward
brings them), so summing over ``edp`` and dividing by the whole data-parallel size gives the mean
over all ranks' tokens: the gradient of an ``ep_size=1`` run, whatever ``ep_size`` is.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.comm.group_type import Group

DATA = "data"


def expert_group_name(param: torch.Tensor) -> str | None:
    """The expert-parallel group name of an expert parameter, None for a dense one."""
    if getattr(param, "allreduce", True) is not False:
        return None
    return str(getattr(param, "group_name", None) or "experts")


@dataclass(frozen=True)
class ReductionDomain:
    """The ranks a set of parameters is replicated over: ``group`` (None: the world, or nothing to
    reduce when ``world_size == 1``), this rank's ``rank`` in it, and ``spread_group``: the group over
    which ranks hold *different* parameters of this domain (the expert-parallel group; None for
    dense parameters), whose partial gradient norms add up. ``spans_model_parallel``: the spread group
    crosses the tensor-parallel lanes (AutoEP folded over AutoTP), so each lane holds other parameters
    of the domain and its norm is whole after the spread sum (not counted on one lane and summed over
    the lanes as replicated parameters are)."""

    name: str
    group: Group
    rank: int
    world_size: int
    spread_group: Group = None
    spread_size: int = 1
    spans_model_parallel: bool = False


@dataclass(frozen=True)
class ExpertLayout:
    """The expert groups of this rank (from the process layout: ``"ep"`` and ``"edp"``); with
    ``ep_size == 1`` expert parameters are replicated like dense ones (the data domain)."""

    ep_group: Group
    ep_size: int
    edp_group: Group
    edp_rank: int
    edp_size: int
    spans_model_parallel: bool = False  # expert groups across the tensor-parallel lanes (folded)


def domain_of(param: torch.Tensor, data: ReductionDomain, experts: ExpertLayout | None) -> ReductionDomain:
    """The domain ``param``'s gradient is reduced over; an expert parameter without an expert
    layout is refused (it would be averaged with other ranks' different experts)."""
    name = expert_group_name(param)
    if name is None:
        return data
    declared = re.fullmatch(r"ep_size_(\d+)", name)
    if experts is not None and declared is not None and int(declared.group(1)) != experts.ep_size:
        raise ValueError(
            f"an expert parameter of group {name!r} (shape {tuple(param.shape)}) but the process layout's "
            f"expert-parallel size is {experts.ep_size}: its gradient would be reduced over the wrong ranks; "
            "fix: give every MoE layer the same ep_size and build them before shardwise.initialize"
        )
    if experts is not None and experts.ep_size == 1:
        return data  # every rank holds every expert: replicated like dense parameters
    if experts is None:
        raise ValueError(
            f"an expert parameter (group_name={name!r}, shape {tuple(param.shape)}) but no expert-parallel "
            "layout: its gradient would be averaged with other ranks' experts; fix: build the model's MoE "
            "layers before shardwise.initialize (it declares ep from them), or call "
            "shardwise.comm.mesh.ensure_layout(ep=...) first"
        )
    return ReductionDomain(
        name=name,
        group=experts.edp_group,
        rank=experts.edp_rank,
        world_size=experts.edp_size,
        spread_group=experts.ep_group,
        spread_size=experts.ep_size,
        spans_model_parallel=experts.spans_model_parallel,
    )


ParamKind = tuple[torch.dtype, torch.device, bool, ReductionDomain]


def split_by_kind(
    params: Sequence[nn.Parameter], data: ReductionDomain, experts: ExpertLayout | None
) -> dict[ParamKind, list[nn.Parameter]]:
    """Parameters by (dtype, device, tensor-parallel flag, reduction domain): one flat buffer each."""
    out: dict[ParamKind, list[nn.Parameter]] = {}
    for p in params:
        is_tp = bool(getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False))
        out.setdefault((p.dtype, p.device, is_tp, domain_of(p, data, experts)), []).append(p)
    return out


def distinct(domains: Iterable[ReductionDomain]) -> dict[str, ReductionDomain]:
    """Each domain once by name, in first-seen order (the same on every rank)."""
    return {d.name: d for d in domains}


def split_over(domain: ReductionDomain, stage: int) -> tuple[Group, bool] | None:
    """Where an expert parameter's optimizer pieces are split: its expert-data-parallel group, and
    whether they are (stages 1-2 over more than one rank); None for dense parameters (the layout's)."""
    if domain.name == DATA:
        return None
    return domain.group, stage >= 1 and domain.world_size > 1


def refuse_experts(domains: Iterable[ReductionDomain], what: str) -> None:
    """Expert parameters cannot go with ``what`` (an optimizer that averages over the data-parallel group)."""
    experts = sorted({d.name for d in domains if d.name != DATA})
    if experts:
        raise ValueError(
            f"{what} with expert parameters (groups {experts}): it averages gradients over the "
            "whole data-parallel group, but each expert-parallel rank holds other experts; fix: use "
            "another optimizer (Adam, AdamW, ...) for a mixture-of-experts model"
        )
