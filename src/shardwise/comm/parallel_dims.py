"""The parallel degrees of one job, by named dimension (pure: no torch).

Every kind of parallelism the engine knows is one named dimension of a single layout, the
shape torchtitan gives its ``ParallelDims``:

========================  ==========================================================
``dp_replicate``          data parallel, parameters replicated (HSDP's outer dimension)
``dp_shard``              data parallel, parameters sharded (ZeRO / FSDP2's dimension)
``tp``                    tensor (model) parallel
``pp``                    pipeline parallel
``sp``                    sequence parallel (Ulysses)
``ep``                    expert parallel (borrows its ranks from ``dp_shard x sp``, or from
                          ``dp_shard x sp x tp`` when ``fold_ep``: AutoEP folded over AutoTP)
========================  ==========================================================

``dp_replicate x dp_shard x tp x pp x sp`` is the world size. The pipeline, tensor,
sequence and expert features declare their degree through :mod:`shardwise.comm.mesh`, which
builds the groups from :meth:`ParallelDims.rank_groups`; none makes groups of its own.

Example:
    >>> dims = ParallelDims(dp_shard=4, world_size=4)
    >>> dims.dp, dims.mesh_dims(), dims.dp_shard_runs(2)
    (4, (('dp_shard', 4),), [[0, 1], [2, 3]])
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from math import prod

__all__ = ["GROUP_DIMS", "MESH_ORDER", "ParallelDims"]

# Outermost first, as torchtitan orders its mesh: ranks that differ only in ``tp`` are
# neighbours (one node), ranks that differ in ``pp`` are furthest apart.
MESH_ORDER: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "sp", "tp")

# The mesh dimensions each named group spans (``ep``/``edp`` cut the ``sdp`` groups further).
_SPANS: dict[str, tuple[str, ...]] = {
    **{name: (name,) for name in MESH_ORDER},
    "dp": ("dp_replicate", "dp_shard"),
    "sdp": ("dp_replicate", "dp_shard", "sp"),
    "mp": ("tp",),
    "ep": ("dp_replicate", "dp_shard", "sp"),
    "edp": ("dp_replicate", "dp_shard", "sp"),
}
#: Every group name :meth:`ParallelDims.rank_groups` answers for.
GROUP_DIMS: tuple[str, ...] = tuple(_SPANS)


@dataclass(frozen=True)
class ParallelDims:
    """The degree of every parallel dimension; their product (``ep`` aside) is the world.

    Attributes:
        dp_replicate: data-parallel replicas (parameters replicated across them).
        dp_shard: data-parallel shards (ZeRO partitions parameters and state across them).
        tp: tensor-parallel degree.
        pp: pipeline-parallel degree.
        sp: sequence-parallel degree.
        ep: expert-parallel degree; divides ``dp_shard * sp`` (experts borrow those ranks), or the
            whole pipeline stage ``dp_shard * sp * tp`` when ``fold_ep``.
        world_size: number of ranks in the job.
        fold_ep: expert groups span the tensor-parallel ranks too (DeepSpeed's AutoEP + AutoTP
            "folding", Megatron's MoE parallel folding): ``ep`` groups are runs of consecutive ranks
            of a pipeline stage and ``edp`` the stage's ranks ``ep`` apart, whatever ``tp`` is.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    sp: int = 1
    ep: int = 1
    world_size: int = 1
    fold_ep: bool = False

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "sp", "ep", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel degree {name}={value!r}: it must be an int >= 1")
        product = self.dp_replicate * self.dp_shard * self.tp * self.pp * self.sp
        if product != self.world_size:
            raise ValueError(
                f"parallel degrees dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x tp={self.tp} "
                f"x pp={self.pp} x sp={self.sp} = {product}, but the world has {self.world_size} ranks: "
                "the degrees must multiply to the world size"
            )
        if self.expert_span % self.ep:
            spread = "dp_shard x sp x tp" if self.fold_ep else "dp_shard x sp"
            raise ValueError(
                f"expert-parallel degree ep={self.ep} must divide {spread} = {self.expert_span} "
                "(experts are spread over those ranks)"
            )

    @property
    def expert_span(self) -> int:
        """How many ranks the ``ep`` x ``edp`` layout tiles: ``dp_shard * sp`` (``* tp`` when ``fold_ep``)."""
        return self.dp_shard * self.sp * (self.tp if self.fold_ep else 1)

    @property
    def dp(self) -> int:
        """The data-parallel degree: ``dp_replicate * dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_degree(self) -> int:
        """How many ranks ZeRO partitions over: ``dp_shard * sp`` (the sequence-data-parallel ranks)."""
        return self.dp_shard * self.sp

    def enabled(self, name: str) -> bool:
        """Whether dimension ``name`` (one of :data:`MESH_ORDER` or ``"ep"``) has degree > 1."""
        if name not in (*MESH_ORDER, "ep"):
            raise ValueError(f"unknown parallel dimension {name!r}; known: {', '.join((*MESH_ORDER, 'ep'))}")
        return int(getattr(self, name)) > 1

    def mesh_dims(self) -> tuple[tuple[str, int], ...]:
        """The non-trivial mesh dimensions, outermost first (``dp_shard`` always present).

        Example:
            >>> ParallelDims(dp_shard=2, tp=2, world_size=4).mesh_dims()
            (('dp_shard', 2), ('tp', 2))
        """
        return tuple(
            (name, int(getattr(self, name)))
            for name in MESH_ORDER
            if name == "dp_shard" or int(getattr(self, name)) > 1
        )

    def dp_shard_runs(self, size: int) -> list[list[int]]:
        """The ``dp_shard`` ranks cut into runs of ``size`` consecutive ranks (hpZ's secondary groups).

        This is the ``dp_shard`` dimension viewed as ``(dp_shard / size, size)``, the layout
        FSDP2 reshards onto with ``reshard_after_forward=size``. Empty when ``size`` does not
        cut the dimension into two or more runs of two or more ranks.

        Example:
            >>> ParallelDims(dp_shard=8, world_size=8).dp_shard_runs(4)
            [[0, 1, 2, 3], [4, 5, 6, 7]]
            >>> ParallelDims(dp_shard=6, world_size=6).dp_shard_runs(4)
            []
        """
        n = self.dp_shard
        if not (1 < size < n and n % size == 0):
            return []
        return [list(range(start, start + size)) for start in range(0, n, size)]

    def rank_groups(self, dim: str) -> list[list[int]]:
        """Every group of dimension ``dim``, as lists of global ranks, in a fixed order.

        Ranks are laid out row-major over :data:`MESH_ORDER` (``pp`` outermost, ``tp``
        innermost: DeepSpeed's pipe/data/model order). ``dp`` spans both data dimensions,
        ``sdp`` the data and sequence dimensions (what ZeRO shards over), ``mp`` is ``tp``.
        ``ep`` groups are runs of ``ep`` consecutive members of an ``sdp`` group and ``edp``
        the members ``ep`` apart (DeepSpeed's expert and expert-data-parallel groups); with
        ``fold_ep`` the runs are cut from the ``sdp x tp`` group, a whole pipeline stage. Every
        rank must create the groups in this order.

        Example:
            >>> dims = ParallelDims(dp_shard=2, pp=2, world_size=4)
            >>> dims.rank_groups("pp"), dims.rank_groups("dp")
            ([[0, 2], [1, 3]], [[0, 1], [2, 3]])
            >>> ParallelDims(dp_shard=4, ep=2, world_size=4).rank_groups("edp")
            [[0, 2], [1, 3]]
            >>> ParallelDims(dp_shard=2, tp=2, ep=2, world_size=4, fold_ep=True).rank_groups("ep")
            [[0, 1], [2, 3]]
        """
        if dim not in _SPANS:
            raise ValueError(f"unknown parallel dimension {dim!r}; known: {', '.join(GROUP_DIMS)}")
        sizes = [int(getattr(self, name)) for name in MESH_ORDER]
        strides = [prod(sizes[i + 1 :]) for i in range(len(sizes))]
        spans = _SPANS[dim] + (("tp",) if self.fold_ep and dim in ("ep", "edp") else ())
        spanned = [i for i, name in enumerate(MESH_ORDER) if name in spans]
        fixed = [i for i in range(len(sizes)) if i not in spanned]
        groups: list[list[int]] = []
        for fixed_coords in product(*(range(sizes[i]) for i in fixed)):
            base = sum(c * strides[i] for c, i in zip(fixed_coords, fixed, strict=True))
            members = [
                base + sum(c * strides[i] for c, i in zip(coords, spanned, strict=True))
                for coords in product(*(range(sizes[i]) for i in spanned))
            ]
            groups.append(members)
        if dim == "ep":
            return [g[i : i + self.ep] for g in groups for i in range(0, len(g), self.ep)]
        if dim == "edp":
            return [g[i :: self.ep] for g in groups for i in range(self.ep)]
        return groups

    def size_of(self, dim: str) -> int:
        """The size of one group of dimension ``dim`` (every group of a dimension has the same size)."""
        return len(self.rank_groups(dim)[0])
