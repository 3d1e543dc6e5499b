"""What a checkpoint covers (:class:`TrainingState`) and what a load gives back (:class:`LoadResult`).

Shared by the checkpointer and the DeepSpeed importer, which both restore a training state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from shardwise.checkpoint.optimizer_state import OptimizerState
from shardwise.comm.group_type import Group


@dataclass
class TrainingState:
    """The parts of a run a checkpoint covers.

    Attributes:
        module: the model (parameters, frozen parameters and buffers).
        optimizer: the optimizer's checkpoint interface
            (:class:`~shardwise.checkpoint.optimizer_state.OptimizerState`, built from the
            strategy's ``state_layout()``: see :func:`~shardwise.checkpoint.engine_io.optimizer_state`);
            None for none.
        lr_scheduler: anything with ``state_dict``/``load_state_dict``, or None.
        loss_scaler: the precision policy's scaler, or None.
        data_loader: a Stateful loader, or None.
        counters: ``global_steps``, ``global_samples``, ``skipped_steps``, ``micro_steps``.
        step_hooks: the engine's step hooks (``Stateful``: one state per hook name), or None.
        zero_stage, dp_world_size, mp_rank, mp_world_size: the layout, recorded in the summary.
        pending_micro_batches: micro batches whose gradients are accumulated but not yet applied
            (a save then warns: those gradients are not saved).
        ds_config: the resolved config, saved for reference.
        process_group: group for DCP and the collectives (None: the world).
    """

    module: nn.Module
    optimizer: OptimizerState | None = None
    lr_scheduler: Any = None
    loss_scaler: Any = None
    data_loader: Any = None
    counters: dict[str, int] = field(default_factory=dict)
    step_hooks: Any = None
    zero_stage: int = 0
    dp_world_size: int = 1
    mp_rank: int = 0
    mp_world_size: int = 1
    gradient_accumulation_steps: int = 1
    pending_micro_batches: int = 0
    ds_config: dict[str, Any] = field(default_factory=dict)
    process_group: Group = None


@dataclass
class LoadResult:
    """What a load restored: where from, the client state, and the counters to apply."""

    path: Path
    client_state: dict[str, Any]
    counters: dict[str, int]


def param_names(module: nn.Module) -> dict[int, str]:
    """``id(param) -> name`` (tied parameters get their first name)."""
    return {id(p): name for name, p in module.named_parameters()}
