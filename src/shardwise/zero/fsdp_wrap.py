"""Apply FSDP2 (``fully_shard``) to a model for ZeRO stage 3, in place.

:func:`shard_model` is the whole recipe, in order:

1. make every rank start from the first data-parallel rank's values (broadcast of the
   whole parameters, before anything is sharded);
2. pick the unsharded small parameters (``stage3_param_persistence_threshold``); they
   become FSDP2 ``ignored_params`` and are handled by :mod:`shardwise.zero.replicated`;
3. set dtypes: trainable sharded parameters become fp32 (the masters; their values are
   first rounded through the compute dtype, so they start from the 16-bit weights like
   stages 0-2), frozen ones and the unsharded ones take the compute dtype, and so do
   floating-point buffers;
4. choose the shard units (:mod:`shardwise.zero.wrap_policy`) and apply ``fully_shard``
   to each, then to the root, with ``MixedPrecisionPolicy(param_dtype=compute,
   reduce_dtype=fp32 or communication_data_type)``, ``CPUOffloadPolicy`` for
   ``offload_param`` and the per-unit ``reshard_after_forward`` plan; parameters built
   under ``zero.Init`` are materialised one unit at a time, straight into their shard;
5. reduction is a plain sum (FSDP2's divide factor 1): the average, the loss scale and
   clipping are one multiply in the optimizer step, as at stages 0-2;
6. explicit prefetch lists from ``stage3_prefetch_bucket_size``;
7. a :class:`ShardedModel` record on the module, mapping the user's original parameter
   objects to the sharded ones (``initialize`` may have been handed the originals).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.utils.logging import logger
from shardwise.zero.init_context import Init, ZeroParamStatus, gather_stash, is_external, stash_of
from shardwise.zero.offload import OffloadSpec
from shardwise.zero.param_swap import ParamSwapper
from shardwise.zero.stage3_settings import Stage3Settings
from shardwise.zero.wrap_policy import (
    WrapRules,
    choose_persistent,
    choose_units,
    describe_modules,
    prefetch_plan,
    reshard_plan,
)

_IDS = itertools.count(1_000_000)


@dataclass(frozen=True)
class ShardPolicy:
    """Everything :func:`shard_model` needs, decided once by the factory."""

    settings: Stage3Settings
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    process_group: Any
    device: torch.device
    param_offload: OffloadSpec | None = None
    rank: int = 0
    world_size: int = 1


class ShardedModel:
    """What wrapping did to a model: units, sharded and unsharded parameters, mappings.

    Attributes:
        module: the root (now an FSDP module).
        units: shard units in execution order (the root not included).
        unit_names: their names.
        reshard: ``reshard_after_forward`` per unit.
        sharded: the sharded (DTensor) parameters, unique, in ``module.parameters()`` order.
        replicated: the unsharded parameters (trainable and frozen).
    """

    def __init__(self, module: nn.Module, policy: ShardPolicy) -> None:
        self.module = module
        self.policy = policy
        self.process_group = policy.process_group
        self.units: list[nn.Module] = []
        self.unit_names: list[str] = []
        self.reshard: list[bool | int] = []
        self.sharded: list[nn.Parameter] = []
        self.replicated: list[nn.Parameter] = []
        self._original: dict[int, tuple[weakref.ref[nn.Parameter], nn.Parameter]] = {}
        self._root_params: set[int] = set()
        self.swapper: ParamSwapper | None = None
        self.replicated_listener: Any = None  # set by the optimizer: refresh masters on edits

    # ------------------------------------------------------------------ lookups
    def resolve(self, param: nn.Parameter) -> nn.Parameter:
        """The current parameter for ``param`` (an original object or a current one)."""
        entry = self._original.get(id(param))
        if entry is not None and entry[0]() is param:
            return entry[1]
        return param

    def in_root_unit(self, param: nn.Parameter) -> bool:
        """Whether a parameter is gathered through the whole forward and backward."""
        return id(param) in self._root_params or not hasattr(param, "device_mesh")

    def ensure_resident(self) -> None:
        """NVMe parameter offload: bring the shards back into memory."""
        if self.swapper is not None:
            self.swapper.restore()

    def evict(self) -> None:
        """NVMe parameter offload: write the shards to their file and free the memory."""
        if self.swapper is not None:
            self.swapper.evict()

    def refresh_replicated(self, param: nn.Parameter) -> None:
        """An unsharded parameter was edited in place: its fp32 master must follow."""
        if self.replicated_listener is not None:
            self.replicated_listener(param)

    def fsdp_modules(self) -> list[nn.Module]:
        """Every module ``fully_shard`` was applied to (units, then the root)."""
        return [*self.units, self.module]


def sharded_record(module: nn.Module) -> ShardedModel | None:
    """The :class:`ShardedModel` of a module prepared for stage 3, else None."""
    return getattr(module, "_shardwise_stage3", None)


def _unique_params(model: nn.Module) -> tuple[list[nn.Parameter], dict[int, list[tuple[nn.Module, str]]]]:
    params: list[nn.Parameter] = []
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            if id(p) not in owners:
                owners[id(p)] = []
                params.append(p)
            owners[id(p)].append((module, name))
    return params, owners


def _set(owners: list[tuple[nn.Module, str]], value: nn.Parameter) -> None:
    for module, name in owners:
        module._parameters[name] = value


def _source_rank(group: Any) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)


def _broadcast_whole(params: Iterable[nn.Parameter], policy: ShardPolicy) -> None:
    if policy.world_size == 1:
        return
    src = _source_rank(policy.process_group)
    with torch.no_grad():
        for p in params:
            if stash_of(p) is None:
                dist.broadcast(p.data, src=src, group=policy.process_group)


def _real(p: nn.Parameter, value: torch.Tensor) -> nn.Parameter:
    new = nn.Parameter(value, requires_grad=p.requires_grad)
    for key, attr in vars(p).items():
        if not key.startswith(("_shardwise", "ds_")):
            setattr(new, key, attr)
    return new


def shard_model(model: nn.Module, policy: ShardPolicy) -> ShardedModel:
    """Apply FSDP2 to ``model`` in place following ``policy``; returns the record.

    Example:
        >>> # record = shard_model(model, ShardPolicy(settings, torch.bfloat16, torch.float32, None, cpu))
        >>> # record.units -> the blocks; model is now an FSDP2 root module
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    existing = sharded_record(model)
    if existing is not None:
        return existing
    settings = policy.settings
    compute = policy.compute_dtype
    record = ShardedModel(model, policy)
    with Init.paused():
        params, owners = _unique_params(model)
        empty = [n for n, p in model.named_parameters() if p.is_meta and stash_of(p) is None]
        if empty:
            raise ValueError(
                f"parameters on the meta device have no values to shard: {', '.join(empty[:5])}"
                f"{' ...' if len(empty) > 5 else ''}; build the model under shardwise.zero.Init "
                "(which keeps each rank's part of the real values) or materialise it before initialize"
            )
        # One entry per distinct parameter: the user's original object (weakly) and every
        # (module, name) registering it. Entries are found by the id of the parameter's
        # *current* object, re-keyed on every replacement; ids of objects FSDP2 drops may
        # be reused later, which is why the entries are a list and not keyed by id.
        entries: list[tuple[weakref.ref[nn.Parameter], list[tuple[nn.Module, str]]]] = [
            (weakref.ref(p), owners[id(p)]) for p in params
        ]
        entry_of = {id(p): i for i, p in enumerate(params)}
        _broadcast_whole(params, policy)

        # --- unsharded small parameters (and scalars, which FSDP2 cannot shard)
        numels = [p.numel() if p.dim() > 0 else 0 for p in params]
        chosen = set(
            choose_persistent(numels, settings.persistence_threshold, settings.model_persistence_threshold)
        )
        persistent: list[nn.Parameter] = []
        for index, p in enumerate(params):
            if index in chosen or p.dim() == 0:
                stash = stash_of(p)
                value = gather_stash(stash) if stash is not None else p.detach()
                value = value.to(
                    device=policy.device, dtype=compute if value.is_floating_point() else value.dtype
                )
                if stash is None:
                    if value.data_ptr() != p.data_ptr() or value.dtype != p.dtype:
                        p.data = value  # same object: the user's references stay valid
                    persistent.append(p)
                    continue
                new = _real(p, value.contiguous())
                _set(owners[id(p)], new)
                persistent.append(new)
                owners[id(new)] = owners.pop(id(p))
                entry_of[id(new)] = entry_of.pop(id(p))
                params[index] = new
            elif stash_of(p) is None:
                with torch.no_grad():
                    value = p.detach().to(policy.device)
                    if value.is_floating_point():
                        value = value.to(compute)
                        if p.requires_grad:
                            value = value.float()  # fp32 master, rounded through the compute dtype
                    if value.data_ptr() != p.data_ptr() or value.dtype != p.dtype:
                        p.data = value
        for buffer_owner in model.modules():
            for name, buf in buffer_owner._buffers.items():
                if buf is not None and buf.is_floating_point() and buf.dtype != compute:
                    buffer_owner._buffers[name] = buf.to(device=policy.device, dtype=compute)
                elif buf is not None and buf.device != policy.device:
                    buffer_owner._buffers[name] = buf.to(policy.device)
        persistent_ids = {id(p) for p in persistent}

        # --- shard units and their plans
        external = [p for p in params if is_external(p)]
        nodes = describe_modules(model, counted=lambda p: id(p) not in persistent_ids, external=external)
        rules = WrapRules(
            leaf_classes=settings.leaf_classes,
            leaf_names=settings.leaf_names,
            leaf_suffixes=settings.leaf_suffixes,
            granularity_threshold=settings.granularity_threshold,
            leaf_unit_min_numel=settings.leaf_unit_min_numel,
        )
        unit_names = choose_units(nodes, rules)
        modules = dict(model.named_modules())
        unit_numels = [nodes[n].numel for n in unit_names]
        keep = reshard_plan(unit_numels, settings.max_live_numel, settings.max_reuse_distance)
        hpz = settings.hpz_partition_size
        use_hpz = 1 < hpz < policy.world_size and policy.world_size % hpz == 0

        group = policy.process_group if policy.process_group is not None else dist.group.WORLD
        mesh = DeviceMesh.from_group(group, policy.device.type)  # type: ignore[arg-type]
        mp = MixedPrecisionPolicy(
            param_dtype=None if compute == torch.float32 else compute,
            reduce_dtype=policy.reduce_dtype,
        )
        offload: OffloadPolicy = OffloadPolicy()
        if policy.param_offload is not None:
            pin = policy.param_offload.pin and policy.param_offload.device == "cpu"
            offload = CPUOffloadPolicy(pin_memory=pin)
        ignored = set(persistent)

        def materialise(scope: nn.Module) -> list[tuple[nn.Module, str, Any]]:
            """Give placeholders under ``scope`` (not yet sharded) full, uninitialised storage."""
            pending = []
            done: dict[int, nn.Parameter] = {}
            for sub in scope.modules():
                for name, p in list(sub._parameters.items()):
                    if p is None or stash_of(p) is None:
                        continue
                    if id(p) not in done:
                        stash = stash_of(p)
                        assert stash is not None
                        dtype = torch.float32 if p.requires_grad else compute
                        new = _real(p, torch.empty(stash.shape, dtype=dtype, device=policy.device))
                        done[id(p)] = new
                        pending.append((sub, name, stash))
                        all_owners = owners.pop(id(p))
                        owners[id(new)] = all_owners
                        entry_of[id(new)] = entry_of.pop(id(p))
                        _set(all_owners, new)
            return pending

        def fill(pending: list[tuple[nn.Module, str, Any]]) -> None:
            """Copy each placeholder's kept chunk into its new local shard."""
            with torch.no_grad():
                for sub, name, stash in pending:
                    local = sub._parameters[name].to_local()  # type: ignore[union-attr]
                    chunk = stash.shard
                    if sub._parameters[name].requires_grad:  # type: ignore[union-attr]
                        chunk = chunk.to(compute).float()
                    else:
                        chunk = chunk.to(local.dtype)
                    local.copy_(chunk.reshape(local.shape))

        for name, reshard in zip(unit_names, keep):
            unit = modules[name]
            pending = materialise(unit)
            setting: bool | int = reshard
            if reshard and use_hpz:
                setting = hpz
            fully_shard(
                unit,
                mesh=mesh,
                reshard_after_forward=setting,
                mp_policy=mp,
                offload_policy=offload,
                ignored_params=ignored,
            )
            fill(pending)
            record.units.append(unit)
            record.unit_names.append(name)
            record.reshard.append(setting)
        pending = materialise(model)
        fully_shard(
            model,
            mesh=mesh,
            reshard_after_forward=False,
            mp_policy=mp,
            offload_policy=offload,
            ignored_params=ignored,
        )
        fill(pending)

    for fsdp_module in record.fsdp_modules():
        fsdp_module.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        fsdp_module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    _apply_prefetch(record, unit_numels, settings)
    if policy.device.type == "cpu":
        # Without streams (CPU, gloo) FSDP2's gathers block unless issued asynchronously;
        # with the explicit prefetch lists above, an async gather runs in gloo's thread
        # while the previous unit computes (measured ~10% per step on the benchmark GPT).
        for fsdp_module in record.fsdp_modules():
            fsdp_module._set_unshard_async_op(True)  # type: ignore[operator]

    # --- bookkeeping: current parameter objects, attributes for DeepSpeed-style code
    root_unit_ids: set[int] = set()
    unit_param_ids = {id(p) for unit in record.units for p in unit.parameters()}
    for p in model.parameters():
        if id(p) not in unit_param_ids:
            root_unit_ids.add(id(p))
    record._root_params = root_unit_ids
    for ref, entry_owners in entries:
        module, name = entry_owners[0]
        current = module._parameters[name]
        assert current is not None, "a parameter disappeared while sharding"
        original = ref()
        if original is not None and original is not current:
            record._original[id(original)] = (ref, current)
            original._shardwise_record = record  # type: ignore[attr-defined]
            if stash_of(original) is None and original.data.numel() > 0:
                # the user may still hold the original object: free its full-size data
                original.data = torch.empty(0, dtype=original.dtype, device=original.device)
        current._shardwise_record = record  # type: ignore[attr-defined]
        current._shardwise_owners = [(weakref.ref(m), n) for m, n in entry_owners]  # type: ignore[attr-defined]
        current.ds_id = next(_IDS)  # type: ignore[attr-defined]
        current.ds_shape = current.shape  # type: ignore[attr-defined]
        current.ds_numel = current.numel()  # type: ignore[attr-defined]
        is_dtensor = hasattr(current, "device_mesh")
        # a detached alias of the local shard: a plain ``to_local()`` view would break (reading its
        # grad_fn raises) once the shard is written in place, e.g. by a checkpoint load
        local = current.to_local().detach() if is_dtensor else current.data  # type: ignore[attr-defined]
        current.ds_tensor = local  # type: ignore[attr-defined]
        current.ds_status = ZeroParamStatus.NOT_AVAILABLE if is_dtensor else ZeroParamStatus.AVAILABLE  # type: ignore[attr-defined]
        (record.sharded if is_dtensor else record.replicated).append(current)
    order = {id(p): i for i, p in enumerate(model.parameters())}
    record.sharded.sort(key=lambda p: order.get(id(p), 0))
    record.replicated.sort(key=lambda p: order.get(id(p), 0))

    if policy.param_offload is not None and policy.param_offload.device == "nvme":
        record.swapper = ParamSwapper(record.sharded, policy.param_offload, policy.rank)
        model.register_forward_pre_hook(lambda *_: record.ensure_resident(), prepend=True)
        model.register_state_dict_pre_hook(lambda *_args, **_kw: record.ensure_resident())
        record.evict()
    model._shardwise_stage3 = record  # type: ignore[assignment]
    logger.info(
        "stage 3: %d shard units + root (%s), %d sharded and %d unsharded parameters",
        len(record.units),
        ", ".join(record.unit_names[:4]) + (" ..." if len(record.unit_names) > 4 else ""),
        len(record.sharded),
        len(record.replicated),
    )
    return record


def _apply_prefetch(record: ShardedModel, unit_numels: list[int], settings: Stage3Settings) -> None:
    """Explicit forward/backward prefetch lists from the bucket size (or none at all)."""
    units = record.units
    if settings.prefetch_disabled:
        for module in record.fsdp_modules():
            module.set_modules_to_forward_prefetch([])  # type: ignore[operator]
            module.set_modules_to_backward_prefetch([])  # type: ignore[operator]
        return
    if not units or settings.prefetch_bucket_numel <= 0:
        return  # FSDP2's defaults: implicit backward prefetch of the next unit
    forward = prefetch_plan([0, *unit_numels], settings.prefetch_bucket_numel)
    chain: list[nn.Module] = [record.module, *units]
    for i, count in enumerate(forward):
        if count:
            chain[i].set_modules_to_forward_prefetch(chain[i + 1 : i + 1 + count])  # type: ignore[operator]
    backward = prefetch_plan(list(reversed(unit_numels)), settings.prefetch_bucket_numel)
    reverse_units = list(reversed(units))
    for i, count in enumerate(backward):
        targets = reverse_units[i + 1 : i + 1 + count]
        reverse_units[i].set_modules_to_backward_prefetch(targets)  # type: ignore[operator]
