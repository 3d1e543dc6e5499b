"""``zero.Init``, ``zero.GatheredParameters`` and ``register_external_parameter``.

``Init`` builds a model without ever holding it whole: as each submodule is attached to
its parent (its own ``__init__`` has run, so its parameters hold their initial values),
each parameter is broadcast from the first data-parallel rank, the rank keeps only its
dim-0 chunk (FSDP2's chunking, so the chunk is exactly the shard ``initialize`` will
need), and the module gets a **meta-device** placeholder with the full shape. Peak memory
is one submodule's parameters. ``initialize`` then materialises the model sharded: each
shard unit gets real storage for its own chunk only, filled from the kept chunk.

With ``remote_device="nvme"`` (DeepSpeed's ZeRO-Infinity construction) each chunk goes to a
file under ``zero_optimization.offload_param.nvme_path`` as soon as it is made and is kept as a
private map of that file: memory the kernel can drop, so a model larger than memory can be
built (``initialize`` copies each unit's chunks into its shards, then releases them). Without
that key the Init raises, naming it. The Init holds the original parameters weakly.

As in DeepSpeed, code in a parent's ``__init__`` that touches a child's parameters after
the child is attached (a custom ``self.apply(init_fn)``) sees placeholders, and its
in-place initialisers do nothing: wrap such code in ``GatheredParameters(...,
modifier_rank=0)``. Unlike DeepSpeed, placeholders keep their real shape
(``p.shape``, ``p.numel()`` work), and ``p.ds_shape``/``ds_numel``/``ds_tensor`` are
provided for code written against DeepSpeed. Calling ``model.to(device)`` on a model
with placeholders fails (there is no data to move); ``initialize`` places the model.

``GatheredParameters`` works on placeholders (before ``initialize``), on FSDP2's sharded
parameters (after) and on ordinary parameters (a no-op, as in DeepSpeed, except stage 3's
unsharded small parameters, which are broadcast from ``modifier_rank``). Inside the
block, the modules that own the parameters hold full, ordinary tensors.

``register_external_parameter(module, param)``: FSDP2 needs no hooks for a parameter
used by a module that does not own it, as long as the parameter is gathered when that
module runs. Registering it before ``initialize`` keeps it in the root shard unit, which
stays gathered through forward and backward. After ``initialize`` it is a no-op when
that already holds, and an error otherwise.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from shardwise.comm import collectives, groups
from shardwise.comm import init as comm_init
from shardwise.comm.fsdp_internals import dtensor_group, is_dtensor
from shardwise.comm.group_type import Group
from shardwise.zero.external_params import (
    is_external,
    register_external_parameter,
    unregister_external_parameter,
)
from shardwise.zero.init_config import config_dtype, file_stash
from shardwise.zero.param_owner import owner_of
from shardwise.zero.placeholders import (
    Stash,
    _chunk,
    _ensure_owner_hook,
    _record_owner,
    _set_on_owners,
    gather_stash,
    owners_of,
    stash_of,
)
from shardwise.zero.sharded_model import record_of

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "is_external",
    "register_external_parameter",
    "unregister_external_parameter",
]

_IDS = itertools.count()


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's parameter states (``param.ds_status``)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


# --------------------------------------------------------------------------- Init


def _data_parallel_group(data_parallel_group: Group, mpu: object) -> Group:
    if data_parallel_group is not None:
        return data_parallel_group
    if mpu is not None and hasattr(mpu, "get_data_parallel_group"):
        return mpu.get_data_parallel_group()
    return groups.get_data_parallel_group()  # the registered layout's (the world's before initialize)


class Init:
    """Build a model partitioned from the start (DeepSpeed's ``deepspeed.zero.Init``).

    Example:
        >>> # with shardwise.zero.Init(config_dict_or_path="ds_config.json"):
        >>> #     model = MyModel()          # parameters are meta placeholders + local chunks
        >>> # engine, *_ = shardwise.initialize(model=model, config="ds_config.json")
    """

    _active: list[Init] = []

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Group = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Group = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Group = None,
        param_swapper: Any = None,
    ) -> None:
        self.enabled = enabled
        if remote_device not in (None, "cpu", "nvme", "none"):
            raise ValueError(f"zero.Init(remote_device={remote_device!r}): use None, 'cpu' or 'nvme'")
        if zero_quantized_weights or zero_quantized_nontrainable_weights:
            raise ValueError("zero.Init: quantized weights (ZeRO++) are not supported; drop the flag")
        if not enabled:
            return
        if not comm_init.is_initialized():
            comm_init.init_distributed()
        self.group = _data_parallel_group(data_parallel_group or sequence_data_parallel_group, mpu)
        self.world = comm_init.get_world_size(self.group)
        self.rank = comm_init.get_rank(self.group)
        self.source = comm_init.group_source_rank(self.group)
        self.dtype = dtype or config_dtype(config_dict_or_path if config_dict_or_path is not None else config)
        # id(original) -> (original, held weakly so its memory goes as soon as the module lets
        # go of it, and its placeholder); a dead original's reused id never matches
        self._replacements: dict[int, tuple[weakref.ref[nn.Parameter], nn.Parameter]] = {}
        self._file_stash = file_stash(
            remote_device, config_dict_or_path if config is None else config, self.rank
        )
        self._modules: list[weakref.ref[nn.Module]] = []
        self._handles: list[Any] = []
        _ensure_owner_hook()
        if module is not None:
            self.partition_module(module)

    # ------------------------------------------------------------------ context
    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        self._handles = [
            register_module_module_registration_hook(self._on_child),
            register_module_parameter_registration_hook(self._on_param),  # type: ignore[arg-type]
        ]
        Init._active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self in Init._active:
            Init._active.remove(self)
        if exc[0] is None:
            for ref in self._modules:
                module = ref()
                if module is not None:
                    self._partition_direct(module)
        self._replacements.clear()
        self._modules = []
        if self._file_stash is not None:
            self._file_stash.seal()  # the chunks' maps keep their bytes; the file name goes

    @classmethod
    @contextlib.contextmanager
    def paused(cls) -> Iterator[None]:
        """Suspend every active Init (``initialize`` builds its own objects in here)."""
        active = list(cls._active)
        for ctx in active:
            for handle in ctx._handles:
                handle.remove()
            ctx._handles = []
        try:
            yield
        finally:
            for ctx in active:
                ctx._handles = [
                    register_module_module_registration_hook(ctx._on_child),
                    register_module_parameter_registration_hook(ctx._on_param),  # type: ignore[arg-type]
                ]

    # ------------------------------------------------------------------ hooks
    def _on_child(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        if child is not None:
            self.partition_module(child)

    def _on_param(self, module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None:
            return None
        self._modules.append(weakref.ref(module))
        pair = self._replacements.get(id(param))
        if pair is not None and pair[0]() is param:
            _record_owner(module, name, pair[1])
            return pair[1]  # an already-partitioned parameter tied to one more module
        return None

    # ------------------------------------------------------------------ partitioning
    def partition_module(self, module: nn.Module) -> None:
        """Partition every parameter under ``module`` that is still whole."""
        for sub in module.modules():
            self._partition_direct(sub)

    def _partition_direct(self, module: nn.Module) -> None:
        for name, param in list(module._parameters.items()):
            if param is None or stash_of(param) is not None or param.dim() == 0:
                continue  # scalars cannot be sharded (FSDP2 refuses them): kept whole
            pair = self._replacements.get(id(param))
            placeholder = pair[1] if pair is not None and pair[0]() is param else self._partition(param)
            module._parameters[name] = placeholder
            _record_owner(module, name, placeholder)

    def _partition(self, param: nn.Parameter) -> nn.Parameter:
        with torch.no_grad():
            full = param.detach()
            if self.dtype is not None and full.is_floating_point() and full.dtype != self.dtype:
                full = full.to(self.dtype)
            full = full.contiguous()
            if self.world > 1:
                collectives.broadcast(full, src=self.source, group=self.group)
            shard = _chunk(full, self.world, self.rank).clone()
            mapping = None
            if self._file_stash is not None:
                shard, mapping = self._file_stash.put(shard)
        placeholder = nn.Parameter(
            torch.empty(full.shape, dtype=full.dtype, device="meta"), requires_grad=param.requires_grad
        )
        for key, value in vars(param).items():
            if not key.startswith("_shardwise"):
                setattr(placeholder, key, value)
        stash = Stash(shard, full.shape, full.dtype, self.group, self.world, self.rank, mapping)
        stash.placeholder = weakref.ref(placeholder)
        placeholder._shardwise_stash = stash  # type: ignore[attr-defined]
        placeholder.ds_id = next(_IDS)  # type: ignore[attr-defined]
        placeholder.ds_shape = full.shape  # type: ignore[attr-defined]
        placeholder.ds_numel = full.numel()  # type: ignore[attr-defined]
        placeholder.ds_tensor = shard  # type: ignore[attr-defined]
        placeholder.ds_status = ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]
        self._replacements[id(param)] = (weakref.ref(param), placeholder)
        return placeholder


# --------------------------------------------------------------------------- GatheredParameters


def _as_list(params: Any) -> list[nn.Parameter]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]  # type: ignore[list-item]
    return [p for p in params if p is not None]


def _group_of(param: torch.Tensor) -> Group:
    stash = stash_of(param)
    if stash is not None:
        return stash.group
    if _is_sharded(param):
        return dtensor_group(param)
    record = record_of(param)
    return None if record is None else record.process_group


def _is_sharded(param: torch.Tensor) -> bool:
    return is_dtensor(param)


_DS_IDENTITY = ("ds_id", "ds_shape", "ds_numel", "ds_tensor")


def _mark_available(gathered: nn.Parameter, param: nn.Parameter) -> None:
    """The whole copy a block's module holds carries the sharded parameter's identity (``ds_id``,
    ``ds_shape``, ``ds_numel``, ``ds_tensor``) and ``ds_status`` AVAILABLE, as DeepSpeed's parameter
    reads inside the block; the sharded original keeps NOT_AVAILABLE (its data is still the shard)."""
    for name in _DS_IDENTITY:
        if hasattr(param, name):
            setattr(gathered, name, getattr(param, name))
    gathered.ds_status = ZeroParamStatus.AVAILABLE  # type: ignore[attr-defined]


class GatheredParameters:
    """Gather full parameters for the block; optionally keep one rank's edits.

    Args:
        params: a parameter or an iterable of them (placeholders, sharded or ordinary).
        modifier_rank: the rank whose in-block changes are broadcast and kept, as DeepSpeed counts it:
            a world rank for parameters partitioned over every rank, else the rank within the
            parameter's own group (its data-parallel group beside tensor or pipeline parallelism,
            its expert-data-parallel group for an expert at stage 3). None discards changes.
        fwd_module: registers the parameters as external parameters of this module.
        enabled: False makes the block a no-op.

    Collective: every rank of the data-parallel group must enter it.

    Example:
        >>> # with shardwise.zero.GatheredParameters(model.embed.weight, modifier_rank=0):
        >>> #     if torch.distributed.get_rank() == 0:
        >>> #         model.embed.weight[:10].zero_()
    """

    def __init__(
        self,
        params: Any,
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        self.params = _as_list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._swapped: list[tuple[nn.Parameter, nn.Parameter, list[tuple[nn.Module, str]]]] = []
        if fwd_module is not None:
            for p in self.params:
                register_external_parameter(fwd_module, p)

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        seen: set[int] = set()
        for param in self.params:
            if id(param) in seen:
                continue
            seen.add(id(param))
            owner = owner_of(param)
            if owner is not None:
                owner.wait_for_parameters()  # stages 1-2, overlap_comm: the post-step gather in flight
            full = self._gather(param)
            if full is None:
                continue
            owners = owners_of(param)
            gathered = nn.Parameter(full, requires_grad=param.requires_grad)
            _mark_available(gathered, param)
            _set_on_owners(owners, gathered)
            self._swapped.append((param, gathered, owners))
        return self

    @staticmethod
    def _gather(param: nn.Parameter) -> torch.Tensor | None:
        stash = stash_of(param)
        if stash is not None:
            return gather_stash(stash)
        if _is_sharded(param):
            record = record_of(param)
            if record is not None:
                record.ensure_resident()
            with torch.no_grad():
                return param.detach().full_tensor().clone()  # type: ignore[attr-defined]
        return None

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        keep = self.modifier_rank is not None and exc[0] is None
        try:
            for param, gathered, owners in self._swapped:
                if keep:
                    full = gathered.detach()
                    if comm_init.get_world_size() > 1:
                        group = _group_of(param)
                        collectives.broadcast(full, src=self._source(group), group=group)
                    self._scatter_back(param, full)
                _set_on_owners(owners, param)
            if keep:
                self._broadcast_replicated()
        finally:
            self._swapped = []

    @staticmethod
    def _scatter_back(param: nn.Parameter, full: torch.Tensor) -> None:
        stash = stash_of(param)
        with torch.no_grad():
            if stash is not None:
                stash.shard.copy_(_chunk(full.to(stash.dtype), stash.world, stash.rank))
                return
            local = param.to_local()  # type: ignore[attr-defined]
            mesh = param.device_mesh  # type: ignore[attr-defined]
            rank = mesh.get_local_rank()
            local.copy_(_chunk(full.to(local.dtype), mesh.size(), rank))

    def _source(self, group: Group) -> int:
        """The world rank of ``modifier_rank`` for a parameter partitioned over ``group``."""
        rank = int(self.modifier_rank)  # type: ignore[arg-type]
        size = comm_init.get_world_size(group)
        if not 0 <= rank < size:
            raise ValueError(f"GatheredParameters: modifier_rank={rank} is not a rank of the parameter's group of "
                             f"{size}; fix: name a rank from 0 to {size - 1} (within the parameter's group when it "
                             "is not partitioned over every rank)")
        if group is None or size == comm_init.get_world_size():
            return rank
        return comm_init.get_global_rank(group, rank)

    def _broadcast_replicated(self) -> None:
        """Stage 3's unsharded small parameters: keep the modifier's values everywhere."""
        if comm_init.get_world_size() <= 1:
            return
        for param in self.params:
            record = record_of(param)
            if record is None or _is_sharded(param) or stash_of(param) is not None:
                continue
            with torch.no_grad():
                group = _group_of(param)
                collectives.broadcast(param.data, src=self._source(group), group=group)
            record.refresh_replicated(param)
