"""What the stage 0-2 optimizer (:class:`~shardwise.zero.sharded_optimizer.ZeroOptimizer`) needs
from the config, decided once by :func:`shardwise.zero.factory.build_zero_optimizer`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from shardwise.comm.group_type import Group
from shardwise.zero.param_publish import PublishPolicy
from shardwise.zero.reduction_domain import DATA, ExpertLayout, ReductionDomain

__all__ = ["ZeroPolicy"]


@dataclass(frozen=True)
class ZeroPolicy:
    """What the sharded optimizer needs from the config, decided once."""

    stage: int
    rank: int
    world_size: int
    bucket_numel: int
    overlap_comm: bool
    grad_dtype: torch.dtype
    comm_dtype: torch.dtype | None
    pre_multiplier: float
    post_divisor: float
    check_overflow: bool
    gradient_clipping: float
    process_group: Group = None
    mp_group: Group = None  # with mp_size > 1, None is the world (tensor parallel over every rank)
    mp_rank: int = 0
    mp_size: int = 1
    publish: PublishPolicy = field(default_factory=PublishPolicy)
    all_reduce_gradients: bool = False  # reduce_scatter: false (stages 1-2): all-reduce, then slice
    fail_on_unused: bool = False  # ignore_unused_parameters: false
    param_names: Mapping[int, str] | None = None  # id(parameter) -> name, for the unused-parameter error
    experts: ExpertLayout | None = None  # the expert groups, when the model has expert parameters

    def data_domain(self) -> ReductionDomain:
        """The domain of dense parameters: the data-parallel group."""
        return ReductionDomain(DATA, self.process_group, self.rank, self.world_size)
