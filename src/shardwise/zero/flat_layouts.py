"""Stages 0-2's state as the checkpoint and parameter-access code reads it (a mixin of
:class:`~shardwise.zero.sharded_optimizer.ZeroOptimizer`).

:meth:`FlatLayouts.state_layout` says where each parameter's fp32 values and optimizer state sit
(ranges of the flat masters), :meth:`FlatLayouts.gradient_layout` where its reduced gradient
sits (the same ranges of the flat gradients) (:mod:`shardwise.zero.state_layout`).
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from shardwise.optim.exchanging import GradientExchangingOptimizer
from shardwise.zero.flat_group import FlatGroup
from shardwise.zero.offloaded_optimizer import checkpoint_view
from shardwise.zero.reducer_set import ReducerSet
from shardwise.zero.reduction_domain import ReductionDomain, split_over
from shardwise.zero.sharded_optimizer_policy import ZeroPolicy
from shardwise.zero.state_layout import (
    GRADIENTS_UNAVAILABLE,
    FlatPiece,
    GradientLayout,
    Holding,
    ParamPlace,
    StateLayout,
)

__all__ = ["FlatLayouts"]


class FlatLayouts:
    """The layouts of a stage 0-2 optimizer's flat state (mixed into ``ZeroOptimizer``, which owns
    the attributes declared here and the gather and publish methods)."""

    policy: ZeroPolicy
    optimizer: torch.optim.Optimizer
    groups: list[FlatGroup]
    group_index: list[int]
    domains: list[ReductionDomain]
    exchanging: GradientExchangingOptimizer | None
    reducer: ReducerSet
    mean_divisor: float

    @abstractmethod
    def wait_for_parameters(self) -> None:
        """Wait for parameter gathers left in flight."""

    @abstractmethod
    def _publish_parameters(self) -> None:
        """Copy the fp32 masters into the parameters and gather them."""

    # ------------------------------------------------------------------ checkpoint state
    def state_layout(self) -> StateLayout:
        """Where each parameter's fp32 values and optimizer state sit: ranges of the flat masters
        (``shardwise.checkpoint.optimizer_state`` turns this into the checkpoint format)."""
        self.wait_for_parameters()
        places: list[ParamPlace] = []
        members: list[list[int]] = [[] for _ in self.optimizer.param_groups]
        for flat, gi, domain in zip(self.groups, self.group_index, self.domains):
            for index, param in enumerate(flat.params):
                pieces = tuple(FlatPiece(s, e, flat.master[m], o) for s, e, m, o in flat.master_pieces(index))
                members[gi].append(len(places))
                separate = flat.dtype != torch.float32
                split = split_over(domain, self.policy.stage)
                places.append(
                    ParamPlace(param, tuple(param.shape), Holding.FLAT, separate, pieces=pieces, split_over=split)
                )
        return StateLayout(
            optimizer=checkpoint_view(self.optimizer),
            optimizer_name=type(self.optimizer).__name__,
            places=tuple(places),
            groups=tuple(tuple(m) for m in members),
            params_from_masters=self._publish_parameters,
            masters_from_params=self._refresh_masters,
            device=self.groups[0].device if self.groups else torch.device("cpu"),
            process_group=self.policy.process_group,
            partitioned=self.policy.stage >= 1 and self.policy.world_size > 1,
            rank_state=self.exchanging,
        )

    def gradient_layout(self) -> GradientLayout:
        """Where each parameter's reduced gradient sits: the same ranges of the flat gradients as
        its fp32 values of the masters; available after a reducing backward, until the step."""
        self.wait_for_parameters()
        places = []
        for flat, domain in zip(self.groups, self.domains):
            for index, param in enumerate(flat.params):
                pieces = tuple(FlatPiece(s, e, flat.grad[m], o) for s, e, m, o in flat.master_pieces(index))
                split = split_over(domain, self.policy.stage)
                places.append(
                    ParamPlace(param, tuple(param.shape), Holding.FLAT, False, pieces=pieces, split_over=split)
                )
        return GradientLayout(
            places=tuple(places),
            mean_divisor=self.mean_divisor,
            process_group=self.policy.process_group,
            partitioned=self.policy.stage >= 1 and self.policy.world_size > 1,
            unavailable="" if self.reducer.gradients_ready else GRADIENTS_UNAVAILABLE,
        )

    def _refresh_masters(self) -> None:
        """Re-read the fp32 masters from the (just loaded) parameters: weights-only loads."""
        for flat in self.groups:
            flat.refresh_masters()
