"""DeepSpeed's ``deepspeed.utils.safe_get_full_*`` / ``safe_set_full_*`` / ``*_local_*`` on shardwise.

From a bare model parameter these read or write its fp32 value, its element-wise optimizer state
(``exp_avg``...) and its reduced gradient, wherever the ZeRO strategy keeps them: ranges of flat
buffers at stages 0-2, DTensor shards and unsharded masters at stage 3. The strategy that trains
the parameter is found through :func:`shardwise.zero.param_owner.owner_of`; where the values sit is
what it describes in :meth:`~shardwise.zero.strategy.ZeroStrategy.state_layout` and
:meth:`~shardwise.zero.strategy.ZeroStrategy.gradient_layout`.

Rules, as in DeepSpeed:

- the ``full`` getters are **collective**: every data-parallel rank must call them, for the same
  parameters in the same order (they assemble the value from every rank's part); they return a
  new fp32 tensor shaped like the parameter, or None for a parameter no strategy trains (frozen);
- the ``full`` setters take the whole value on every rank and write each rank's own part (no
  communication; call them on every rank with the same value). Writing the fp32 value also
  updates the module's parameter, so the next forward and the next step both use it;
- gradients exist after a backward that reduced them and until the step (stages 0-1: the
  accumulation boundary's backward; stages 2-3: every backward); they are the average over the
  ranks, still multiplied by the fp16 loss scale. Otherwise the gradient functions raise
  ``ValueError``. Unlike DeepSpeed, ``param.grad`` is never returned instead: shardwise keeps
  gradients in its own buffers;
- the ``local`` functions are for stage-3 parameters (this rank's shard; an unsharded parameter's
  whole value); on a stage 0-2 parameter they raise ``ValueError`` naming the ``full`` function.
- setters on a parameter no strategy trains raise ``ValueError`` (DeepSpeed ignores the write).

Example:
    >>> import torch
    >>> safe_get_full_fp32_param(torch.nn.Linear(2, 2).weight) is None
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from shardwise.comm import collectives
from shardwise.comm.group_type import Group
from shardwise.zero.param_owner import owner_of
from shardwise.zero.sharded_model import record_of
from shardwise.zero.state_layout import GradientLayout, Holding, ParamPlace, StateLayout

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
]

Pick = Callable[
    [torch.Tensor], torch.Tensor
]  # a place's tensor -> the tensor to read/write (itself or its state)


# ---------------------------------------------------------------------------------------- public: full
def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The full fp32 value of ``param`` (its master where it has one). Collective: every rank calls it."""
    found = _state_place(param)
    return (
        None
        if found is None
        else _gather(found[1], lambda t: t, *_split_over(found[0], found[1]))
    )


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The full fp32 optimizer state ``optim_state_key`` (e.g. ``"exp_avg"``) of ``param``.
    Collective: every rank calls it."""
    found = _state_place(param)
    if found is None:
        return None
    layout, place = found
    pick = _state_picker(layout, optim_state_key)
    return _gather(place, pick, *_split_over(layout, place))


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The full reduced gradient of ``param`` in fp32 (the average over ranks). Collective: every rank calls it.

    Raises:
        ValueError: no reduced gradient is held now (see the module docstring).
    """
    found = _grad_place(param)
    if found is None:
        return None
    layout, place = found
    full = _gather(place, lambda t: t, *_split_over(layout, place))
    return full.div_(layout.mean_divisor)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write the full fp32 value of ``param`` (its master, and the module's parameter). Call it on every
    rank with the same ``value``; each rank writes its own part."""
    _, place = _owned(_state_place(param), param)
    _scatter(place, lambda t: t, _checked(place, value))
    if place.holding is Holding.FLAT or place.separate_master:
        # stages 0-2 (and unsharded stage-3 parameters): every rank holds the module's parameter whole,
        # so every rank writes all of it, also the parts whose masters other ranks keep
        with torch.no_grad():
            place.param.data.copy_(value.reshape(place.shape))


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Write the full optimizer state ``optim_state_key`` of ``param``. Call it on every rank with the same
    ``value``; each rank writes its own part."""
    layout, place = _owned(_state_place(param), param)
    _scatter(place, _state_picker(layout, optim_state_key), _checked(place, value))


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace the reduced gradient of ``param`` with ``value`` (the average over ranks) for the coming
    step. Call it on every rank with the same ``value``.

    Raises:
        ValueError: no reduced gradient is held now.
    """
    layout, place = _owned(_grad_place(param), param)
    _scatter(place, lambda t: t, _checked(place, value) * layout.mean_divisor)


# ---------------------------------------------------------------------------------------- public: local
def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's shard of a stage-3 parameter's fp32 value (a copy)."""
    found = _state_place(param)
    return None if found is None else _local_place(found[1], "fp32_param").float().clone()


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """This rank's shard of a stage-3 parameter's optimizer state ``optim_state_key`` (a copy)."""
    found = _state_place(param)
    if found is None:
        return None
    tensor = _local_place(found[1], "optimizer_state")
    return _state_picker(found[0], optim_state_key)(tensor).float().clone()


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's shard of a stage-3 parameter's reduced gradient (the average over ranks, a copy).

    Raises:
        ValueError: no reduced gradient is held now.
    """
    found = _grad_place(param)
    if found is None:
        return None
    return _local_place(found[1], "grad").float().div(found[0].mean_divisor)


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write this rank's shard of a stage-3 parameter's fp32 value."""
    _, place = _owned(_state_place(param), param)
    _write_local(place, _local_place(place, "fp32_param"), value)
    if place.separate_master:  # an unsharded parameter with an fp32 master
        with torch.no_grad():
            place.param.data.copy_(value.reshape(place.shape))


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Write this rank's shard of a stage-3 parameter's optimizer state ``optim_state_key``."""
    layout, place = _owned(_state_place(param), param)
    _write_local(place, _state_picker(layout, optim_state_key)(_local_place(place, "optimizer_state")), value)


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace this rank's shard of a stage-3 parameter's reduced gradient (the average over ranks)."""
    layout, place = _owned(_grad_place(param), param)
    _write_local(place, _local_place(place, "grad"), value * layout.mean_divisor)


# ---------------------------------------------------------------------------------------- finding
def _current(param: torch.Tensor) -> torch.Tensor:
    record = record_of(param)
    return param if record is None else record.resolve(cast(nn.Parameter, param))


def _find(places: tuple[ParamPlace, ...], param: torch.Tensor) -> ParamPlace | None:
    current = _current(param)
    return next((place for place in places if place.param is current), None)


def _state_place(param: torch.Tensor) -> tuple[StateLayout, ParamPlace] | None:
    strategy = owner_of(param)
    if strategy is None:
        return None
    layout = strategy.state_layout()
    place = _find(layout.places, param)
    return None if place is None else (layout, place)


def _grad_place(param: torch.Tensor) -> tuple[GradientLayout, ParamPlace] | None:
    strategy = owner_of(param)
    if strategy is None:
        return None
    layout = strategy.gradient_layout()
    if layout.unavailable:
        raise ValueError(f"safe_*_grad: {layout.unavailable}")
    place = _find(layout.places, param)
    return None if place is None else (layout, place)


def _owned(found: tuple[object, ParamPlace] | None, param: torch.Tensor) -> tuple[Any, ParamPlace]:
    if found is None:
        raise ValueError(
            f"safe_set_*: the parameter (shape {tuple(param.shape)}) is not trained by a live shardwise "
            "engine (frozen, or not given to shardwise.initialize), so there is nothing to write; pass a "
            "trainable parameter of the engine's model"
        )
    return found


def _state_picker(layout: StateLayout, key: str) -> Pick:
    """Reads the element-wise state ``key`` of a place's tensor; raises naming the keys there are."""
    state = layout.optimizer.state
    keys = sorted(
        {k for entry in state.values() for k, v in entry.items() if torch.is_tensor(v) and v.dim() > 0}
    )
    if key not in keys:
        held = f"it holds {keys}" if keys else "it holds none yet (state is created by the first step)"
        raise ValueError(
            f"optimizer state {key!r} not found: {layout.optimizer_name} keeps element-wise state per "
            f"parameter and {held}; pass one of those keys"
        )
    return lambda tensor: state[tensor][key]


def _local_place(place: ParamPlace, what: str) -> torch.Tensor:
    if place.holding is Holding.FLAT:
        raise ValueError(
            f"safe_get_local_{what} / safe_set_local_{what} are defined for ZeRO-3 parameters (as in "
            f"DeepSpeed); this parameter is trained at stage 0-2 in flat buffers: use "
            f"safe_get_full_{what} / safe_set_full_{what}"
        )
    assert place.tensor is not None
    return place.tensor


# ---------------------------------------------------------------------------------------- moving values
def _checked(place: ParamPlace, value: torch.Tensor) -> torch.Tensor:
    if value.numel() != place.param.numel():
        raise ValueError(
            f"safe_set_full_*: the value has shape {tuple(value.shape)} but the parameter has shape "
            f"{place.shape}; pass the full (unpartitioned) value"
        )
    return value.detach().reshape(place.shape)


def _split_over(layout: StateLayout | GradientLayout, place: ParamPlace) -> tuple[Group, bool]:
    """The group ``place``'s pieces are split over and whether they are (its own, else the layout's)."""
    return place.split_over if place.split_over is not None else (layout.process_group, layout.partitioned)


def _gather(place: ParamPlace, pick: Pick, group: Group, partitioned: bool) -> torch.Tensor:
    """The full fp32 value of what ``pick`` reads from ``place``'s tensors (collective where they are split)."""
    if place.holding is Holding.FLAT:
        out = torch.zeros(place.param.numel(), dtype=torch.float32, device=place.param.device)
        for piece in place.pieces:
            out[piece.start : piece.stop] = piece.take(pick(piece.tensor)).to(out.device)
        if partitioned:
            collectives.all_reduce(out, op="sum", group=group)
        return out.view(place.shape)
    assert place.tensor is not None
    source = pick(place.tensor).float()
    if place.holding is Holding.WHOLE:
        return source.clone().view(place.shape)
    param: DTensor = place.param
    local = source.to(param.to_local().device)
    shard = DTensor.from_local(
        local,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
    full = shard.full_tensor()
    # over a mesh of one rank (an expert's expert-data-parallel group when ep_size is the data-parallel
    # size) the "gather" is the local tensor itself: a new tensor is promised, never the live value
    return full.clone() if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr() else full


def _scatter(place: ParamPlace, pick: Pick, value: torch.Tensor) -> None:
    """Write this rank's part of the full ``value`` into what ``pick`` reads from ``place``'s tensors."""
    with torch.no_grad():
        if place.holding is Holding.FLAT:
            flat = value.reshape(-1)
            for piece in place.pieces:
                target = piece.take(pick(piece.tensor))
                target.copy_(flat[piece.start : piece.stop])
            return
        assert place.tensor is not None
        target = pick(place.tensor)
        if place.holding is Holding.WHOLE:
            target.copy_(value.reshape(target.shape))
            return
        param: DTensor = place.param
        mine = distribute_tensor(
            value.to(param.to_local().device),
            param.device_mesh,
            param.placements,
            src_data_rank=None,
        ).to_local()
        target.copy_(mine.reshape(target.shape))


def _write_local(place: ParamPlace, target: torch.Tensor, value: torch.Tensor) -> None:
    if value.numel() != target.numel():
        raise ValueError(
            f"safe_set_local_*: the value has {value.numel()} elements but this rank's part of the parameter "
            f"(shape {place.shape}) has {target.numel()} (shape {tuple(target.shape)}); pass this rank's shard"
        )
    with torch.no_grad():
        target.copy_(value.detach().reshape(target.shape))
