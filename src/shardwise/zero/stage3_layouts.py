"""Stage 3's state as the checkpoint and parameter-access code reads it (a mixin of
:class:`~shardwise.zero.stage3.Stage3Optimizer`).

:meth:`Stage3Layouts.state_layout` says where each parameter's fp32 values and optimizer state
sit, :meth:`Stage3Layouts.gradient_layout` where its reduced gradient sits
(:mod:`shardwise.zero.state_layout`), and :meth:`Stage3Layouts.full_fp32_parameters` gathers
every parameter's full fp32 value for saving.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import nn

from shardwise.comm.group_type import Group
from shardwise.zero.expert_units import is_expert
from shardwise.zero.offloaded_optimizer import checkpoint_view
from shardwise.zero.replicated import ReplicatedParams
from shardwise.zero.sharded_model import ShardedModel
from shardwise.zero.stage3_policy import Stage3Policy
from shardwise.zero.state_layout import (
    GRADIENTS_UNAVAILABLE,
    GradientLayout,
    Holding,
    ParamPlace,
    StateLayout,
)

__all__ = ["Stage3Layouts"]


class Stage3Layouts:
    """The layouts of a stage-3 optimizer's state (mixed into ``Stage3Optimizer``, which owns the
    attributes declared here and the two gradient and shard methods)."""

    record: ShardedModel
    policy: Stage3Policy
    optimizer: torch.optim.Optimizer
    sharded: list[nn.Parameter]
    masters: list[torch.Tensor]
    replicated: ReplicatedParams
    mean_divisor: float
    _acc: dict[int, torch.Tensor]
    _grads_ready: bool

    @abstractmethod
    def _rebind_masters(self) -> None:
        """Follow FSDP2 if it replaced a shard's storage."""

    @abstractmethod
    def _collect_grads(self) -> None:
        """Move this window's shard gradients into their accumulators."""

    # ------------------------------------------------------------------ checkpoints
    def state_layout(self) -> StateLayout:
        """Where each parameter's fp32 values and optimizer state sit: sharded parameters' masters
        are their DTensors' local shards (the values are saved with the module as ``model/<name>``);
        unsharded parameters' fp32 masters are whole tensors, separate where they are copies."""
        self.record.ensure_resident()
        self._rebind_masters()
        optimizer = checkpoint_view(self.optimizer)
        sharded = {id(m): p for p, m in zip(self.sharded, self.masters)}
        replicated = {id(m): p for p, m in zip(self.replicated.params, self.replicated.masters)}
        places: list[ParamPlace] = []
        groups: list[tuple[int, ...]] = []
        for group in optimizer.param_groups:
            groups.append(tuple(range(len(places), len(places) + len(group["params"]))))
            for tensor in group["params"]:
                if id(tensor) in sharded:
                    param, holding, separate = sharded[id(tensor)], Holding.LOCAL_SHARD, False
                else:
                    param = replicated[id(tensor)]
                    holding, separate = Holding.WHOLE, tensor.data_ptr() != param.data_ptr()
                places.append(
                    ParamPlace(param, tuple(param.shape), holding, separate, tensor=tensor, split_over=self._split(param))
                )
        return StateLayout(
            optimizer=optimizer,
            optimizer_name=type(self.optimizer).__name__,
            places=tuple(places),
            groups=tuple(groups),
            params_from_masters=self.replicated.publish,
            masters_from_params=self.replicated.refresh_masters,
            device=self.masters[0].device if self.masters else self.record.policy.device,
            process_group=self.policy.process_group,
        )

    def _split(self, param: nn.Parameter) -> tuple[Group, bool] | None:
        """Where an expert parameter is sharded with expert parallelism (its expert-data-parallel group,
        and whether over more than one rank); None for the others (the data-parallel group's)."""
        experts = self.record.policy.experts
        if experts is None or not is_expert(param):
            return None
        return experts.group, experts.size > 1

    def gradient_layout(self) -> GradientLayout:
        """Where each parameter's reduced gradient sits: the local fp32 shard accumulators of the
        sharded parameters, the whole accumulators of the unsharded ones (zeros are installed for a
        parameter that got no gradient, so a write there reaches the step)."""
        self._collect_grads()
        places = []
        if self._grads_ready:
            for param, master in zip(self.sharded, self.masters):
                acc = self._acc.setdefault(id(param), torch.zeros_like(master))
                places.append(
                    ParamPlace(param, tuple(param.shape), Holding.LOCAL_SHARD, False, tensor=acc,
                               split_over=self._split(param))
                )
            self.replicated.bind_grads()
            for param, held in zip(self.replicated.params, self.replicated.accumulators):
                places.append(ParamPlace(param, tuple(param.shape), Holding.WHOLE, False, tensor=held))
        return GradientLayout(
            places=tuple(places),
            mean_divisor=self.mean_divisor,
            process_group=self.policy.process_group,
            unavailable="" if self._grads_ready else GRADIENTS_UNAVAILABLE,
        )

    # ------------------------------------------------------------------ saving
    def full_fp32_parameters(self) -> list[torch.Tensor]:
        """Every parameter's full fp32 value (the masters where there are), in
        ``module.parameters()`` order. Collective: every rank must call it."""
        self.record.ensure_resident()
        out = []
        for param in self.record.module.parameters():
            if hasattr(param, "full_tensor"):
                out.append(param.detach().full_tensor().float().clone())  # type: ignore[attr-defined]
                continue
            master = self.replicated.master_of(param)
            out.append((master if master is not None else param.detach()).float().clone())
        return out
