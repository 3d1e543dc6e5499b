"""What sharding a model for stage 3 produced, and how to find it from a parameter.

:func:`shardwise.zero.fsdp_wrap.shard_model` returns a :class:`ShardedModel`; ``initialize``
hands it to the optimizer factory (``zero.factory.build_zero_optimizer``). Code that starts
from a parameter (``GatheredParameters``, ``register_external_parameter``) looks the record
up with :func:`record_of`: an explicit registry that holds parameters and modules weakly and
the record weakly too, so it never keeps a model alive. The root module keeps its record
alive (``module._shardwise_stage3``, set by ``shard_model``), so the record lives exactly as
long as the sharded model does, or longer if an optimizer holds it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from shardwise.comm.fsdp_internals import is_dtensor
from shardwise.comm.group_type import Group
from shardwise.zero.offload_spec import OffloadSpec
from shardwise.zero.param_swap import ParamSwapper
from shardwise.zero.stage3_settings import Stage3Settings

if TYPE_CHECKING:
    from shardwise.zero.expert_units import ExpertSharding

OwnerRefs = list[tuple["weakref.ref[nn.Module]", str]]
_ANCHOR = "_shardwise_stage3"


@dataclass(frozen=True)
class ShardPolicy:
    """Everything :func:`shardwise.zero.fsdp_wrap.shard_model` needs, decided once by the factory."""

    settings: Stage3Settings
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    process_group: Group
    device: torch.device
    mesh: Any  # the topology's ``dp_shard`` DeviceMesh, which fully_shard shards over
    param_offload: OffloadSpec | None = None
    rank: int = 0
    world_size: int = 1
    experts: ExpertSharding | None = None  # with expert parallelism: where experts shard (zero.expert_units)
    buffer_dtype: torch.dtype | None = None  # data_types.buffer_dtype (precision.buffer_dtypes)
    keep_in_fp32_modules: str | list[str] = "auto"  # data_types.keep_in_fp32_modules


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
        self._owners: WeakIdKeyDictionary = WeakIdKeyDictionary()  # current parameter -> OwnerRefs
        self._root_params: set[int] = set()
        self.swapper: ParamSwapper | None = None
        self.unit_storages: dict[int, list[int]] = {}  # id(FSDP module) -> its swapped storages
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
        return id(param) in self._root_params or not is_dtensor(param)

    def owner_refs(self, param: nn.Parameter) -> OwnerRefs:
        """Weak ``(module, name)`` pairs that registered ``param`` when it was sharded, or since."""
        return list(self._owners.get(param, []))

    def add_owner(self, param: nn.Parameter, module: nn.Module, name: str) -> None:
        """Record one more module registering a current parameter (a tie made after sharding)."""
        refs = self._owners.setdefault(param, [])
        if not any(ref() is module and n == name for ref, n in refs):
            refs.append((weakref.ref(module), name))

    # ------------------------------------------------------------------ NVMe parameter offload
    def ensure_resident(self) -> None:
        """NVMe parameter offload: bring the shards back into memory."""
        if self.swapper is not None:
            self.swapper.restore()

    def evict(self) -> None:
        """NVMe parameter offload: write the shards to their file and free the memory."""
        if self.swapper is not None:
            self.swapper.evict()

    def release_pages(self, module: nn.Module | None = None) -> None:
        """NVMe parameter offload: release the memory pages of one FSDP module's shards (default:
        every shard). Values stay in the file; edits made to the maps are discarded."""
        if self.swapper is None:
            return
        if module is None:
            self.swapper.drop_pages(range(len(self.swapper.storages)))
        else:
            self.swapper.drop_pages(self.unit_storages.get(id(module), []))

    def refresh_replicated(self, param: nn.Parameter) -> None:
        """An unsharded parameter was edited in place: its fp32 master must follow."""
        if self.replicated_listener is not None:
            self.replicated_listener(param)

    def fsdp_modules(self) -> list[nn.Module]:
        """Every module ``fully_shard`` was applied to (units, then the root)."""
        return [*self.units, self.module]


# parameter (current or the user's original) or root module -> its record, all weak
_REGISTRY: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_record(record: ShardedModel, originals: dict[int, nn.Parameter] | None = None) -> None:
    """Make ``record`` findable from its root module and from every parameter it maps.

    The root module keeps the record alive; the registry holds everything weakly.
    """
    ref = weakref.ref(record)
    setattr(record.module, _ANCHOR, record)
    _REGISTRY[record.module] = ref
    for param in [*record.sharded, *record.replicated, *(originals or {}).values()]:
        _REGISTRY[param] = ref


def record_of(obj: torch.Tensor | nn.Module) -> ShardedModel | None:
    """The :class:`ShardedModel` a parameter or a root module belongs to; None when not sharded.

    Works for the parameters stage 3 installed and for the user's original parameter objects
    it replaced.

    Example:
        >>> import torch
        >>> record_of(torch.nn.Linear(2, 2).weight) is None
        True
    """
    ref = _REGISTRY.get(obj)
    return None if ref is None else ref()
