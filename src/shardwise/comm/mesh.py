"""The one place that builds the pipeline / tensor / sequence / expert process layout.

A feature that needs a parallel dimension declares its degree here, and nowhere else makes
groups: ``PipelineModule(num_stages=2)`` declares ``pp=2``, ``tp_model_init`` and the config's
``tensor_parallel.autotp_size`` declare ``tp``, ``sequence_parallel_size`` declares ``sp``, a MoE
layer's ``ep_size`` declares ``ep``. :func:`ensure_layout` turns the declared degrees into a
:class:`~shardwise.comm.parallel_dims.ParallelDims` (the data dimension takes what is left of the
world), creates every group of every named dimension (pure rank lists from
:meth:`ParallelDims.rank_groups`, the same order on every rank), and registers the resulting
:class:`~shardwise.comm.topology.Topology` with :func:`shardwise.comm.groups.set_topology`, so
``utils.groups``, the mpu, ZeRO and ``initialize`` all read the same layout.

It is a collective: every rank calls it, in the same order, with the same degrees. A layout is
built once; declaring a dimension again with the same degree returns it, declaring a new
dimension rebuilds it (groups already made for identical rank lists are reused), and declaring
a dimension with a different degree than before is an error naming both declarers.

Why by hand rather than ``init_device_mesh``: DeepSpeed's expert groups (runs of ``ep``
consecutive data-parallel ranks) are not a product dimension of a mesh, and the layout must be
extendable after the first feature declared its dimension (a MoE layer built after
``tp_model_init``). The DTensor-facing ``DeviceMesh`` is made from these same groups
(:meth:`Topology.device_mesh`).

Example:
    >>> from shardwise.comm import mesh
    >>> topo = mesh.ensure_layout(source="doctest")  # no process group: a world of one
    >>> topo.size_of("pp"), topo.size_of("sdp"), topo.group_of("tp")
    (1, 1, None)
    >>> mesh.reset_layout()
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shardwise.comm.group_type import Group
from shardwise.comm.groups import set_topology
from shardwise.comm.init import get_rank, get_world_group, get_world_size, new_group
from shardwise.comm.parallel_dims import GROUP_DIMS, ParallelDims
from shardwise.comm.topology import Topology

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "DECLARABLE",
    "current_layout",
    "declared_degrees",
    "ensure_layout",
    "expert_data_parallel_mesh",
    "reset_layout",
]

#: The dimensions a feature may declare (the data dimension is what they leave).
DECLARABLE: tuple[str, ...] = ("pp", "tp", "sp", "ep")


@dataclass
class _State:
    declared: dict[str, tuple[int, str]] = field(default_factory=dict)  # dim -> (degree, declarer)
    pgs: dict[tuple[int, ...], Group] = field(default_factory=dict)  # rank list -> its group
    singletons: list[Group] = field(default_factory=list)  # every rank's group of one, by rank
    fold_ep: tuple[bool, str] | None = None  # expert groups across tp (AutoEP + AutoTP), and its declarer
    topology: Topology | None = None


_STATE = _State()


def declared_degrees() -> dict[str, int]:
    """The degrees declared so far (a copy), by dimension."""
    return {dim: degree for dim, (degree, _) in _STATE.declared.items()}


def current_layout() -> Topology | None:
    """The layout :func:`ensure_layout` built last, or None when no feature declared one."""
    return _STATE.topology


def reset_layout() -> None:
    """Forget the declared degrees and the layout (tests; the process groups are not destroyed)."""
    _STATE.declared.clear()
    _STATE.pgs.clear()
    _STATE.singletons.clear()
    _STATE.fold_ep = None
    _STATE.topology = None


def _checked_degree(dim: str, value: object, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source}: {dim} degree {value!r} must be an int >= 1")
    return value


def _declare(degrees: dict[str, int | None], source: str) -> bool:
    """Record the new degrees (all or none); True when the layout must be (re)built."""
    new: dict[str, int] = {}
    for dim, value in degrees.items():
        if value is None:
            continue
        degree = _checked_degree(dim, value, source)
        previous = _STATE.declared.get(dim)
        if previous is not None and previous[0] != degree:
            raise ValueError(
                f"{dim} degree {degree} declared by {source}, but {previous[1]} declared {dim}={previous[0]}: "
                f"a job has one process layout; make both agree (e.g. the config's and the model's {dim} size)"
            )
        if previous is None:
            new[dim] = degree
    for dim, degree in new.items():
        _STATE.declared[dim] = (degree, source)
    return any(degree > 1 for degree in new.values())


def _declare_folding(fold_ep: bool | None, source: str) -> bool:
    """Record whether expert groups fold over ``tp``; True when that is new (the layout is rebuilt)."""
    if fold_ep is None:
        return False
    previous = _STATE.fold_ep
    if previous is not None and previous[0] != fold_ep:
        raise ValueError(
            f"{source} declares expert groups {'folded over' if fold_ep else 'apart from'} tensor parallelism, "
            f"but {previous[1]} declared the opposite: a job has one expert layout; use AutoEP with AutoTP "
            "(folded) or expert layers without it, not both"
        )
    _STATE.fold_ep = (fold_ep, source)
    return previous is None and fold_ep


def _dims(world: int) -> ParallelDims:
    degree = {dim: _STATE.declared.get(dim, (1, ""))[0] for dim in DECLARABLE}
    fold_ep = _STATE.fold_ep is not None and _STATE.fold_ep[0]
    model = degree["pp"] * degree["tp"] * degree["sp"]
    if world % model:
        named = ", ".join(f"{d}={degree[d]} ({_STATE.declared[d][1]})" for d in ("pp", "tp", "sp") if degree[d] > 1)
        raise ValueError(
            f"{named}: pp x tp x sp = {model} does not divide the world size {world}; "
            f"launch a multiple of {model} ranks or lower a degree"
        )
    dp = world // model
    span = dp * degree["sp"] * (degree["tp"] if fold_ep else 1)
    if span % degree["ep"]:
        ranks = "ranks of a pipeline stage" if fold_ep else "data x sequence-parallel ranks"
        raise ValueError(
            f"ep={degree['ep']} ({_STATE.declared['ep'][1]}) must divide the {ranks} {span} "
            f"(world {world}, pp={degree['pp']}, tp={degree['tp']}); pick an expert-parallel size that divides it"
        )
    return ParallelDims(dp_shard=dp, world_size=world, fold_ep=fold_ep, **degree)


def _group(ranks: list[int], world: int) -> Group:
    """The group of ``ranks`` (made once per rank list; the world and single ranks need none)."""
    key = tuple(ranks)
    if len(key) == world or len(key) == 1:
        return None
    if key not in _STATE.pgs:
        _STATE.pgs[key] = new_group(list(key))
    return _STATE.pgs[key]


def _singleton(rank: int, world: int) -> Group:
    """This rank's group of one (every rank makes all of them once, in the same order)."""
    if not _STATE.singletons:
        _STATE.singletons[:] = [new_group([r]) for r in range(world)]
    return _STATE.singletons[rank]


def _build(world: int, rank: int) -> Topology:
    dims = _dims(world)
    mine: dict[str, tuple[Group, tuple[int, ...]]] = {}
    for dim in GROUP_DIMS:
        for ranks in dims.rank_groups(dim):  # every rank creates every group, in the same order
            group = _group(ranks, world)
            if rank in ranks:
                mine[dim] = (group, tuple(ranks))

    def fields(dim: str) -> tuple[Group, int, int]:
        group, ranks = mine[dim]
        return group, ranks.index(rank), len(ranks)

    def data_fields(dim: str) -> tuple[Group, int, int]:
        # Topology's dp/shard groups keep their old meaning, None = the world (ZeRO, the buffer and
        # parameter broadcasts read them so): a data dimension of one rank in a larger world (all
        # ranks are tensor/pipeline/sequence parallel) gets a real group of one.
        group, index, size = fields(dim)
        return (_singleton(rank, world), index, size) if size == 1 < world else (group, index, size)

    (dp_group, dp_rank, dp_size), (mp_group, mp_rank, mp_size) = data_fields("dp"), fields("tp")
    (sp_group, sp_rank, sp_size), (shard_group, shard_rank, shard_size) = fields("sp"), data_fields("sdp")
    return Topology(
        world_rank=rank,
        world_size=world,
        dp_group=dp_group,
        dp_rank=dp_rank,
        dp_size=dp_size,
        mp_group=mp_group,
        mp_rank=mp_rank,
        mp_size=mp_size,
        sp_group=sp_group,
        sp_rank=sp_rank,
        sp_size=sp_size,
        shard_group=shard_group,
        shard_rank=shard_rank,
        shard_size=shard_size,
        dims=dims,
        groups=mine,
    )


def ensure_layout(
    *,
    pp: int | None = None,
    tp: int | None = None,
    sp: int | None = None,
    ep: int | None = None,
    fold_ep: bool | None = None,
    source: str,
) -> Topology:
    """Declare parallel degrees and return the layout with every group built (collective).

    Args:
        pp, tp, sp, ep: degrees to declare; None keeps what was declared (1 if never).
        fold_ep: expert groups span the tensor-parallel ranks (AutoEP + AutoTP folding,
            :class:`~shardwise.comm.parallel_dims.ParallelDims`' ``fold_ep``); None keeps what was declared.
        source: who declares (named in errors), e.g. ``"PipelineModule(num_stages=2)"``.

    Returns:
        The registered :class:`Topology` (also :func:`current_layout`).

    Raises:
        ValueError: a degree is not a positive int, differs from an earlier declaration, or
            the degrees do not tile the world.
    """
    topology, before, fold_before = _STATE.topology, dict(_STATE.declared), _STATE.fold_ep
    folded = _declare_folding(fold_ep, source)
    if _declare({"pp": pp, "tp": tp, "sp": sp, "ep": ep}, source) or folded or topology is None:
        try:
            topology = _STATE.topology = _build(get_world_size(), get_rank())
        except ValueError:
            _STATE.declared, _STATE.fold_ep = before, fold_before  # degrees that do not tile are not kept
            raise
    set_topology(topology)
    return topology


def expert_data_parallel_mesh(device_type: str) -> DeviceMesh:
    """The 1-D ``DeviceMesh`` named ``edp_shard`` over this rank's expert-data-parallel group (the
    ranks holding the same experts): ZeRO stage 3 shards expert parameters over it. Where that group
    is one rank (``ep`` equal to the data-parallel size) it is this rank's group of one. Collective
    (every rank calls it, in the same order: the groups of one are made once, by every rank).

    Raises:
        ValueError: no layout with expert parallelism (``ep`` > 1) was declared.
    """
    from torch.distributed.device_mesh import DeviceMesh

    topology = _STATE.topology
    if topology is None or topology.size_of("ep") == 1:
        raise ValueError(
            "expert_data_parallel_mesh: no expert parallelism in the process layout (ep=1); fix: declare "
            "ep with ensure_layout(ep=...) (MoE layers and the expert_parallel section do) first"
        )
    group = topology.group_of("edp")
    if topology.size_of("edp") == 1:
        group = _singleton(get_rank(), get_world_size())
    return DeviceMesh.from_group(group or get_world_group(), device_type, mesh_dim_names=("edp_shard",))
