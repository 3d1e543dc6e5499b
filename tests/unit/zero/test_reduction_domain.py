"""Which group a parameter's gradient reduces over (zero/reduction_domain.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.zero.reduction_domain import DATA, ExpertLayout, ReductionDomain, domain_of, expert_group_name

DATA_DOMAIN = ReductionDomain(DATA, None, 1, 4)


def _expert(group_name: str = "ep_size_2") -> nn.Parameter:
    p = nn.Parameter(torch.zeros(3))
    p.allreduce = False  # type: ignore[attr-defined]
    p.group_name = group_name  # type: ignore[attr-defined]
    return p


def test_dense_parameters_reduce_over_data_parallel() -> None:
    dense = nn.Parameter(torch.zeros(2))
    assert expert_group_name(dense) is None
    assert domain_of(dense, DATA_DOMAIN, None) is DATA_DOMAIN


def test_expert_parameters_reduce_over_expert_data_parallel() -> None:
    layout = ExpertLayout(ep_group=None, ep_size=2, edp_group=None, edp_rank=1, edp_size=2)
    domain = domain_of(_expert(), DATA_DOMAIN, layout)
    assert (domain.name, domain.rank, domain.world_size, domain.spread_size) == ("ep_size_2", 1, 2, 2)


def test_experts_without_expert_parallelism_are_dense() -> None:
    layout = ExpertLayout(ep_group=None, ep_size=1, edp_group=None, edp_rank=1, edp_size=4)
    assert domain_of(_expert("ep_size_1"), DATA_DOMAIN, layout) is DATA_DOMAIN


def test_mismatched_or_missing_expert_layout_is_refused() -> None:
    layout = ExpertLayout(ep_group=None, ep_size=4, edp_group=None, edp_rank=0, edp_size=1)
    with pytest.raises(ValueError, match="expert-parallel size is 4"):
        domain_of(_expert("ep_size_2"), DATA_DOMAIN, layout)
    with pytest.raises(ValueError, match="no expert-parallel layout"):
        domain_of(_expert(), DATA_DOMAIN, None)
