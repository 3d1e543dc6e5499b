"""``deepspeed.comm``'s remaining collectives, on ``torch.distributed`` with DeepSpeed's signatures.

shardwise's own collectives (:mod:`shardwise.comm.collectives`) pick algorithms and log to the
comms logger; these are the plain calls user scripts make through ``deepspeed.comm``: list
collectives (``all_gather``, ``all_to_all``, ``gather``, ``scatter``, ``reduce``, ``reduce_scatter``),
coalesced ones, ``all_to_all_single`` and the fallbacks DeepSpeed names ``allgather_fn`` and
``reduce_scatter_fn``. Point-to-point calls are in :mod:`shardwise.comm.point_to_point`, Python
objects and barriers in :mod:`shardwise.comm.object_api`.

Each takes DeepSpeed's ``prof``, ``log_name`` and ``debug`` arguments and is recorded by the comms
logger under ``log_name`` (:func:`shardwise.comm.op_logging.timed_op`): ``prof=True`` profiles the
call even when the logger's ``prof_all`` is off.

Example:
    >>> import torch
    >>> out = [torch.empty(2) for _ in range(2)]
    >>> # all_to_all(out, [torch.zeros(2), torch.ones(2)])  # on each of 2 ranks
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from shardwise.comm.collectives import _OPS, _op_name, all_gather_flat, reduce_scatter_flat
from shardwise.comm.comm_handle import CommHandle
from shardwise.comm.group_type import Group
from shardwise.comm.op_logging import timed_op

__all__ = [
    "all_gather",
    "all_gather_coalesced",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "allgather_fn",
    "gather",
    "has_all_gather_into_tensor",
    "has_all_reduce_coalesced",
    "has_coalescing_manager",
    "has_reduce_scatter_tensor",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "scatter",
]

Op = object  # a torch ``ReduceOp`` or one of "sum", "avg", "max", "min"
Work = dist.Work | CommHandle | None


@timed_op
def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Group = None, async_op: bool = False,
    prof: bool = False, log_name: str = "all_gather", debug: str | None = None,
) -> Work:
    """Every rank's ``tensor`` into ``tensor_list`` (one entry per rank)."""
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


@timed_op
def reduce(
    tensor: torch.Tensor, dst: int, op: Op = dist.ReduceOp.SUM, group: Group = None, async_op: bool = False,
    prof: bool = False, log_name: str = "reduce", debug: str | None = None,
) -> Work:
    """Reduce ``tensor`` over the group into rank ``dst``."""
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


@timed_op
def reduce_scatter(
    output: torch.Tensor, input_list: list[torch.Tensor], op: Op = dist.ReduceOp.SUM, group: Group = None,
    async_op: bool = False, prof: bool = False, log_name: str = "reduce_scatter", debug: str | None = None,
) -> Work:
    """Reduce ``input_list`` over the group; rank ``r`` gets the reduced ``input_list[r]`` in ``output``."""
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


@timed_op
def all_to_all_single(
    output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None, group: Group = None, async_op: bool = False,
    prof: bool = False, log_name: str = "all_to_all_single", debug: str | None = None,
) -> Work:
    """Split ``tensor`` over ranks and gather each rank's piece into ``output``."""
    return dist.all_to_all_single(
        output, tensor, output_split_sizes, input_split_sizes, group=group, async_op=async_op
    )


@timed_op
def all_to_all(
    output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor], group: Group = None,
    async_op: bool = False, prof: bool = False, log_name: str = "all_to_all", debug: str | None = None,
) -> Work:
    """``input_tensor_list[r]`` goes to rank ``r``; rank ``r``'s piece for this rank lands in
    ``output_tensor_list[r]``. On gloo, which has no list all-to-all, one ``all_to_all_single`` of the
    pieces laid end to end (all must share a dtype)."""
    if "gloo" not in str(dist.get_backend(group)):
        return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)
    dtypes = {t.dtype for t in (*output_tensor_list, *input_tensor_list)}
    if len(dtypes) != 1:
        raise ValueError(f"all_to_all on gloo needs one dtype for every piece, got {sorted(map(str, dtypes))}")
    send = torch.cat([t.reshape(-1) for t in input_tensor_list])
    received = torch.empty(sum(t.numel() for t in output_tensor_list), dtype=send.dtype, device=send.device)
    work = dist.all_to_all_single(
        received, send, [t.numel() for t in output_tensor_list], [t.numel() for t in input_tensor_list],
        group=group, async_op=async_op,
    )

    def unpack() -> None:
        for out, piece in zip(output_tensor_list, received.split([t.numel() for t in output_tensor_list])):
            out.copy_(piece.view_as(out))

    return _finish(work, async_op, unpack)


@timed_op
def gather(
    tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0, group: Group = None,
    async_op: bool = False, prof: bool = False, log_name: str = "gather", debug: str | None = None,
) -> Work:
    """Every rank's ``tensor`` into ``gather_list`` on rank ``dst`` (None on the others)."""
    return dist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op)


@timed_op
def scatter(
    tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0, group: Group = None,
    async_op: bool = False, prof: bool = False, log_name: str = "scatter", debug: str | None = None,
) -> Work:
    """Rank ``src``'s ``scatter_list[r]`` into rank ``r``'s ``tensor``."""
    return dist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op)


def _finish(work: dist.Work | None, async_op: bool, finish: Callable[[], object]) -> CommHandle | None:
    handle = CommHandle(work, finish)
    if async_op:
        return handle
    handle.wait()
    return None


@timed_op
def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor], op: Op = dist.ReduceOp.SUM, group: Group = None, async_op: bool = False,
    prof: bool = False, log_name: str = "all_reduce", debug: str | None = None,
) -> CommHandle | None:
    """Reduce every tensor of ``tensors`` in place: one all-reduce per dtype and device over the tensors
    laid end to end (``"avg"``: the sum divided by the group size after the communication)."""
    name = _op_name(op)  # type: ignore[arg-type]
    world = dist.get_world_size(group)
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    flats = [(_flatten_dense_tensors(ts), ts) for ts in buckets.values()]
    works = [dist.all_reduce(flat, op=_OPS[name], group=group, async_op=async_op) for flat, _ in flats]

    def unpack() -> None:
        for work in works:
            if work is not None:
                work.wait()
        for flat, ts in flats:
            if name == "avg":
                flat.div_(world)
            for t, value in zip(ts, _unflatten_dense_tensors(flat, ts)):
                t.copy_(value)

    return _finish(None, async_op, unpack)


def all_gather_coalesced(
    output_tensors: Sequence[torch.Tensor], input_tensors: Sequence[torch.Tensor], group: Group = None,
    async_op: bool = False,
) -> CommHandle | None:
    """``output_tensors[i]`` = every rank's ``input_tensors[i]`` laid end to end (group size x its
    elements), for each ``i``, in one all-gather of the inputs laid end to end (one dtype)."""
    if len(output_tensors) != len(input_tensors):
        raise ValueError(f"all_gather_coalesced: {len(output_tensors)} outputs for {len(input_tensors)} inputs")
    dtypes = {t.dtype for t in (*output_tensors, *input_tensors)}
    if len(dtypes) != 1:
        raise ValueError(f"all_gather_coalesced needs one dtype for every tensor, got {sorted(map(str, dtypes))}; "
                         "call it once per dtype")
    world = dist.get_world_size(group)
    sizes = [t.numel() for t in input_tensors]
    for out, n in zip(output_tensors, sizes):
        if out.numel() != world * n:
            raise ValueError(f"all_gather_coalesced: an output has {out.numel()} elements, needs {world} x {n}")
    flat = torch.cat([t.reshape(-1) for t in input_tensors])
    gathered = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
    inner = all_gather_flat(gathered, flat, group, async_op=async_op)

    def unpack() -> None:
        if inner is not None:
            inner.wait()
        per_rank = gathered.view(world, -1).split(sizes, dim=1)
        for out, piece in zip(output_tensors, per_rank):
            out.view(world, -1).copy_(piece)

    return _finish(None, async_op, unpack)


def allgather_fn(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Group = None, async_op: bool = False,
    debug: str | None = None,
) -> CommHandle | None:
    """DeepSpeed's flat all-gather entry point: :func:`shardwise.comm.collectives.all_gather_flat`
    (torch always has ``all_gather_into_tensor``, so DeepSpeed's list fallback never applies)."""
    return all_gather_flat(output_tensor, input_tensor, group, async_op)


def reduce_scatter_fn(
    output_tensor: torch.Tensor, tensor: torch.Tensor, op: Op = dist.ReduceOp.SUM, group: Group = None,
    async_op: bool = False, prof: bool = False, debug: str | None = None,
) -> CommHandle | None:
    """DeepSpeed's flat reduce-scatter entry point: :func:`shardwise.comm.collectives.reduce_scatter_flat`
    (SUM or AVG; ``tensor`` is kept intact)."""
    name = _op_name(op)  # type: ignore[arg-type]
    if name not in ("sum", "avg"):
        raise ValueError(f"reduce_scatter_fn supports SUM or AVG, got {op!r}")
    return reduce_scatter_flat(output_tensor, tensor, group, async_op, op=name)  # type: ignore[arg-type]


def has_all_gather_into_tensor() -> bool:
    """Whether torch has the flat all-gather (:func:`allgather_fn` uses it): True on every torch shardwise supports."""
    return hasattr(dist, "all_gather_into_tensor")


def has_reduce_scatter_tensor() -> bool:
    """Whether torch has the flat reduce-scatter: True on every torch shardwise supports."""
    return hasattr(dist, "reduce_scatter_tensor")


def has_all_reduce_coalesced() -> bool:
    """Whether :func:`all_reduce_coalesced` can be called: always (it lays tensors end to end itself)."""
    return True


def has_coalescing_manager() -> bool:
    """Whether torch has its coalescing manager (``distributed_c10d._coalescing_manager``)."""
    return hasattr(dist.distributed_c10d, "_coalescing_manager")
