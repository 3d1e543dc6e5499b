"""Apply FSDP2 (``fully_shard``) to a model for ZeRO stage 3, in place.

:func:`shard_model` is the whole recipe; each step is a function below, in this order:

1. :func:`_broadcast_whole`: every rank starts from the first data-parallel rank's values
   (the whole parameters, before anything is sharded);
2. :func:`_place_parameters`: pick the unsharded small parameters
   (``stage3_param_persistence_threshold``; they become FSDP2 ``ignored_params`` and are
   handled by :mod:`shardwise.zero.replicated`) and set dtypes: trainable sharded
   parameters become fp32 (the masters; their values are first rounded through the compute
   dtype, so they start from the 16-bit weights like stages 0-2), frozen ones and the
   unsharded ones take the compute dtype; :func:`_place_buffers` moves the buffers to the
   device, a floating one changing dtype only where ``data_types`` says
   (:mod:`shardwise.precision.buffer_dtypes`: by default each keeps its own, as in DeepSpeed);
3. :func:`_plan_units`: choose the shard units (:mod:`shardwise.zero.wrap_policy`) and
   their ``reshard_after_forward`` plan;
4. :func:`_apply_fully_shard`: ``fully_shard`` each unit, then the root, with
   ``MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=fp32 or
   communication_data_type, cast_forward_inputs=False)`` (inputs stay as given, as at
   stages 0-2) and ``CPUOffloadPolicy`` for ``offload_param``; parameters
   built under ``zero.Init`` are materialised one unit at a time, straight into their shard;
5. :func:`_configure_reduction`: reduction is a plain sum (FSDP2's divide factor 1): the
   average, the loss scale and clipping are one division in the optimizer step, as at
   stages 0-2; on CPU, gathers are issued asynchronously;
6. :func:`_apply_prefetch`: explicit prefetch lists from ``stage3_prefetch_bucket_size``;
7. :func:`_record_parameters`: the :class:`~shardwise.zero.sharded_model.ShardedModel`
   record maps the user's original parameter objects to the sharded ones
   (``initialize`` may have been handed the originals) and sets DeepSpeed's ``ds_*``
   attributes; :func:`_attach_param_swapper` adds NVMe parameter offload.

Process-group work goes through :mod:`shardwise.comm`; the FSDP2 and DTensor APIs
(``torch.distributed.fsdp``, ``device_mesh``) are used directly.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.comm import collectives
from shardwise.comm import init as comm_init
from shardwise.comm.fsdp_internals import is_dtensor, set_unshard_async, unit_sharded_params
from shardwise.precision.buffer_dtypes import buffer_targets, place_buffers
from shardwise.utils.logging import logger
from shardwise.zero.expert_units import expert_roots, is_expert, merge_units, refuse_unshardable_experts
from shardwise.zero.external_params import is_external
from shardwise.zero.hpz import hpz_active
from shardwise.zero.init_context import Init, ZeroParamStatus, gather_stash, stash_of
from shardwise.zero.leaf_modules import leaf_module_names
from shardwise.zero.param_swap import ParamSwapper
from shardwise.zero.sharded_model import ShardedModel, ShardPolicy, record_of, register_record
from shardwise.zero.stage3_settings import Stage3Settings
from shardwise.zero.wrap_policy import (
    WrapRules,
    choose_persistent,
    choose_units,
    describe_modules,
    prefetch_plan,
    reshard_plan,
)

__all__ = ["ShardPolicy", "ShardedModel", "record_of", "shard_model", "sharded_record"]

_IDS = itertools.count(1_000_000)
Owners = list[tuple[nn.Module, str]]


def sharded_record(module: nn.Module) -> ShardedModel | None:
    """The :class:`ShardedModel` of a root module prepared for stage 3, else None."""
    return record_of(module)


class _Tracker:
    """The model's distinct parameters and who registers each, followed through replacements.

    ``entries`` keeps, per distinct parameter, the user's original object (weakly) and every
    ``(module, name)`` registering it. ``owners`` finds those registrations by the id of the
    parameter's *current* object and is re-keyed on every replacement; ids of objects FSDP2
    drops may be reused later, which is why ``entries`` is a list and not keyed by id.
    """

    def __init__(self, model: nn.Module) -> None:
        self.params: list[nn.Parameter] = []
        self.owners: dict[int, Owners] = {}
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is None:
                    continue
                if id(p) not in self.owners:
                    self.owners[id(p)] = []
                    self.params.append(p)
                self.owners[id(p)].append((module, name))
        self.entries: list[tuple[weakref.ref[nn.Parameter], Owners]] = [
            (weakref.ref(p), self.owners[id(p)]) for p in self.params
        ]
        # the user's attributes of each parameter (DeepSpeed's markers: ``allreduce``, ``group_name``...),
        # given to the DTensor parameter FSDP2 puts in its place
        self.marks: list[dict[str, Any]] = [_user_marks(p) for p in self.params]

    def replace(self, old: nn.Parameter, new: nn.Parameter) -> None:
        """Register ``new`` wherever ``old`` was registered."""
        owners = self.owners.pop(id(old))
        for module, name in owners:
            module._parameters[name] = new
        self.owners[id(new)] = owners


_LAYOUT_ATTRIBUTES = frozenset({"ds_id", "ds_shape", "ds_numel", "ds_tensor", "ds_status"})  # set afresh per parameter


def _user_marks(p: nn.Parameter) -> dict[str, Any]:
    """``p``'s user attributes (DeepSpeed's markers such as ``allreduce``, ``group_name``,
    ``ds_zero_placement_family`` included), not shardwise's own or a placeholder's layout."""
    return {key: a for key, a in vars(p).items() if not key.startswith("_shardwise") and key not in _LAYOUT_ATTRIBUTES}


def _real(p: nn.Parameter, value: torch.Tensor) -> nn.Parameter:
    """A real parameter holding ``value`` with ``p``'s user attributes (not placeholder ones)."""
    new = nn.Parameter(value, requires_grad=p.requires_grad)
    for key, attr in _user_marks(p).items():
        setattr(new, key, attr)
    return new


def _refuse_meta_without_values(model: nn.Module) -> None:
    """Parameters on the meta device must come from ``zero.Init`` (which keeps their values)."""
    empty = [n for n, p in model.named_parameters() if p.is_meta and stash_of(p) is None]
    if empty:
        raise ValueError(
            f"parameters on the meta device have no values to shard: {', '.join(empty[:5])}"
            f"{' ...' if len(empty) > 5 else ''}; build the model under shardwise.zero.Init "
            "(which keeps each rank's part of the real values) or materialise it before initialize"
        )


def _broadcast_whole(params: Iterable[nn.Parameter], policy: ShardPolicy) -> None:
    """Step 1: every rank takes the first data-parallel rank's whole values; with expert parallelism,
    expert parameters the first rank's of their expert-data-parallel group (the other expert-parallel
    ranks hold other experts)."""
    experts = policy.experts
    with torch.no_grad():
        for p in params:
            if stash_of(p) is not None:
                continue
            if experts is not None and is_expert(p):
                if experts.size > 1:
                    src = comm_init.group_source_rank(experts.group)
                    collectives.broadcast(p.data, src=src, group=experts.group)
            elif policy.world_size > 1:
                src = comm_init.group_source_rank(policy.process_group)
                collectives.broadcast(p.data, src=src, group=policy.process_group)


def _place_parameters(tracker: _Tracker, policy: ShardPolicy) -> list[nn.Parameter]:
    """Step 2: choose the unsharded parameters and give every parameter its device and dtype.

    Returns the unsharded ("persistent") parameters. Ordinary parameters keep their object
    (``p.data`` changes, so the user's references stay valid); persistent placeholders from
    ``zero.Init`` are gathered into new real parameters.
    """
    settings = policy.settings
    compute = policy.compute_dtype
    params = tracker.params
    # expert parameters (with expert parallelism) are always sharded, over their own group
    never = policy.experts is not None
    numels = [
        settings.persistence_threshold if never and is_expert(p) else (p.numel() if p.dim() > 0 else 0)
        for p in params
    ]
    chosen = set(
        choose_persistent(numels, settings.persistence_threshold, settings.model_persistence_threshold)
    )
    persistent: list[nn.Parameter] = []
    for index, p in enumerate(params):
        # scalars too (FSDP2 cannot shard them), and Muon's matrices (``use_muon``): its
        # Newton-Schulz step needs each whole, so they stay whole on every rank
        if index in chosen or p.dim() == 0 or getattr(p, "use_muon", False):
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
            tracker.replace(p, new)
            persistent.append(new)
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
    return persistent


def _place_buffers(model: nn.Module, policy: ShardPolicy) -> None:
    """Step 2 for buffers: all go to the device; a floating one changes dtype only where the policy's
    ``data_types`` says (by default each keeps its own, as in DeepSpeed)."""
    targets = buffer_targets(model, policy.compute_dtype, policy.buffer_dtype, policy.keep_in_fp32_modules)
    place_buffers(model, targets, policy.device)


@dataclass(frozen=True)
class _UnitPlan:
    """Which modules become shard units, their sizes and ``reshard_after_forward`` settings."""

    names: list[str]
    numels: list[int]
    reshard: list[bool | int]
    expert_units: frozenset[str] = frozenset()  # sharded over the expert-data-parallel mesh


def _plan_units(
    model: nn.Module, params: list[nn.Parameter], persistent: list[nn.Parameter], policy: ShardPolicy
) -> _UnitPlan:
    """Step 3: the shard units (wrap policy) and what each keeps gathered after forward."""
    settings = policy.settings
    persistent_ids = {id(p) for p in persistent}
    external = [p for p in params if is_external(p)]
    nodes = describe_modules(model, counted=lambda p: id(p) not in persistent_ids, external=external)
    rules = WrapRules(
        leaf_classes=settings.leaf_classes,
        leaf_names=tuple(settings.leaf_names) + leaf_module_names(model),  # + set_z3_leaf_modules
        leaf_suffixes=settings.leaf_suffixes,
        granularity_threshold=settings.granularity_threshold,
        leaf_unit_min_numel=settings.leaf_unit_min_numel,
    )
    names = choose_units(nodes, rules)
    numels = [nodes[n].numel for n in names]
    roots: list[str] = []
    if policy.experts is not None:  # expert parallelism: each expert root is a unit of its own
        roots = expert_roots(model, nodes)
        names, numels = merge_units(names, numels, roots, nodes, [n for n, _ in model.named_modules()])
    keep = reshard_plan(numels, settings.max_live_numel, settings.max_reuse_distance)
    hpz = settings.hpz_partition_size
    use_hpz = hpz_active(hpz, policy.world_size)  # ZeRO++ hpZ: FSDP2 reshards onto groups of hpz ranks
    reshard: list[bool | int] = [hpz if (r and use_hpz) else r for r in keep]
    return _UnitPlan(names, numels, reshard, frozenset(roots))


def _materialise(
    scope: nn.Module, tracker: _Tracker, policy: ShardPolicy
) -> list[tuple[nn.Module, str, Any]]:
    """Give ``zero.Init`` placeholders under ``scope`` (not yet sharded) full, uninitialised storage."""
    pending = []
    done: set[int] = set()
    for sub in scope.modules():
        for name, p in list(sub._parameters.items()):
            stash = None if p is None else stash_of(p)
            if p is None or stash is None or id(p) in done:
                continue
            dtype = torch.float32 if p.requires_grad else policy.compute_dtype
            new = _real(p, torch.empty(stash.shape, dtype=dtype, device=policy.device))
            done.add(id(p))
            pending.append((sub, name, stash))
            tracker.replace(p, new)
    return pending


def _fill(pending: list[tuple[nn.Module, str, Any]], compute: torch.dtype) -> None:
    """Copy each placeholder's kept chunk into its new local shard."""
    with torch.no_grad():
        for sub, name, stash in pending:
            param = sub._parameters[name]
            assert param is not None
            local = param.to_local()  # type: ignore[attr-defined]
            chunk = stash.shard
            chunk = chunk.to(compute).float() if param.requires_grad else chunk.to(local.dtype)
            local.copy_(chunk.reshape(local.shape))
            stash.release()  # a stash kept in a file (remote_device="nvme") frees its map here


def _apply_fully_shard(
    record: ShardedModel, plan: _UnitPlan, persistent: list[nn.Parameter], tracker: _Tracker
) -> None:
    """Step 4: ``fully_shard`` every unit, then the root; placeholders land in their shards."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    policy = record.policy
    compute = policy.compute_dtype
    model = record.module
    mesh = policy.mesh  # the topology's data-parallel mesh: nobody here makes groups of their own
    # cast_forward_inputs=False: like stages 0-2 (and DeepSpeed's stage 3), the engine casts no
    # inputs unless fp16.auto_cast asks (PrecisionPolicy.cast_forward_inputs). FSDP2's default
    # would round every floating-point forward argument to bf16/fp16 -- an fp32 target passed to
    # the loss inside forward() among them -- so the loss would differ from stage 2's.
    mp = MixedPrecisionPolicy(
        param_dtype=None if compute == torch.float32 else compute,
        reduce_dtype=policy.reduce_dtype,
        cast_forward_inputs=False,
    )
    offload: OffloadPolicy = OffloadPolicy()
    if policy.param_offload is not None:
        offload = CPUOffloadPolicy(
            pin_memory=policy.param_offload.pin and policy.param_offload.device == "cpu"
        )
    ignored = set(persistent)
    modules = dict(model.named_modules())
    targets: list[tuple[nn.Module, bool | int]] = [(modules[n], r) for n, r in zip(plan.names, plan.reshard)]
    # expert units first: they nest in dense units, and fully_shard wraps the inner modules first
    experts = {id(modules[n]) for n in plan.expert_units}
    expert_mesh = policy.experts.mesh if policy.experts is not None else None
    order = sorted(targets, key=lambda target: id(target[0]) not in experts)
    for module, reshard in [*order, (model, False)]:
        pending = _materialise(module, tracker, policy)
        fully_shard(
            module,
            mesh=expert_mesh if id(module) in experts else mesh,
            reshard_after_forward=reshard,
            mp_policy=mp,
            offload_policy=offload,
            ignored_params=ignored,
        )
        _fill(pending, compute)
        _evict_unit(record, module)
    record.units.extend(module for module, _ in targets)
    record.unit_names.extend(plan.names)
    record.reshard.extend(plan.reshard)


def _configure_reduction(record: ShardedModel) -> None:
    """Step 5: plain-sum reduction; on CPU, asynchronous gathers."""
    for fsdp_module in record.fsdp_modules():
        fsdp_module.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        fsdp_module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    if record.policy.device.type == "cpu":
        # Without streams (CPU, gloo) FSDP2's gathers block unless issued asynchronously;
        # with the explicit prefetch lists, an async gather runs in gloo's thread while the
        # previous unit computes (measured ~10% per step on the benchmark GPT).
        for fsdp_module in record.fsdp_modules():
            set_unshard_async(fsdp_module)


def _apply_prefetch(record: ShardedModel, unit_numels: list[int], settings: Stage3Settings) -> None:
    """Step 6: explicit forward/backward prefetch lists from the bucket size (or none at all)."""
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


def _record_parameters(record: ShardedModel, tracker: _Tracker) -> dict[int, nn.Parameter]:
    """Step 7: map originals to current parameters, sort them into sharded and unsharded, and
    set DeepSpeed's ``ds_*`` attributes. Returns the replaced originals (by id)."""
    model = record.module
    unit_param_ids = {id(p) for unit in record.units for p in unit.parameters()}
    record._root_params = {id(p) for p in model.parameters() if id(p) not in unit_param_ids}
    originals: dict[int, nn.Parameter] = {}
    for (ref, entry_owners), marks in zip(tracker.entries, tracker.marks):
        module, name = entry_owners[0]
        current = module._parameters[name]
        assert current is not None, "a parameter disappeared while sharding"
        for key, attr in marks.items():
            if not hasattr(current, key):
                setattr(current, key, attr)
        original = ref()
        if original is not None and original is not current:
            record._original[id(original)] = (ref, current)
            originals[id(original)] = original
            if stash_of(original) is None and original.data.numel() > 0:
                # the user may still hold the original object: free its full-size data
                original.data = torch.empty(0, dtype=original.dtype, device=original.device)
        for owner, owner_name in entry_owners:
            record.add_owner(current, owner, owner_name)
        current.ds_id = next(_IDS)  # type: ignore[attr-defined]
        current.ds_shape = current.shape  # type: ignore[attr-defined]
        current.ds_numel = current.numel()  # type: ignore[attr-defined]
        sharded = is_dtensor(current)
        # a detached alias of the local shard: a plain ``to_local()`` view would break (reading its
        # grad_fn raises) once the shard is written in place, e.g. by a checkpoint load
        local = current.to_local().detach() if sharded else current.data  # type: ignore[attr-defined]
        current.ds_tensor = local  # type: ignore[attr-defined]
        current.ds_status = ZeroParamStatus.NOT_AVAILABLE if sharded else ZeroParamStatus.AVAILABLE  # type: ignore[attr-defined]
        (record.sharded if sharded else record.replicated).append(current)
    order = {id(p): i for i, p in enumerate(model.parameters())}
    record.sharded.sort(key=lambda p: order.get(id(p), 0))
    record.replicated.sort(key=lambda p: order.get(id(p), 0))
    return originals


def _unit_params(module: nn.Module) -> list[nn.Parameter]:
    """The sharded parameters FSDP2 manages directly in ``module`` (not in nested units)."""
    return unit_sharded_params(module)


def _evict_unit(record: ShardedModel, module: nn.Module) -> None:
    """NVMe parameter offload: a unit just sharded goes to the swap file at once, so sharding a
    model larger than memory holds one unit's shards in memory at a time."""
    if record.swapper is None:
        return
    indices = record.swapper.add(_unit_params(module))
    record.unit_storages[id(module)] = indices
    record.swapper.evict(indices)


def _release_after_use(record: ShardedModel, module: nn.Module) -> None:
    """Release a unit's shard pages after its forward, and after its backward (a hook on the
    gradient of its inputs, which autograd computes once the unit's backward is done)."""

    def after_backward(_grad: torch.Tensor) -> None:
        record.release_pages(module)

    def before_forward(_m: nn.Module, args: tuple[object, ...]) -> None:
        if torch.is_grad_enabled():
            for arg in args:
                if isinstance(arg, torch.Tensor) and arg.requires_grad:
                    arg.register_hook(after_backward)
                    break

    module.register_forward_pre_hook(before_forward)
    module.register_forward_hook(lambda *_: record.release_pages(module))


def _attach_param_swapper(record: ShardedModel) -> None:
    """NVMe parameter offload: shards live in the swap file (each unit was evicted as it was
    sharded); forwards and backwards read them through their maps, one unit at a time."""
    if record.swapper is None:
        return
    record.swapper.add(record.sharded)  # any shard outside a unit's own parameters
    for module in record.fsdp_modules():
        if record.unit_storages.get(id(module)):
            _release_after_use(record, module)
    # a forward starts from the file's values: edits made to the maps since are discarded
    record.module.register_forward_pre_hook(lambda *_: record.release_pages(), prepend=True)
    record.module.register_state_dict_pre_hook(lambda *_args, **_kw: record.ensure_resident())
    record.evict()


def shard_model(model: nn.Module, policy: ShardPolicy) -> ShardedModel:
    """Apply FSDP2 to ``model`` in place following ``policy``; returns the record.

    Calling it again on the same model returns the first record.

    Example:
        >>> # record = shard_model(model, ShardPolicy(settings, torch.bfloat16, torch.float32, None, cpu, mesh))
        >>> # record.units -> the blocks; model is now an FSDP2 root module
    """
    existing = sharded_record(model)
    if existing is not None:
        return existing
    record = ShardedModel(model, policy)
    if policy.param_offload is not None and policy.param_offload.device == "nvme":
        record.swapper = ParamSwapper(policy.param_offload, policy.rank)
    with Init.paused():
        tracker = _Tracker(model)
        _refuse_meta_without_values(model)
        if policy.experts is not None:
            refuse_unshardable_experts(model.named_parameters(), zero_init=stash_of)
        _broadcast_whole(tracker.params, policy)
        persistent = _place_parameters(tracker, policy)
        _place_buffers(model, policy)
        plan = _plan_units(model, tracker.params, persistent, policy)
        _apply_fully_shard(record, plan, persistent, tracker)
    _configure_reduction(record)
    _apply_prefetch(record, plan.numels, policy.settings)
    originals = _record_parameters(record, tracker)
    _attach_param_swapper(record)
    register_record(record, originals)
    logger.info(
        "stage 3: %d shard units + root (%s), %d sharded and %d unsharded parameters",
        len(record.units),
        ", ".join(record.unit_names[:4]) + (" ..." if len(record.unit_names) > 4 else ""),
        len(record.sharded),
        len(record.replicated),
    )
    return record
