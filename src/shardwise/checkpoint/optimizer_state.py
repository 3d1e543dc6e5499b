"""The optimizer's part of a checkpoint, from a :class:`~shardwise.zero.state_layout.StateLayout`.

Every strategy describes where its fp32 values and optimizer state sit
(``state_layout()``); this module is the one implementation of the checkpoint format on
top of that description. The format is topology-free, addressed by parameter *name*
(``names`` maps ``id(param)`` to its module name), every tensor at the parameter's shape:

==========================  ==================================================================
``master/<name>``           the fp32 values, where they are separate copies (16-bit models);
                            otherwise the parameter is the fp32 value, saved as ``model/<name>``
``optim/<name>/<key>``      element-wise state (``exp_avg``...) at the parameter's shape, or a
                            scalar (``step``)
``optim/param_groups``      per param group: hyperparameters and the names it holds
==========================  ==================================================================

:class:`OptimizerState` exposes this rank's pieces (``sharded_state_dict``: DCP writes each
rank's own part; flat ranges as :class:`~shardwise.checkpoint.dcp_io.FlatShards`, local
shards as DTensors), builds targets in the *current* layout for any saved layout
(``sharded_load``), and gathers / scatters whole tensors (``full_state_dict`` /
``load_full_state_dict``: exports, imports, tests).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from shardwise.checkpoint.dcp_io import FlatShards, SavedEntry
from shardwise.checkpoint.keys import PARAM_GROUPS as PARAM_GROUPS_KEY
from shardwise.checkpoint.keys import PARAM_NAMES as PARAM_NAMES_KEY
from shardwise.comm import collectives
from shardwise.comm.fsdp_internals import full_tensor, is_dtensor, local_tensor
from shardwise.zero.state_layout import Holding, ParamPlace, StateLayout

Targets = dict[str, Any]


class OptimizerState:
    """The checkpoint interface of an optimizer, from the description of its state.

    Args:
        layout: where the fp32 values and the optimizer state sit (the strategy's ``state_layout()``).
    """

    def __init__(self, layout: StateLayout) -> None:
        self.layout = layout

    @property
    def optimizer(self) -> Any:
        """The torch optimizer holding the state (keyed by the layout's tensors)."""
        return self.layout.optimizer

    @property
    def optimizer_name(self) -> str:
        """The class name of the optimizer the strategy runs."""
        return self.layout.optimizer_name

    # ------------------------------------------------------------------ naming
    def _named(self, names: Mapping[int, str]) -> Iterator[tuple[str, ParamPlace]]:
        for place in self.layout.places:
            name = names.get(id(place.param))
            if name is None:
                raise ValueError(
                    f"the optimizer updates a parameter of shape {tuple(place.shape)} that is not a parameter of "
                    "the module being checkpointed; checkpoints address parameters by module name, so pass only "
                    "the module's own parameters to shardwise.initialize"
                )
            yield name, place

    def _groups(self, names: Mapping[int, str]) -> list[dict[str, Any]]:
        named = [name for name, _ in self._named(names)]
        return [
            {
                **{k: v for k, v in group.items() if k != "params"},
                PARAM_NAMES_KEY: [named[i] for i in members],
            }
            for group, members in zip(self.layout.optimizer.param_groups, self.layout.groups)
        ]

    def _state_of(self, tensor: torch.Tensor) -> dict[str, Any]:
        return self.layout.optimizer.state.get(tensor, {})

    # ------------------------------------------------------------------ save
    def sharded_state_dict(self, names: Mapping[int, str]) -> dict[str, Any]:
        """This rank's part of the optimizer state, ready for ``torch.distributed.checkpoint``.

        Tensors are views (no copy): snapshot them before training on while they are written.
        """
        out: dict[str, Any] = {}
        for name, place in self._named(names):
            if not place.tensors:
                continue
            if place.separate_master:
                out[f"master/{name}"] = _presented(place, None, torch.float32)
            for key, value in self._state_of(place.tensors[0]).items():
                if _is_elementwise(key, value, place.tensors[0]):
                    out[f"optim/{name}/{key}"] = _presented(place, key, value.dtype, self._state_of)
                else:
                    out[f"optim/{name}/{key}"] = value
        out[PARAM_GROUPS_KEY] = self._groups(names)
        return out

    def full_state_dict(self, names: Mapping[int, str]) -> dict[str, Any]:
        """The whole optimizer state, every tensor full-size, on every rank (collective).

        Same keys as :meth:`sharded_state_dict`, but ``master/<name>`` is always present.
        Flat pieces cost one all-reduce per tensor kind (master, each element-wise key);
        DTensor shards one gather each.
        """
        named = list(self._named(names))
        experts = [n for n, p in named if p.split_over is not None]
        if experts:
            raise ValueError(
                f"the whole optimizer state of an expert-parallel model ({len(experts)} expert tensors, e.g. "
                f"{experts[0]}): each expert-parallel rank holds other experts, so no rank can hold it all; "
                "fix: save with engine.save_checkpoint (expert tensors by global index, any ep_size on load)"
            )
        flat = [(n, p) for n, p in named if p.holding is Holding.FLAT]
        out = self._full_flat(flat) if flat else {}
        for name, place in named:
            if place.holding is Holding.FLAT:
                continue
            out[f"master/{name}"] = full_tensor(_presented(place, None, torch.float32)).float()
            for key, value in self._state_of(place.tensors[0]).items():
                if _is_elementwise(key, value, place.tensors[0]):
                    value = full_tensor(_presented(place, key, value.dtype, self._state_of))
                out[f"optim/{name}/{key}"] = value
        out[PARAM_GROUPS_KEY] = self._groups(names)
        return out

    def _full_flat(self, places: list[tuple[str, ParamPlace]]) -> dict[str, Any]:
        """Whole tensors from flat pieces: every rank adds its pieces into zeros, then one sum."""
        layout = self.layout
        elementwise: dict[str, torch.dtype] = {}
        scalar_kinds: dict[str, Any] = {}  # key -> an example value (its type/dtype)
        for _, place in places:
            for master in place.tensors[:1]:
                for key, value in self._state_of(master).items():
                    if _is_elementwise(key, value, master):
                        elementwise[key] = value.dtype
                    else:
                        scalar_kinds.setdefault(key, value)
        out: dict[str, Any] = {}
        total = sum(math.prod(place.shape) for _, place in places)
        kinds: list[tuple[str | None, torch.dtype]] = [(None, torch.float32), *sorted(elementwise.items())]
        for state_key, dtype in kinds:
            buffer = torch.zeros(total, dtype=dtype, device=layout.device)
            offset = 0
            for _, place in places:
                for piece in place.pieces:
                    source = (
                        piece.tensor if state_key is None else self._state_of(piece.tensor).get(state_key)
                    )
                    if source is not None:
                        buffer[offset + piece.start : offset + piece.stop] = piece.take(source)
                offset += math.prod(place.shape)
            if layout.partitioned:
                collectives.all_reduce(buffer, op="sum", group=layout.process_group)
            offset = 0
            for name, place in places:
                numel = math.prod(place.shape)
                key = f"master/{name}" if state_key is None else f"optim/{name}/{state_key}"
                out[key] = buffer[offset : offset + numel].view(place.shape)
                offset += numel
        out.update(self._gather_scalars(places, scalar_kinds))
        return out

    def _gather_scalars(
        self, places: list[tuple[str, ParamPlace]], kinds: Mapping[str, object]
    ) -> dict[str, Any]:
        """Scalar state (``step``) per name: only the ranks owning part of a parameter hold it,
        so a MAX all-reduce over float64 (missing = -inf) shares it exactly (ints < 2**53)."""
        out: dict[str, Any] = {}
        for key, example in sorted(kinds.items()):
            if not (torch.is_tensor(example) and example.dim() == 0) and not isinstance(example, int | float):
                raise ValueError(
                    f"optimizer state {key!r} is a {type(example).__name__}; only element-wise tensors and "
                    "scalars can be checkpointed without a fixed layout"
                )
            values = torch.full((len(places),), -math.inf, dtype=torch.float64, device=self.layout.device)
            for i, (_, place) in enumerate(places):
                for master in place.tensors[:1]:
                    value = self._state_of(master).get(key)
                    if value is not None:
                        values[i] = float(value)
            if self.layout.partitioned:
                collectives.all_reduce(values, op="max", group=self.layout.process_group)
            for i, (name, _) in enumerate(places):
                value = float(values[i])
                if torch.is_tensor(example):
                    out[f"optim/{name}/{key}"] = torch.tensor(
                        value, dtype=example.dtype, device=example.device
                    )
                else:
                    out[f"optim/{name}/{key}"] = type(example)(value)
        return out

    # ------------------------------------------------------------------ load
    def sharded_load(
        self, names: Mapping[int, str], saved: Mapping[str, Any], *, with_state: bool
    ) -> tuple[Targets, Callable[[Targets], None]]:
        """Targets (in this rank's layout) for a checkpoint's optimizer keys, and the step that applies them.

        Args:
            names: ``id(param) -> name`` for the module's parameters.
            saved: what the checkpoint holds, key -> :class:`~shardwise.checkpoint.dcp_io.SavedEntry`.
            with_state: also load the optimizer state and hyperparameters (else fp32 values only).

        Returns:
            ``(targets, finish)``: fill ``targets`` (tensor targets in place, other values replaced),
            then call ``finish(targets)``; it installs the state and updates the parameters.

        The fp32 values come from ``master/<name>``, or from ``model/<name>`` where the saving
        run's parameters were themselves fp32; the caller must not also load that module key.
        """
        targets: Targets = {}
        allocated: dict[int, dict[str, torch.Tensor]] = {}
        scalars: list[tuple[ParamPlace, str, str]] = []
        for name, place in self._named(names):
            targets[master_source(saved, name, place.shape)] = _presented(place, None, torch.float32)
            if not with_state:
                continue
            prefix = f"optim/{name}/"
            for key in [k for k in saved if k.startswith(prefix)]:
                state_key, entry = key[len(prefix) :], saved[key]
                if entry.is_tensor and state_key != "step" and tuple(entry.shape) == place.shape:
                    for tensor in place.tensors:
                        buffers = allocated.setdefault(id(tensor), {})
                        if state_key not in buffers:
                            buffers[state_key] = torch.zeros_like(tensor.detach(), dtype=entry.dtype)
                    targets[key] = _presented(place, state_key, entry.dtype, lambda t: allocated[id(t)])
                elif place.tensors:
                    targets[key] = torch.empty(entry.shape, dtype=entry.dtype) if entry.is_tensor else None
                    scalars.append((place, state_key, key))
        if with_state and PARAM_GROUPS_KEY in saved:
            targets[PARAM_GROUPS_KEY] = None

        def finish(loaded: Targets) -> None:
            if with_state:
                per_tensor: dict[int, dict[str, Any]] = {}
                for place, state_key, key in scalars:
                    value = loaded[key]
                    for tensor in place.tensors:
                        per_tensor.setdefault(id(tensor), {}).setdefault(
                            state_key, value.clone() if torch.is_tensor(value) else copy.deepcopy(value)
                        )
                for tensor_id, entries in allocated.items():
                    per_tensor.setdefault(tensor_id, {}).update(entries)
                install_optimizer_state(self.layout.optimizer, per_tensor, loaded.get(PARAM_GROUPS_KEY))
            self.layout.params_from_masters()

        return targets, finish

    def load_full_state_dict(
        self, state: Mapping[str, Any], names: Mapping[int, str], *, with_state: bool = True
    ) -> None:
        """Load full-size tensors (keys as :meth:`full_state_dict`), keeping this rank's parts.

        Every rank must call it (the parameters may be all-gathered afterwards).
        """
        saved = {
            key: SavedEntry(tuple(v.shape), v.dtype) if torch.is_tensor(v) else SavedEntry(None, None)
            for key, v in state.items()
        }
        targets, finish = self.sharded_load(names, saved, with_state=with_state)
        with torch.no_grad():
            for key, target in targets.items():
                if isinstance(target, FlatShards):
                    target.fill_from(state[key])
                elif torch.is_tensor(target):
                    copy_full_into(target, state[key])
                else:
                    targets[key] = state[key]
        finish(targets)

    def refresh_masters_from_params(self) -> None:
        """Re-read the fp32 masters from the (just loaded) parameters: weights-only loads."""
        self.layout.masters_from_params()

    # ------------------------------------------------------------------ per-rank state
    def rank_state_dict(self) -> dict[str, Any] | None:
        """The state this rank holds for itself (1-bit error buffers), or None where there is none."""
        holder = self.layout.rank_state
        return None if holder is None else holder.rank_state_dict()

    def load_rank_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`rank_state_dict` (None: this rank has no saved state: start afresh).

        When the holder rewrote its parameters' fp32 values (0/1 Adam inside a local interval:
        each rank's own parameters), they are published to the model's parameters again."""
        holder = self.layout.rank_state
        if holder is not None and holder.load_rank_state_dict(state):
            self.layout.params_from_masters()


def _presented(
    place: ParamPlace,
    key: str | None,
    dtype: torch.dtype,
    state_of: Callable[[torch.Tensor], Mapping[str, torch.Tensor]] | None = None,
) -> Any:
    """The fp32 values (``key`` None) or element-wise state ``key`` of a place, as DCP should see it:
    flat pieces as FlatShards, a local shard as a DTensor like its parameter, a whole tensor as is."""

    def source(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach() if key is None or state_of is None else state_of(tensor)[key]

    if place.holding is Holding.FLAT:
        return FlatShards(
            place.shape, dtype, [(p.start, p.stop, p.take(source(p.tensor))) for p in place.pieces]
        )
    assert place.tensor is not None
    value = source(place.tensor)
    if place.holding is Holding.WHOLE or is_dtensor(value):
        return value
    from torch.distributed.tensor import DTensor

    param = place.param
    return DTensor.from_local(
        value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _is_elementwise(key: str, value: object, tensor: torch.Tensor) -> bool:
    """Optimizer state with one value per element of ``tensor`` (exp_avg...), as opposed to ``step``."""
    return key != "step" and torch.is_tensor(value) and value.shape == tensor.shape


def copy_full_into(target: Any, full: torch.Tensor) -> None:
    """Copy a whole tensor into ``target``: its local shard if it is a DTensor."""
    if is_dtensor(target):
        from torch.distributed.tensor import distribute_tensor

        local = distribute_tensor(
            full.to(target.device_mesh.device_type), target.device_mesh, target.placements, src_data_rank=None
        )
        local_tensor(target).copy_(local_tensor(local))
    else:
        target.copy_(full)


def master_source(saved: Mapping[str, Any], name: str, shape: tuple[int, ...]) -> str:
    """The checkpoint key holding the fp32 value of trainable parameter ``name``, checked against ``shape``.

    ``master/<name>`` where the saving run kept separate fp32 masters (16-bit models), else
    ``model/<name>`` (its parameters were the fp32 values).

    Example:
        >>> master_source({"model/w": SavedEntry((2, 3), torch.float32)}, "w", (2, 3))
        'model/w'
        >>> master_source({"model/w": SavedEntry((2, 3), torch.float32)}, "w", (3, 2))
        Traceback (most recent call last):
        ...
        ValueError: parameter 'w' has shape (3, 2) here but (2, 3) in the checkpoint
    """
    source = f"master/{name}" if f"master/{name}" in saved else f"model/{name}"
    entry = saved.get(source)
    if entry is None:
        raise ValueError(
            f"the checkpoint has no value for the trainable parameter {name!r} (neither master/ nor model/ entry); "
            "it was saved from a different model, or with exclude_frozen_parameters while this parameter was frozen"
        )
    if tuple(entry.shape) != tuple(shape):
        raise ValueError(
            f"parameter {name!r} has shape {tuple(shape)} here but {tuple(entry.shape)} in the checkpoint"
        )
    return source


def install_optimizer_state(
    optimizer: Any, per_tensor: Mapping[int, dict[str, Any]], saved_groups: list[dict[str, Any]] | None
) -> None:
    """Load assembled state into ``optimizer`` through its own ``load_state_dict``.

    ``per_tensor`` maps ``id(optimizer tensor)`` to that tensor's state; hyperparameters come
    from ``saved_groups`` (the checkpoint's param groups) where given. Going through
    ``load_state_dict`` lets the optimizer apply its own dtype/device rules (e.g. where
    ``step`` lives).
    """
    current = optimizer.param_groups
    if saved_groups is not None and len(saved_groups) != len(current):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved_groups)} param groups but this one has {len(current)}; "
            "build the same groups, or load with load_optimizer_states=False"
        )
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    for gi, group in enumerate(current):
        ids = []
        for tensor in group["params"]:
            if per_tensor.get(id(tensor)):
                state[index] = per_tensor[id(tensor)]
            ids.append(index)
            index += 1
        hyper = {k: v for k, v in group.items() if k != "params"}
        if saved_groups is not None:
            hyper.update({k: v for k, v in saved_groups[gi].items() if k not in ("params", PARAM_NAMES_KEY)})
        groups.append({**hyper, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
