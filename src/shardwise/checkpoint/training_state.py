"""What a checkpoint covers (:class:`TrainingState`) and what a load gives back (:class:`LoadResult`).

Shared by the checkpointer and the DeepSpeed importer, which both restore a training state.
Besides the module and the optimizer (which have their own DCP adapters), a run's state is a
set of named :class:`StatePart` s (torchtitan's ``states={...}`` shape): the counters, the LR
scheduler, the loss scaler, the step hooks and the data loader, each a ``Stateful`` saved
under its name and restored by the one loop in :func:`restore_parts`.

Example:
    >>> from shardwise.runtime.counters import EngineCounters
    >>> counters = EngineCounters()
    >>> parts = {"counters": StatePart(counters)}
    >>> restore_parts(parts, {"counters": {"global_steps": 7}}, None, with_optimizer=True, with_scheduler=True)
    >>> counters.global_steps
    7
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import nn

from shardwise.checkpoint.optimizer_state import OptimizerState
from shardwise.comm.group_type import Group
from shardwise.moe.naming import global_expert_names

if TYPE_CHECKING:
    from shardwise.checkpoint.folded_files import FoldedRun


@runtime_checkable
class Stateful(Protocol):
    """What a checkpoint part is: ``state_dict()`` and ``load_state_dict(state)`` (torch's protocol)."""

    def state_dict(self) -> Any:
        """Picklable plain values that restore the object."""
        ...

    def load_state_dict(self, state: object) -> None:
        """Restore what :meth:`state_dict` returned."""
        ...


class Restore(enum.Enum):
    """Which loads restore a part (a load with ``load_module_only`` restores none)."""

    ALWAYS = "always"
    WITH_OPTIMIZER = "load_optimizer_states"
    WITH_SCHEDULER = "load_lr_scheduler_states"


@dataclass(frozen=True)
class StatePart:
    """One named piece of a run's state.

    Attributes:
        stateful: the object saved and restored.
        restore: which loads restore it.
        per_rank: saved under this rank's entry (a data loader's position) instead of the
            common one (rank 0's, the same on every rank).
    """

    stateful: Stateful
    restore: Restore = Restore.ALWAYS
    per_rank: bool = False


COMMON_PARTS: dict[str, object] = {"counters": {}, "lr_scheduler": None, "loss_scaler": None, "step_hooks": {}}
"""The common entry's part names and what the format writes for a run without that part."""
RANK_PARTS: dict[str, object] = {"data_loader": None}
"""The per-rank entry's part names, likewise."""


def saved_parts(parts: Mapping[str, StatePart]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(common, per_rank)``: every part's ``state_dict()`` under its name, over the format's defaults."""
    common, per_rank = dict(COMMON_PARTS), dict(RANK_PARTS)
    for name, part in parts.items():
        (per_rank if part.per_rank else common)[name] = part.stateful.state_dict()
    return common, per_rank


def restore_parts(
    parts: Mapping[str, StatePart],
    common: Mapping[str, object],
    per_rank: Mapping[str, object] | None,
    *,
    with_optimizer: bool,
    with_scheduler: bool,
) -> None:
    """Restore every part the load asks for from its saved entry; a part the checkpoint has no
    entry for (an older format, a DeepSpeed checkpoint) keeps its state."""
    wanted = {
        Restore.ALWAYS: True,
        Restore.WITH_OPTIMIZER: with_optimizer,
        Restore.WITH_SCHEDULER: with_scheduler,
    }
    for name, part in parts.items():
        saved = (per_rank or {}) if part.per_rank else common
        if wanted[part.restore] and saved.get(name) is not None:
            part.stateful.load_state_dict(saved[name])


@dataclass
class TrainingState:
    """The parts of a run a checkpoint covers.

    Attributes:
        module: the model (parameters, frozen parameters and buffers).
        optimizer: the optimizer's checkpoint interface
            (:class:`~shardwise.checkpoint.optimizer_state.OptimizerState`, built from the
            strategy's ``state_layout()``: see :func:`~shardwise.checkpoint.engine_io.optimizer_state`);
            None for none.
        parts: the run's other state by name (``counters``, ``lr_scheduler``, ``loss_scaler``,
            ``step_hooks``, ``data_loader``): only the parts this run has.
        zero_stage, dp_world_size, mp_rank, mp_world_size: the layout, recorded in the summary.
        pending_micro_batches: micro batches whose gradients are accumulated but not yet applied
            (a save then warns: those gradients are not saved).
        ds_config: the resolved config, saved for reference.
        process_group: group for DCP and the collectives (None: the world).
        folding: this rank's place in a folded AutoEP + AutoTP layout (None: not folded); such a
            save records the layout and such a load checks it (:mod:`~shardwise.checkpoint.folded_files`).
    """

    module: nn.Module
    optimizer: OptimizerState | None = None
    parts: dict[str, StatePart] = field(default_factory=dict)
    zero_stage: int = 0
    dp_world_size: int = 1
    mp_rank: int = 0
    mp_world_size: int = 1
    gradient_accumulation_steps: int = 1
    pending_micro_batches: int = 0
    ds_config: dict[str, object] = field(default_factory=dict)
    process_group: Group = None
    folding: FoldedRun | None = None

    @property
    def counters(self) -> dict[str, int]:
        """The counters' current values (``{}`` without a ``counters`` part)."""
        part = self.parts.get("counters")
        return {} if part is None else dict(part.stateful.state_dict())


@dataclass
class LoadResult:
    """What a load restored: where from, the client state, and the counters to apply."""

    path: Path
    client_state: dict[str, object]
    counters: dict[str, int]


def param_names(module: nn.Module) -> dict[int, str]:
    """``id(param) -> name`` (tied parameters get their first name); expert parameters by their
    global expert index (:func:`shardwise.moe.naming.global_expert_names`)."""
    renames = global_expert_names(module)
    return {id(p): renames.get(name, name) for name, p in module.named_parameters()}


def module_state_dict(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` under checkpoint names: expert tensors by their global expert index,
    so a run with another expert-parallel size finds them."""
    renames = global_expert_names(module)
    return {renames.get(key, key): value for key, value in module.state_dict().items()}


def checkpoint_name(module: nn.Module) -> Callable[[str], str]:
    """The checkpoint name of any of ``module``'s parameter or buffer names."""
    renames = global_expert_names(module)
    return lambda name: renames.get(name, name)
