"""Where an optimizer's fp32 values and state sit, per module parameter: a description for checkpoints.

Every ZeRO strategy answers ``state_layout()`` with a :class:`StateLayout`: plain tensors and
the torch optimizer that keeps state for them, nothing about files. The checkpoint package
(:mod:`shardwise.checkpoint.optimizer_state`) turns a layout into the checkpoint format, so
``zero/`` never imports ``checkpoint/``.

A parameter's fp32 values are held by the optimizer's tensors in one of three ways
(:class:`Holding`), each either a *separate master* (an fp32 copy of a 16-bit parameter) or
the parameter's own storage:

==================  ====================================================================
``FLAT``            ranges of flat tensors (stages 0-2): :class:`FlatPiece` s, possibly none
                    on this rank
``LOCAL_SHARD``     the optimizer's tensor is this rank's local shard of a DTensor parameter
                    (stage 3)
``WHOLE``           the optimizer's tensor has the parameter's full shape (stage 3's unsharded
                    parameters, a plain torch optimizer)
==================  ====================================================================

Element-wise optimizer state (``exp_avg``...) of an optimizer tensor has that tensor's shape,
so the same pieces locate it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.comm.group_type import Group


class Holding(enum.Enum):
    """How the optimizer's tensors hold a parameter's values (see the module docstring)."""

    FLAT = "flat"
    LOCAL_SHARD = "local_shard"
    WHOLE = "whole"


@dataclass(frozen=True)
class FlatPiece:
    """Flattened elements ``[start, stop)`` of a parameter are ``tensor.view(-1)[offset : offset + stop - start]``.

    ``tensor`` is one the optimizer steps (its state is keyed by it).

    Example:
        >>> flat = torch.arange(10.0)
        >>> FlatPiece(2, 5, flat, 6).take().tolist()
        [6.0, 7.0, 8.0]
    """

    start: int
    stop: int
    tensor: torch.Tensor
    offset: int

    def take(self, like: torch.Tensor | None = None) -> torch.Tensor:
        """This piece's 1-D view of ``tensor``, or of ``like`` (a tensor shaped like it: its state)."""
        source = self.tensor if like is None else like
        return source.view(-1)[self.offset : self.offset + self.stop - self.start]


@dataclass(frozen=True)
class ParamPlace:
    """Where one module parameter's fp32 values sit on this rank.

    Attributes:
        param: the module's parameter object (a DTensor where FSDP2 shards it).
        shape: its global shape.
        holding: how the optimizer's tensors hold it.
        separate_master: the values are an fp32 copy (saved as ``master/<name>``), not the
            parameter's own storage (whose value the module saves as ``model/<name>``).
        pieces: ``FLAT`` only: this rank's pieces, in flat order (empty: none here).
        tensor: ``LOCAL_SHARD``/``WHOLE`` only: the optimizer's tensor for it.
        split_over: ``(group, partitioned)`` where its pieces are split over other ranks than the
            layout's (expert parameters: the expert-data-parallel group); None: the layout's.
    """

    param: Any
    shape: tuple[int, ...]
    holding: Holding
    separate_master: bool
    pieces: tuple[FlatPiece, ...] = ()
    tensor: torch.Tensor | None = None
    split_over: tuple[Any, bool] | None = None

    def __post_init__(self) -> None:
        flat = self.holding is Holding.FLAT
        if flat == (self.tensor is not None) or (self.pieces and not flat):
            raise ValueError(f"a {self.holding.name} place takes {'pieces' if flat else 'one tensor'} only")

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The optimizer tensors holding part of this parameter here."""
        return [piece.tensor for piece in self.pieces] if self.tensor is None else [self.tensor]


@dataclass(frozen=True)
class StateLayout:
    """An optimizer's fp32 values and state, per parameter, as they sit now.

    A snapshot: describe again after the optimizer steps or loads (offloaded state is read
    when first used).

    Attributes:
        optimizer: the torch optimizer keyed by the places' tensors (``param_groups``, ``state``,
            ``load_state_dict``); for offloaded optimizers a view keyed by the device masters.
        optimizer_name: the class name of the optimizer the strategy runs (for the checkpoint summary).
        places: one per trainable parameter.
        groups: per param group of ``optimizer``, the indices into ``places`` of its parameters.
        params_from_masters: make the module's parameters follow their (just written) fp32
            values; collective where the values are partitioned.
        masters_from_params: re-read the fp32 values from the (just written) parameters.
        device: where whole tensors are assembled from ``FLAT`` pieces.
        process_group: the ranks among which ``FLAT`` pieces are partitioned.
        partitioned: ``FLAT`` pieces are disjoint across ``process_group`` (whole tensors are
            then summed over it); False where every rank holds every piece.
        rank_state: state each rank holds for itself, saved per rank (``rank_state_dict()`` /
            ``load_rank_state_dict(state or None)``): the 1-bit optimizers' error buffers; None: none.
    """

    optimizer: Any
    optimizer_name: str
    places: tuple[ParamPlace, ...]
    groups: tuple[tuple[int, ...], ...]
    params_from_masters: Callable[[], None]
    masters_from_params: Callable[[], None]
    device: torch.device
    process_group: Group = None
    partitioned: bool = False
    rank_state: Any = None


@dataclass(frozen=True)
class GradientLayout:
    """Where each trained parameter's reduced gradient sits now, in the holdings of :class:`ParamPlace`.

    The places point into the strategy's gradient accumulators (``FLAT`` pieces of the flat
    gradients at stages 0-2; the local gradient shard, or the whole gradient of an unsharded
    parameter, at stage 3); writing there changes what the next step uses.

    Attributes:
        places: one per trainable parameter (``separate_master`` is always False).
        mean_divisor: the held values divided by it are the average over the data-parallel ranks
            (still multiplied by the fp16 loss scale, as DeepSpeed's are).
        process_group: the ranks among which ``FLAT`` pieces are partitioned.
        partitioned: ``FLAT`` pieces are disjoint across ``process_group``.
        unavailable: why no reduced gradient is held now; empty when one is.
    """

    places: tuple[ParamPlace, ...]
    mean_divisor: float
    process_group: Group = None
    partitioned: bool = False
    unavailable: str = ""


GRADIENTS_UNAVAILABLE = (
    "reduced gradients are only available after a backward that reduced them (every backward at "
    "stages 2-3, the accumulation boundary's at stages 0-1) and before the optimizer step"
)
"""The :attr:`GradientLayout.unavailable` message (DeepSpeed's rule, with shardwise's stages)."""
