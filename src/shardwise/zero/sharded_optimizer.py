"""ZeRO stages 0-2: the optimizer step over flat, (optionally) sharded buffers.

``ZeroOptimizer`` owns the flat groups, the gradient reducer and the inner torch
optimizer (which sees only the fp32 tensors this rank updates). Its ``step`` is, in
order: finish reductions; one all-reduce of the squared gradient norm (which also
detects inf/NaN: a non-finite sum means overflow, so no separate flag collective);
skip on overflow; one multiply that averages over ranks, unscales and clips; the inner
optimizer step; copy fp32 masters into 16-bit parameters; all-gather updated shards.

Stage 0: no sharding (each rank steps the whole buffer; grads all-reduced).
Stage 1: optimizer state sharded; grads reduce-scattered at the accumulation boundary.
Stage 2: stage 1 plus sharded gradients, reduce-scattered every micro step.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.checkpoint import keys
from shardwise.checkpoint.param_state import install_optimizer_state, master_source
from shardwise.comm import collectives
from shardwise.optim.clipping import clip_coefficient, squared_norm
from shardwise.zero.flat_group import FlatGroup
from shardwise.zero.full_buffer_reducer import FullBufferReducer
from shardwise.zero.offload import checkpoint_view
from shardwise.zero.reducer import GradientReducer, ReducePolicy
from shardwise.zero.shard_accumulator_reducer import ShardAccumulatorReducer

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


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
    process_group: Any = None
    mp_group: Any = None
    mp_rank: int = 0


@dataclass(frozen=True)
class StepResult:
    """Outcome of one optimizer step."""

    applied: bool
    grad_norm: float  # true (unscaled, unclipped) global norm; inf on overflow
    overflow: bool


class ZeroOptimizer:
    """Flat-buffer ZeRO (stages 0, 1, 2) around a torch optimizer built on the masters."""

    def __init__(
        self,
        param_groups: Sequence[dict[str, Any]],
        optimizer_factory: OptimizerFactory,
        policy: ZeroPolicy,
    ) -> None:
        self.policy = policy
        shard = policy.stage >= 1
        self.groups: list[FlatGroup] = []
        self.group_index: list[int] = []  # flat group -> user param group
        self.tp_flags: list[bool] = []
        inner_groups: list[dict[str, Any]] = []
        for gi, group in enumerate(param_groups):
            params = [p for p in group["params"] if p.requires_grad]
            hyper = {k: v for k, v in group.items() if k != "params"}
            masters: list[torch.Tensor] = []
            for key, members in _split_by_kind(params).items():
                flat = FlatGroup(
                    members,
                    rank=policy.rank,
                    world_size=policy.world_size,
                    bucket_numel=policy.bucket_numel,
                    shard=shard,
                    full_grad_buffer=policy.stage < 2,
                    grad_dtype=policy.grad_dtype,
                )
                self.groups.append(flat)
                self.group_index.append(gi)
                self.tp_flags.append(key[2])
                masters.extend(flat.master_params())
            inner_groups.append({"params": masters, **hyper})
        self.optimizer = optimizer_factory(inner_groups)
        reducer_class = FullBufferReducer if policy.stage < 2 else ShardAccumulatorReducer
        self.reducer: GradientReducer = reducer_class(
            self.groups,
            ReducePolicy(
                shard=shard,
                every_micro_step=policy.stage >= 2,
                overlap=policy.overlap_comm,
                comm_dtype=policy.comm_dtype,
                pre_multiplier=policy.pre_multiplier,
            ),
            policy.process_group,
        )
        self._bind_master_grads()

    # ------------------------------------------------------------------ wiring
    def _bind_master_grads(self) -> None:
        for flat in self.groups:
            for master, grad in zip(flat.master, flat.grad):
                master.grad = grad if grad.dtype == master.dtype else None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's param groups (schedulers write ``lr`` here)."""
        return self.optimizer.param_groups

    def broadcast_parameters(self) -> None:
        """Make every rank start from the first data-parallel rank's parameters (and masters)."""
        src = group_source_rank(self.policy.process_group)
        for flat in self.groups:
            collectives.broadcast(flat.param_buffer, src=src, group=self.policy.process_group)
            flat.refresh_masters()

    # ------------------------------------------------------------------ micro steps
    def prepare_backward(self, is_boundary: bool) -> None:
        """Tell the reducer whether this backward ends an accumulation window."""
        self.reducer.reduce_this_backward = is_boundary

    def after_backward(self) -> None:
        """Complete this backward's reductions (waits for in-flight buckets)."""
        self.reducer.finish()

    def zero_grad(self) -> None:
        """Clear accumulated gradients."""
        for flat in self.groups:
            flat.zero_grads()
        self.reducer.new_accumulation()

    # ------------------------------------------------------------------ the step
    def _squared_norm(self) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=self.groups[0].device)
        mp_rank0 = self.policy.mp_rank == 0
        for flat, is_tp in zip(self.groups, self.tp_flags):
            if not (is_tp or mp_rank0):
                continue  # replicated across model-parallel ranks: count it once
            total += squared_norm(flat.grad).to(total.device)
        if self.policy.stage >= 1 and self.policy.world_size > 1:
            collectives.all_reduce(total, op="sum", group=self.policy.process_group)
        if self.policy.mp_group is not None:
            collectives.all_reduce(total, op="sum", group=self.policy.mp_group)
        return total

    def step(self, loss_scale: float = 1.0) -> StepResult:
        """One optimizer step at an accumulation boundary (every rank must call it)."""
        self.reducer.finish()
        for flat in self.groups:
            flat.settle()  # slots no gradient reached in this window (e.g. no_sync at the boundary)
        policy = self.policy
        divisor = policy.post_divisor * loss_scale
        scaled_norm = math.sqrt(float(self._squared_norm()))
        norm = scaled_norm / divisor
        if not math.isfinite(norm) and policy.check_overflow:
            self.zero_grad()
            return StepResult(applied=False, grad_norm=math.inf, overflow=True)
        multiplier = clip_coefficient(scaled_norm, policy.gradient_clipping, loss_scale=divisor)
        for flat in self.groups:
            if multiplier != 1.0:
                torch._foreach_mul_(flat.grad, multiplier)
            for master, grad in zip(flat.master, flat.grad):
                if grad.dtype != master.dtype:
                    master.grad = grad.to(master.dtype)
        self.optimizer.step()
        self._publish_parameters()
        self.zero_grad()
        return StepResult(applied=True, grad_norm=norm, overflow=False)

    def _publish_parameters(self) -> None:
        """Masters -> parameter buffer, then (sharded) all-gather every bucket."""
        works = []
        for flat in self.groups:
            flat.copy_master_to_params()
            if self.policy.stage == 0 or self.policy.world_size == 1:
                continue
            for plan, (lo, hi) in zip(flat.layout.buckets, flat.owned):
                bucket = flat.param_buffer[plan.start : plan.end]
                works.append(
                    collectives.all_gather_flat(
                        bucket, flat.param_buffer[lo:hi], group=self.policy.process_group, async_op=True
                    )
                )
        for work in works:
            if work is not None:
                work.wait()

    # ------------------------------------------------------------------ checkpoint state
    # The topology-free form of the optimizer, addressed by parameter *name* (``names`` maps
    # ``id(param)`` to its module name), every tensor at the parameter's shape:
    #   master/<name>          the fp32 master weights
    #   optim/<name>/<key>     elementwise state (exp_avg...) at the parameter's shape, or a
    #                          scalar (``step``)
    #   optim/param_groups     per user param group: hyperparameters and the names it holds
    # ``sharded_state_dict`` exposes this rank's pieces (DCP writes each rank's own part),
    # ``sharded_load`` builds targets of the *current* layout for any saved layout, and the
    # ``full_*`` pair gathers / scatters whole tensors (exports, imports, tests).

    def _places(self, names: Mapping[int, str]) -> list[_ParamPlace]:
        places = []
        for flat in self.groups:
            for index, param in enumerate(flat.params):
                name = names.get(id(param))
                if name is None:
                    raise ValueError(
                        f"a parameter of shape {tuple(param.shape)} handed to the optimizer is not a parameter of "
                        "the module being checkpointed; checkpoints address parameters by module name, so pass "
                        "only the module's own parameters to shardwise.initialize"
                    )
                pieces = [
                    (start, stop, flat.master[m], off) for start, stop, m, off in flat.master_pieces(index)
                ]
                places.append(_ParamPlace(name, tuple(param.shape), pieces, flat.dtype != torch.float32))
        return places

    def _param_groups_state(self, names: Mapping[int, str]) -> list[dict[str, Any]]:
        members: list[list[str]] = [[] for _ in self.optimizer.param_groups]
        for flat, gi in zip(self.groups, self.group_index):
            members[gi].extend(names[id(p)] for p in flat.params)
        return [
            {**{k: v for k, v in group.items() if k != "params"}, PARAM_NAMES_KEY: members[gi]}
            for gi, group in enumerate(self.optimizer.param_groups)
        ]

    def sharded_state_dict(self, names: Mapping[int, str]) -> dict[str, Any]:
        """This rank's part of the optimizer state, ready for ``torch.distributed.checkpoint``.

        ``master/<name>`` is present only where the masters are separate fp32 copies (16-bit
        models); for fp32 models the parameters are the masters and are saved with the module.
        Tensors are views (no copy): snapshot them before training on while they are written.
        """
        from shardwise.checkpoint.dcp_io import FlatShards

        optimizer = checkpoint_view(self.optimizer)
        out: dict[str, Any] = {}
        for place in self._places(names):
            if not place.pieces:
                continue
            if place.separate_master:
                out[f"master/{place.name}"] = FlatShards(
                    place.shape,
                    torch.float32,
                    [(s, e, _flat(m)[o : o + e - s]) for s, e, m, o in place.pieces],
                )
            first = optimizer.state.get(place.pieces[0][2], {})
            for key, value in first.items():
                if _is_elementwise(key, value, place.pieces[0][2]):
                    views = [
                        (s, e, _flat(optimizer.state[m][key])[o : o + e - s]) for s, e, m, o in place.pieces
                    ]
                    out[f"optim/{place.name}/{key}"] = FlatShards(place.shape, value.dtype, views)
                else:
                    out[f"optim/{place.name}/{key}"] = value
        out[PARAM_GROUPS_KEY] = self._param_groups_state(names)
        return out

    def sharded_load(
        self, names: Mapping[int, str], saved: Mapping[str, Any], *, with_state: bool
    ) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
        """Targets (in this rank's layout) for a checkpoint's optimizer keys, and the step that applies them.

        Args:
            names: ``id(param) -> name`` for the module's parameters.
            saved: what the checkpoint holds, key -> :class:`~shardwise.checkpoint.dcp_io.SavedEntry`.
            with_state: also load the optimizer state and hyperparameters (else masters only).

        Returns:
            ``(targets, finish)``: fill ``targets`` (tensor targets in place, other values replaced),
            then call ``finish(targets)``; it installs the state and publishes the parameters.

        The fp32 values come from ``master/<name>``, or from ``model/<name>`` where the saving
        run's parameters were themselves fp32; the caller must not also load that module key.
        """
        from shardwise.checkpoint.dcp_io import FlatShards

        targets: dict[str, Any] = {}
        allocated: dict[int, dict[str, torch.Tensor]] = {}
        scalars: list[tuple[_ParamPlace, str, str]] = []
        for place in self._places(names):
            source = master_source(saved, place.name, place.shape)
            targets[source] = FlatShards(
                place.shape, torch.float32, [(s, e, _flat(m)[o : o + e - s]) for s, e, m, o in place.pieces]
            )
            if not with_state:
                continue
            prefix = f"optim/{place.name}/"
            for key in [k for k in saved if k.startswith(prefix)]:
                state_key, entry = key[len(prefix) :], saved[key]
                if entry.is_tensor and state_key != "step" and tuple(entry.shape) == place.shape:
                    views = []
                    for s, e, m, o in place.pieces:
                        buffers = allocated.setdefault(id(m), {})
                        if state_key not in buffers:
                            buffers[state_key] = torch.zeros(m.shape, dtype=entry.dtype, device=m.device)
                        views.append((s, e, _flat(buffers[state_key])[o : o + e - s]))
                    targets[key] = FlatShards(place.shape, entry.dtype, views)
                elif place.pieces:
                    targets[key] = torch.empty(entry.shape, dtype=entry.dtype) if entry.is_tensor else None
                    scalars.append((place, state_key, key))
        if with_state and PARAM_GROUPS_KEY in saved:
            targets[PARAM_GROUPS_KEY] = None

        def finish(loaded: dict[str, Any]) -> None:
            if with_state:
                self._install_state(allocated, scalars, loaded, loaded.get(PARAM_GROUPS_KEY))
            self._publish_parameters()

        return targets, finish

    def _install_state(
        self,
        allocated: dict[int, dict[str, torch.Tensor]],
        scalars: list[tuple[_ParamPlace, str, str]],
        loaded: Mapping[str, Any],
        saved_groups: list[dict[str, Any]] | None,
    ) -> None:
        """Hand the assembled per-master state to the inner optimizer's own ``load_state_dict``
        (which applies its dtype/device rules, e.g. where ``step`` lives)."""
        per_master: dict[int, dict[str, Any]] = {}
        for place, state_key, key in scalars:
            for _, _, master, _ in place.pieces:
                value = loaded[key]
                per_master.setdefault(id(master), {}).setdefault(
                    state_key, value.clone() if torch.is_tensor(value) else copy.deepcopy(value)
                )
        for master_id, entries in allocated.items():
            per_master.setdefault(master_id, {}).update(entries)
        install_optimizer_state(checkpoint_view(self.optimizer), per_master, saved_groups)

    def full_state_dict(self, names: Mapping[int, str]) -> dict[str, Any]:
        """The whole optimizer state, every tensor full-size, on every rank (collective).

        Same keys as :meth:`sharded_state_dict`, but ``master/<name>`` is always present.
        Costs one all-reduce per tensor kind (master, each elementwise state key).
        """
        places = self._places(names)
        optimizer = checkpoint_view(self.optimizer)
        elementwise: dict[str, torch.dtype] = {}
        scalar_kinds: dict[str, Any] = {}  # key -> an example value (its type/dtype)
        for place in places:
            for _, _, master, _ in place.pieces[:1]:
                for key, value in optimizer.state.get(master, {}).items():
                    if _is_elementwise(key, value, master):
                        elementwise[key] = value.dtype
                    else:
                        scalar_kinds.setdefault(key, value)
        sharded = self.policy.stage >= 1 and self.policy.world_size > 1
        out: dict[str, Any] = {}
        kinds: list[tuple[str | None, torch.dtype]] = [(None, torch.float32), *sorted(elementwise.items())]
        device = self.groups[0].device
        for state_key, dtype in kinds:
            total = sum(math.prod(p.shape) for p in places)
            buffer = torch.zeros(total, dtype=dtype, device=device)
            offset = 0
            for place in places:
                for s, e, master, o in place.pieces:
                    source = master if state_key is None else optimizer.state.get(master, {}).get(state_key)
                    if source is not None:
                        buffer[offset + s : offset + e] = _flat(source)[o : o + e - s]
                offset += math.prod(place.shape)
            if sharded:
                collectives.all_reduce(buffer, op="sum", group=self.policy.process_group)
            offset = 0
            for place in places:
                numel = math.prod(place.shape)
                key = f"master/{place.name}" if state_key is None else f"optim/{place.name}/{state_key}"
                out[key] = buffer[offset : offset + numel].view(place.shape)
                offset += numel
        out.update(self._gather_scalars(optimizer, places, scalar_kinds, sharded))
        out[PARAM_GROUPS_KEY] = self._param_groups_state(names)
        return out

    def _gather_scalars(
        self, optimizer: Any, places: list[_ParamPlace], kinds: Mapping[str, Any], sharded: bool
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
            values = torch.full((len(places),), -math.inf, dtype=torch.float64, device=self.groups[0].device)
            for i, place in enumerate(places):
                for _, _, master, _ in place.pieces[:1]:
                    value = optimizer.state.get(master, {}).get(key)
                    if value is not None:
                        values[i] = float(value)
            if sharded:
                collectives.all_reduce(values, op="max", group=self.policy.process_group)
            for i, place in enumerate(places):
                value = float(values[i])
                if torch.is_tensor(example):
                    out[f"optim/{place.name}/{key}"] = torch.tensor(
                        value, dtype=example.dtype, device=example.device
                    )
                else:
                    out[f"optim/{place.name}/{key}"] = type(example)(value)
        return out

    def load_full_state_dict(
        self, state: Mapping[str, Any], names: Mapping[int, str], *, with_state: bool = True
    ) -> None:
        """Load full-size tensors (keys as :meth:`full_state_dict`), keeping this rank's parts.

        Every rank must call it (the parameters are all-gathered afterwards).
        """
        from shardwise.checkpoint.dcp_io import FlatShards, SavedEntry

        saved = {
            key: SavedEntry(tuple(v.shape), v.dtype) if torch.is_tensor(v) else SavedEntry(None, None)
            for key, v in state.items()
        }
        targets, finish = self.sharded_load(names, saved, with_state=with_state)
        for key, target in targets.items():
            if isinstance(target, FlatShards):
                target.fill_from(state[key])
            elif torch.is_tensor(target):
                target.copy_(state[key])
            else:
                targets[key] = state[key]
        finish(targets)

    def refresh_masters_from_params(self) -> None:
        """Re-read the fp32 masters from the (just loaded) parameters: weights-only loads."""
        for flat in self.groups:
            flat.refresh_masters()

    def close(self) -> None:
        """Detach the gradient hooks and delete optimizer-offload swap files (nvme), if any."""
        self.reducer.remove_hooks()
        store = getattr(self.optimizer, "store", None)
        if store is not None:
            store.close()

    # ------------------------------------------------------------------ introspection
    def model_state_bytes(self) -> int:
        """Bytes of parameters, gradients, masters and optimizer state held by this rank."""
        total = sum(flat.state_bytes() for flat in self.groups)
        for state in self.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.dim() > 0:
                    total += value.numel() * value.element_size()
        return total


PARAM_GROUPS_KEY = keys.PARAM_GROUPS
PARAM_NAMES_KEY = keys.PARAM_NAMES


@dataclass(frozen=True)
class _ParamPlace:
    """Where one named parameter's fp32 values live on this rank: ``(start, stop, master, offset)``
    pieces meaning flat elements ``[start, stop)`` are ``master.view(-1)[offset : offset + stop - start]``."""

    name: str
    shape: tuple[int, ...]
    pieces: list[tuple[int, int, torch.Tensor, int]]
    separate_master: bool


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(-1)


def _is_elementwise(key: str, value: Any, master: torch.Tensor) -> bool:
    """Optimizer state with one value per parameter element (exp_avg...), as opposed to ``step``."""
    return key != "step" and torch.is_tensor(value) and value.shape == master.shape


def group_source_rank(group: Any) -> int:
    """The global rank of a group's first member (broadcast sources are global ranks)."""
    if group is None:
        return 0
    import torch.distributed as dist

    return dist.get_global_rank(group, 0)


def _split_by_kind(
    params: Sequence[nn.Parameter],
) -> dict[tuple[torch.dtype, torch.device, bool], list[nn.Parameter]]:
    """Group parameters by (dtype, device, tensor-parallel flag): one flat buffer each."""
    out: dict[tuple[torch.dtype, torch.device, bool], list[nn.Parameter]] = {}
    for p in params:
        is_tp = bool(getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False))
        out.setdefault((p.dtype, p.device, is_tp), []).append(p)
    return out
