"""Who shards with whom: the one owner of the process layout, asked once.

:func:`build_topology` reads the layout from DeepSpeed's ``mpu`` interface (spec 6.8)
when the user passes one, and otherwise makes every rank a data-parallel rank of the
world. The result is a frozen :class:`Topology`: the degree of every named dimension
(:class:`~shardwise.comm.parallel_dims.ParallelDims`: ``dp_replicate``, ``dp_shard``,
``tp``, ``pp``, ``sp``, ``ep``), this rank's groups and ranks in them, and the device mesh
FSDP2 shards over (:meth:`Topology.data_parallel_mesh`). ZeRO, the batch arithmetic,
checkpoint naming and the ``utils.groups``-style accessors (:mod:`shardwise.comm.groups`)
read it instead of calling the mpu again or making groups of their own.

Three cases, as DeepSpeed distinguishes them (spec 1.3):

* no mpu: data parallel over the whole world (``dp_group=None`` means the world group);
* an mpu with ``get_data_parallel_world_size`` (Megatron-style tensor/pipeline parallel):
  dp and mp come from the mpu;
* an mpu *without* ``get_data_parallel_world_size``: a Ulysses sequence-parallel mpu.
  The data-parallel degree for batch arithmetic is ``world / sp``. ZeRO then shards and
  reduces over the sequence-data-parallel group (every rank that holds the same model
  replica slice, dp x sp ranks), which ``shard_group`` names. DeepSpeed computes the
  degree as a float; we require ``world`` to be divisible by ``sp`` and say so otherwise.

Example:
    >>> from shardwise.comm.topology import build_topology
    >>> topo = build_topology()  # no process group: a world of one
    >>> (topo.world_size, topo.dp_size, topo.dp_rank, topo.mp_size)
    (1, 1, 0, 1)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from shardwise.comm.group_type import Group
from shardwise.comm.init import get_rank, get_world_group, get_world_size, group_ranks
from shardwise.comm.parallel_dims import GROUP_DIMS, ParallelDims

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParallelDims", "Topology", "build_topology"]


@dataclass(frozen=True)
class Topology:
    """This rank's place in the parallel layout.

    A group of ``None`` means the world group (torch's convention), so it can be passed
    straight to collectives. Under Ulysses the mpu names no data-parallel group: ``dp_group``
    is None and only ``dp_size``/``dp_rank`` are meaningful (batch arithmetic and which
    batch slice to load; sequence-parallel groups are taken to be consecutive ranks, as
    Ulysses builds them); collectives use ``shard_group``.

    Attributes:
        world_rank: global rank.
        world_size: number of ranks in the job.
        dp_group: data-parallel group (None: the world).
        dp_rank: rank in the data-parallel group.
        dp_size: data-parallel degree; the ``world_size`` of DeepSpeed's batch arithmetic.
        mp_group: model-parallel group (None when there is no model parallelism).
        mp_rank: rank in the model-parallel group (names checkpoint files).
        mp_size: model-parallel degree.
        sp_group: sequence-parallel group (None without Ulysses).
        sp_rank: rank in the sequence-parallel group.
        sp_size: sequence-parallel degree.
        shard_group: the group ZeRO partitions over and averages gradients across
            (``dp_group``, or the sequence-data-parallel group under Ulysses).
        shard_rank: rank in ``shard_group``.
        shard_size: size of ``shard_group``.
        dims: the degree of every named dimension (``dp_replicate`` x ``dp_shard`` x ``tp``
            x ``pp`` x ``sp`` = ``world_size``): what :func:`shardwise.comm.mesh.ensure_layout`
            built, or what an mpu reports.
        groups: for a layout built by :mod:`shardwise.comm.mesh`, every named dimension
            (:data:`~shardwise.comm.parallel_dims.GROUP_DIMS`) -> this rank's group and its
            global ranks; empty for a layout read from an mpu (the fields above answer).
    """

    world_rank: int = 0
    world_size: int = 1
    dp_group: dist.ProcessGroup | None = None
    dp_rank: int = 0
    dp_size: int = 1
    mp_group: dist.ProcessGroup | None = None
    mp_rank: int = 0
    mp_size: int = 1
    sp_group: dist.ProcessGroup | None = None
    sp_rank: int = 0
    sp_size: int = 1
    shard_group: dist.ProcessGroup | None = None
    shard_rank: int = 0
    shard_size: int = 1
    dims: ParallelDims = field(default_factory=ParallelDims)
    groups: Mapping[str, tuple[Group, tuple[int, ...]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Internal invariants: build_topology validated user-facing values already.
        for name in ("world", "dp", "mp", "sp", "shard"):
            rank, size = getattr(self, f"{name}_rank"), getattr(self, f"{name}_size")
            assert size >= 1 and 0 <= rank < size, f"rank{self.world_rank}: {name} rank {rank} of size {size}"
        dims = self.dims
        assert dims.world_size == self.world_size, (
            f"dims for {dims.world_size} ranks in a world of {self.world_size}"
        )
        assert (dims.dp, dims.sp) == (self.dp_size, self.sp_size), (dims, self)

    def _field_of(self, dim: str) -> tuple[Group, int, int] | None:
        """(group, rank, size) from the named fields, for the dimensions every layout has."""
        name = {"dp": "dp", "tp": "mp", "mp": "mp", "sp": "sp", "sdp": "shard"}.get(dim)
        if name is None:
            return None
        return getattr(self, f"{name}_group"), getattr(self, f"{name}_rank"), getattr(self, f"{name}_size")

    def _unknown(self, dim: str) -> ValueError:
        if dim not in GROUP_DIMS:
            return ValueError(f"unknown parallel dimension {dim!r}; known: {', '.join(GROUP_DIMS)}")
        return ValueError(
            f"dimension {dim!r} has no group in a layout read from an mpu (degrees {self.dims}); "
            "declare the layout with shardwise.comm.mesh.ensure_layout instead of passing an mpu"
        )

    def size_of(self, dim: str) -> int:
        """The size of this rank's group of dimension ``dim`` (see :data:`GROUP_DIMS`)."""
        if dim in self.groups:
            return len(self.groups[dim][1])
        known = self._field_of(dim)
        if known is not None:
            return known[2]
        if dim in ("pp", "dp_replicate", "dp_shard", "ep") and dim in GROUP_DIMS:
            return int(getattr(self.dims, dim))
        raise self._unknown(dim)

    def rank_in(self, dim: str) -> int:
        """This rank's place in its group of dimension ``dim``."""
        if dim in self.groups:
            return self.groups[dim][1].index(self.world_rank)
        known = self._field_of(dim)
        if known is not None:
            return known[1]
        if self.size_of(dim) == 1:
            return 0
        raise self._unknown(dim)

    def group_of(self, dim: str) -> Group:
        """This rank's process group of dimension ``dim``: None when the group is the whole world,
        and (by the convention of :mod:`shardwise.comm.groups`) when the dimension has size 1,
        so ask :meth:`size_of` before handing it to a collective."""
        if dim in self.groups:
            group, ranks = self.groups[dim]
            return None if len(ranks) == 1 else group
        known = self._field_of(dim)
        if known is not None:
            return known[0]
        if self.size_of(dim) == 1:
            return None
        raise self._unknown(dim)

    def ranks_of(self, dim: str) -> tuple[int, ...]:
        """The global ranks of this rank's group of dimension ``dim``, in group-rank order."""
        if dim in self.groups:
            return self.groups[dim][1]
        if self.size_of(dim) == 1:
            return (self.world_rank,)
        group = self.group_of(dim)
        ranks = group_ranks(group)
        return tuple(ranks) if ranks is not None else tuple(range(self.world_size))

    def device_mesh(self, device_type: str) -> DeviceMesh:
        """A ``DeviceMesh`` over this layout's non-trivial dimensions (``dp_shard`` always),
        named as in :data:`~shardwise.comm.parallel_dims.MESH_ORDER`, made from the layout's own
        groups (no new ones): ``mesh["dp_shard"]`` for FSDP2, ``mesh["tp"]`` for DTensor.

        Only for a layout built by :mod:`shardwise.comm.mesh`; a 1-D data-parallel layout
        gives the same mesh as :meth:`data_parallel_mesh`.
        """
        from torch import arange
        from torch.distributed.device_mesh import DeviceMesh

        used = [(name, size) for name, size in self.dims.mesh_dims() if size > 1]
        if len(used) <= 1 and self.dims.dp_shard == self.world_size:
            return self.data_parallel_mesh(device_type)
        if not self.groups:
            raise self._unknown(used[0][0])
        names = [name for name, _ in used]
        pgs = [self.groups[name][0] or get_world_group() for name in names]
        layout = arange(self.world_size).reshape([size for _, size in used])
        return DeviceMesh.from_group(pgs, device_type, mesh=layout, mesh_dim_names=tuple(names))

    def data_parallel_mesh(self, device_type: str) -> DeviceMesh:
        """The 1-D ``DeviceMesh`` named ``dp_shard`` over the data-parallel group (the world when None).

        FSDP2 (stage 3) shards over it; hpZ's secondary groups are its runs
        (``dims.dp_shard_runs``), which FSDP2 forms itself from ``reshard_after_forward=k``.
        """
        from torch.distributed.device_mesh import DeviceMesh

        group = self.dp_group if self.dp_group is not None else get_world_group()
        return DeviceMesh.from_group(group, device_type, mesh_dim_names=("dp_shard",))


def _call(mpu: object, name: str, default: object = None) -> Any:
    method = getattr(mpu, name, None)
    return method() if callable(method) else default


def _require(mpu: object, names: tuple[str, ...], why: str) -> None:
    missing = [n for n in names if not callable(getattr(mpu, n, None))]
    if missing:
        raise ValueError(
            f"the mpu object {type(mpu).__name__} lacks {', '.join(missing)}: {why}. Implement "
            "DeepSpeed's mpu interface (get_data_parallel_{group,rank,world_size} and "
            "get_model_parallel_{group,rank,world_size}), or pass mpu=None for pure data parallelism"
        )


def _positive(value: object, what: str, mpu: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"mpu {type(mpu).__name__}: {what} returned {value!r}; it must be an int >= 1")
    return value


def _rank_in(value: object, size: int, what: str, mpu: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
        raise ValueError(f"mpu {type(mpu).__name__}: {what} returned {value!r}; it must be in [0, {size})")
    return value


def build_topology(mpu: Any = None) -> Topology:
    """Read the parallel layout from ``mpu`` (DeepSpeed's interface) or the world.

    Args:
        mpu: None for pure data parallelism, or an object with DeepSpeed's mpu methods
            (``get_data_parallel_{group,rank,world_size}``,
            ``get_model_parallel_{group,rank,world_size}``), or a Ulysses mpu with
            ``get_sequence_parallel_{group,rank,world_size}`` (and optionally
            ``get_sequence_data_parallel_{group,rank,world_size}``).

    Returns:
        The frozen layout. Without a process group: rank 0 of a world of one.

    Raises:
        ValueError: the mpu lacks required methods, returns invalid sizes or ranks, or
            (Ulysses) the world size is not divisible by the sequence-parallel size.

    Example:
        >>> class DataParallelOnly:  # what a Megatron-style mpu provides
        ...     def get_data_parallel_group(self): return None
        ...     def get_data_parallel_rank(self): return 0
        ...     def get_data_parallel_world_size(self): return 1
        ...     def get_model_parallel_group(self): return None
        ...     def get_model_parallel_rank(self): return 0
        ...     def get_model_parallel_world_size(self): return 1
        >>> build_topology(DataParallelOnly()).dp_size
        1
    """
    world_rank, world_size = get_rank(), get_world_size()
    if mpu is None:
        return Topology(
            world_rank=world_rank,
            world_size=world_size,
            dp_rank=world_rank,
            dp_size=world_size,
            shard_rank=world_rank,
            shard_size=world_size,
            dims=ParallelDims(dp_shard=world_size, world_size=world_size),
        )

    mp_size = _positive(
        _call(mpu, "get_model_parallel_world_size", 1), "get_model_parallel_world_size()", mpu
    )
    mp_rank = _rank_in(_call(mpu, "get_model_parallel_rank", 0), mp_size, "get_model_parallel_rank()", mpu)
    mp_group = _call(mpu, "get_model_parallel_group") if mp_size > 1 else None

    if callable(getattr(mpu, "get_data_parallel_world_size", None)):
        _require(
            mpu,
            ("get_data_parallel_group", "get_data_parallel_rank"),
            "ZeRO needs the data-parallel group and this rank's place in it",
        )
        dp_size = _positive(mpu.get_data_parallel_world_size(), "get_data_parallel_world_size()", mpu)
        dp_rank = _rank_in(mpu.get_data_parallel_rank(), dp_size, "get_data_parallel_rank()", mpu)
        dp_group = mpu.get_data_parallel_group()
        return Topology(
            world_rank=world_rank,
            world_size=world_size,
            dp_group=dp_group,
            dp_rank=dp_rank,
            dp_size=dp_size,
            mp_group=mp_group,
            mp_rank=mp_rank,
            mp_size=mp_size,
            shard_group=dp_group,
            shard_rank=dp_rank,
            shard_size=dp_size,
            dims=_megatron_dims(dp_size, mp_size, world_size, mpu),
        )

    # Ulysses: no data-parallel methods; the dp degree is what sequence parallelism leaves.
    _require(
        mpu,
        ("get_sequence_parallel_world_size",),
        "an mpu without get_data_parallel_world_size is read as a Ulysses sequence-parallel mpu",
    )
    sp_size = _positive(mpu.get_sequence_parallel_world_size(), "get_sequence_parallel_world_size()", mpu)
    if world_size % sp_size:
        raise ValueError(
            f"world size {world_size} is not divisible by the sequence-parallel size {sp_size} reported by "
            f"{type(mpu).__name__}: launch a multiple of {sp_size} ranks"
        )
    sp_rank = _rank_in(
        _call(mpu, "get_sequence_parallel_rank", 0), sp_size, "get_sequence_parallel_rank()", mpu
    )
    if callable(getattr(mpu, "get_sequence_data_parallel_world_size", None)):
        _require(
            mpu,
            ("get_sequence_data_parallel_group", "get_sequence_data_parallel_rank"),
            "ZeRO shards over the sequence-data-parallel group under Ulysses",
        )
        shard_size = _positive(
            mpu.get_sequence_data_parallel_world_size(), "get_sequence_data_parallel_world_size()", mpu
        )
        shard_rank = _rank_in(
            mpu.get_sequence_data_parallel_rank(), shard_size, "get_sequence_data_parallel_rank()", mpu
        )
        shard_group = mpu.get_sequence_data_parallel_group()
    else:
        shard_size, shard_rank, shard_group = world_size, world_rank, None
    dp_size = world_size // sp_size
    return Topology(
        world_rank=world_rank,
        world_size=world_size,
        dp_group=None,
        dp_rank=world_rank // sp_size,
        dp_size=dp_size,
        mp_group=mp_group,
        mp_rank=mp_rank,
        mp_size=mp_size,
        sp_group=_call(mpu, "get_sequence_parallel_group"),
        sp_rank=sp_rank,
        sp_size=sp_size,
        shard_group=shard_group,
        shard_rank=shard_rank,
        shard_size=shard_size,
        dims=_ulysses_dims(dp_size, sp_size, world_size),
    )


def _megatron_dims(dp: int, mp: int, world: int, mpu: object) -> ParallelDims:
    """Megatron-style mpu: dp x tp ranks per pipeline stage; what is left of the world is ``pp``."""
    if world % (dp * mp):
        raise ValueError(
            f"mpu {type(mpu).__name__}: data-parallel size {dp} x model-parallel size {mp} does not divide "
            f"the world size {world}; the mpu's groups must tile the world"
        )
    return ParallelDims(dp_shard=dp, tp=mp, pp=world // (dp * mp), world_size=world)


def _ulysses_dims(dp: int, sp: int, world: int) -> ParallelDims:
    """Ulysses mpu: ``world / sp`` data-parallel ranks (DeepSpeed's arithmetic; a model-parallel
    size such an mpu reports names checkpoint files only, as before: it is no mesh dimension)."""
    return ParallelDims(dp_shard=dp, sp=sp, world_size=world)
