"""The collectives ZeRO uses, each with the algorithm that measured fastest on its backend.

Every function takes ``group`` (None: the world) and ``async_op``. Synchronous calls
return None; asynchronous ones return a :class:`CommHandle` whose ``wait()`` also runs
any step that must follow the communication (copying a slice out, dividing for an
average), so callers never see a half-finished result.

Algorithm choice
----------------
On nccl (and any backend other than gloo on CPU tensors) the native collectives are used; on gloo
the choice follows measurements (a point-to-point exchange on two ranks, an all-reduce of the
whole buffer past glibc's 32 MiB mmap threshold): :func:`choose_algorithm`, in
:mod:`shardwise.comm.collective_algorithm`, with the measured table. To force one algorithm
(benchmarks, tests), pass ``algorithm="native"``, ``"all_reduce"`` or ``"exchange"``.

The handle and the finishing steps every collective shares are in :mod:`shardwise.comm.comm_handle`.

Averaging
---------
Gloo has no AVG reduction, so ``op="avg"`` is always a SUM followed by a division by the
group size, on every backend (one rule, the same numerics everywhere; it is DeepSpeed's
default "postscale" order). The division runs after the communication: on the whole
tensor for :func:`all_reduce`, on the output shard only for :func:`reduce_scatter_flat`
(1/world of the work), and for asynchronous calls inside ``CommHandle.wait()``.

Comms logging
-------------
When the ``comms_logger`` is enabled, every call here is timed and recorded under
DeepSpeed's op names (``all_reduce``, ``reduce_scatter_tensor``,
``all_gather_into_tensor``, ``broadcast``) whatever algorithm ran; see
:mod:`shardwise.comm.comms_logger`. Disabled, it costs one attribute check per call.

Example:
    >>> import torch
    >>> from shardwise.comm.collectives import all_gather_flat, reduce_scatter_flat
    >>> grads = torch.ones(8); shard = torch.empty(4)  # on each of 2 ranks
    >>> # reduce_scatter_flat(shard, grads, op="avg", input_is_scratch=True)
    >>> full = torch.empty(8)
    >>> # all_gather_flat(full, shard)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist

from shardwise.comm import exchange
from shardwise.comm.collective_algorithm import (
    GLOO_ALL_GATHER_VIA_ALL_REDUCE_MIN_BYTES,
    Algorithm,
    AlgorithmChoice,
    choose_algorithm,
)
from shardwise.comm.comm_handle import CommHandle, _copy_back, _nccl_staging, _record, _run
from shardwise.comm.comms_logger import COMMS_LOGGER as _COMMS

__all__ = [
    "GLOO_ALL_GATHER_VIA_ALL_REDUCE_MIN_BYTES",
    "CommHandle",
    "all_gather_flat",
    "all_gather_into_tensor",
    "all_reduce",
    "all_reduce_max_flag",
    "broadcast",
    "broadcast_into",
    "choose_algorithm",
    "reduce_scatter_flat",
    "reduce_scatter_ranges",
    "reduce_scatter_tensor",
]

OpName = Literal["sum", "avg", "max", "min"]

_OPS: dict[str, dist.ReduceOp.RedOpType] = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # SUM, then a division (gloo has no AVG)
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
_OP_NAMES = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.MIN: "min",
}

# torch 2.13 renamed the flat collectives; the old names emit FutureWarnings there.
_reduce_scatter_native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_native = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _op_name(op: str | dist.ReduceOp | dist.ReduceOp.RedOpType) -> str:
    if isinstance(op, str):
        name = op.lower()
        if name == "mean":
            name = "avg"
        if name in _OPS:
            return name
    else:
        found = _OP_NAMES.get(op)  # type: ignore[arg-type]
        if found is not None:
            return found
    raise ValueError(f"reduction op {op!r} is not supported: use one of 'sum', 'avg', 'max', 'min'")


def _group_size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError("no process group exists yet: call shardwise.init_distributed() first")
    return dist.get_world_size(group), dist.get_rank(group)


def _resolve(
    algorithm: AlgorithmChoice,
    collective: Literal["reduce_scatter", "all_gather"],
    group: dist.ProcessGroup | None,
    full: torch.Tensor,
    input_is_scratch: bool,
    world: int,
) -> Algorithm:
    if algorithm == "auto":
        return choose_algorithm(
            collective,
            str(dist.get_backend(group)),
            full.device.type,
            full.numel() * full.element_size(),
            input_is_scratch=input_is_scratch,
            world_size=world,
        )
    if algorithm not in ("native", "all_reduce", "exchange"):
        raise ValueError(f"algorithm={algorithm!r} is not one of 'auto', 'native', 'all_reduce', 'exchange'")
    return algorithm


def _check_flat_pair(what: str, full: torch.Tensor, shard: torch.Tensor, world: int) -> None:
    """Both tensors contiguous, same dtype/device, and ``full`` = ``world`` x ``shard``."""
    if full.dtype != shard.dtype or full.device != shard.device:
        raise ValueError(
            f"{what}: tensors must share dtype and device, got {full.dtype} on {full.device} and "
            f"{shard.dtype} on {shard.device}"
        )
    if not (full.is_contiguous() and shard.is_contiguous()):
        raise ValueError(f"{what}: tensors must be contiguous (call .contiguous() or use a flat buffer)")
    if full.numel() % world:
        raise ValueError(
            f"{what}: the full buffer has {full.numel()} elements, not divisible by the group size {world}; "
            f"pad it to a multiple of {world}"
        )
    if shard.numel() * world != full.numel():
        raise ValueError(
            f"{what}: the shard has {shard.numel()} elements but must have {full.numel() // world} "
            f"(= {full.numel()} / group size {world})"
        )


def all_reduce(
    tensor: torch.Tensor,
    op: str | dist.ReduceOp | dist.ReduceOp.RedOpType = "sum",
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str | None = None,
    debug: object = None,
) -> CommHandle | None:
    """Reduce ``tensor`` in place across ``group``.

    Args:
        tensor: reduced in place on every rank.
        op: ``"sum"``, ``"avg"``, ``"max"``, ``"min"`` or the matching ``dist.ReduceOp``.
            ``"avg"`` is SUM followed by a division by the group size after the
            communication.
        group: process group (None: the world).
        async_op: return a :class:`CommHandle` instead of waiting.
        prof, log_name, debug: deepspeed.comm's: record the call in the comms logger under ``log_name``
            (default ``"all_reduce"``), ``prof`` even when the logger does not select it; ``debug`` is
            DeepSpeed's caller tag, which the logger's own ``debug`` setting replaces.

    Example:
        >>> t = torch.tensor([1.0, 3.0])
        >>> # all_reduce(t, op="avg")
    """
    name = _op_name(op)
    if name == "avg" and not tensor.is_floating_point():
        raise ValueError(f"all_reduce(op='avg') needs a floating-point tensor, got {tensor.dtype}; use 'sum'")
    world, _ = _group_size_and_rank(group)
    record = _record("all_reduce", tensor, world, prof, log_name) if _COMMS.enabled else None
    staged = _nccl_staging(tensor, group)
    target = tensor if staged is None else staged
    work = dist.all_reduce(target, op=_OPS[name], group=group, async_op=async_op)
    finish = (lambda: target.div_(world)) if name == "avg" and world > 1 else None
    return _run(work, async_op, _copy_back(finish, staged, tensor), record)


def inference_all_reduce(
    tensor: torch.Tensor,
    op: str | dist.ReduceOp | dist.ReduceOp.RedOpType = "sum",
    group: dist.ProcessGroup | None = None,
    **_deepspeed_options: object,
) -> None:
    """DeepSpeed's ``deepspeed.comm.inference_all_reduce``: :func:`all_reduce` in place, waited for.

    DeepSpeed routes it to a shared-memory kernel on CPU where it can; shardwise has one all-reduce
    path, so the result is the same reduction. DeepSpeed's ``async_op``/``prof``/``log_name``/``debug``
    arguments are accepted and change nothing (DeepSpeed waits here too).
    """
    all_reduce(tensor, op=op, group=group)


def reduce_scatter_flat(
    output: torch.Tensor,
    input: torch.Tensor,  # torch's parameter name, shadowing the builtin on purpose
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    op: Literal["sum", "avg"] = "sum",
    input_is_scratch: bool = False,
    algorithm: AlgorithmChoice = "auto",
    prof: bool = False,
    log_name: str | None = None,
) -> CommHandle | None:
    """Sum ``input`` across ``group`` and keep this rank's slice in ``output``.

    ``output`` receives elements ``[r * n, (r + 1) * n)`` of the reduced input, where ``r``
    is this rank's index in ``group`` and ``n = output.numel()``.

    Args:
        output: this rank's shard, ``input.numel() / group size`` elements; may be a view
            of ``input`` at this rank's slice.
        input: the full flat buffer; its element count must be divisible by the group size.
        group: process group (None: the world).
        async_op: return a :class:`CommHandle`; read ``output`` only after ``wait()``.
        op: ``"sum"``, or ``"avg"`` (sum, then the shard is divided by the group size).
        input_is_scratch: True lets the all-reduce algorithm overwrite ``input`` with the
            reduced full buffer (faster on gloo, no extra memory). False keeps ``input``
            intact.
        algorithm: ``"auto"`` (measured choice), or force ``"native"``/``"all_reduce"``/``"exchange"``.
        prof, log_name: the comms logger's record (default name ``"reduce_scatter_tensor"``), as for :func:`all_reduce`.

    Raises:
        ValueError: sizes not divisible or not matching, mixed dtypes/devices,
            non-contiguous tensors, or an unsupported op.
    """
    name = _op_name(op)
    if name not in ("sum", "avg"):
        raise ValueError(f"reduce_scatter_flat supports op 'sum' or 'avg', got {op!r}")
    if name == "avg" and not output.is_floating_point():
        raise ValueError(f"reduce_scatter_flat(op='avg') needs floating-point tensors, got {output.dtype}")
    world, rank = _group_size_and_rank(group)
    _check_flat_pair("reduce_scatter_flat", input, output, world)
    out, inp = output.view(-1), input.view(-1)
    n = out.numel()
    average = name == "avg" and world > 1
    record = _record("reduce_scatter_tensor", out, world, prof, log_name) if _COMMS.enabled else None
    chosen = _resolve(algorithm, "reduce_scatter", group, inp, input_is_scratch, world)
    if chosen == "native":
        work = _reduce_scatter_native(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        return _run(work, async_op, (lambda: out.div_(world)) if average else None, record)
    if chosen == "exchange":
        shards = [(r * n, (r + 1) * n) for r in range(world)]
        in_place = out.data_ptr() == inp[rank * n :].data_ptr()
        handle = exchange.reduce_owned(inp, shards, group, True, out=None if in_place else out)
        return _run(handle, async_op, (lambda: out.div_(world)) if average else None, record)  # type: ignore[arg-type]

    buffer = inp if input_is_scratch else inp.clone()
    work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=async_op)

    def finish() -> None:
        mine = buffer[rank * n : (rank + 1) * n]
        if mine.data_ptr() != out.data_ptr():  # output may already be that slice
            out.copy_(mine)
        if average:
            out.div_(world)

    return _run(work, async_op, finish, record)


def _point_to_point_exchange(buffer: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """Whether :func:`reduce_scatter_ranges` exchanges pieces point to point (CPU tensors over gloo)."""
    return buffer.device.type == "cpu" and "gloo" in str(dist.get_backend(group))


def reduce_scatter_ranges(
    buffer: torch.Tensor,
    owned: Sequence[tuple[int, int]],
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    out: torch.Tensor | None = None,
) -> CommHandle | None:
    """Sum ``buffer`` across ``group`` where each rank keeps only its own range ``owned[rank]``.

    :func:`shardwise.comm.exchange.reduce_owned` on CPU tensors over gloo (see there: ranges may
    be uneven, cut across shards, or empty), timed for the comms logger as ``reduce_scatter_tensor``
    of ``buffer.numel() / group size`` elements. Elsewhere (NCCL, GPU tensors) NCCL's reduce-scatter
    when the ranges are the buffer's equal consecutive shards, else an all-reduce of a scratch copy
    (ranges may be uneven, which ``reduce_scatter_tensor`` cannot take): NCCL matches point-to-point
    messages by order, not tag, and runs each pair's sends and receives on one stream, so two ranks'
    exchanges of more than NCCL's buffers would each wait for the other's receives.
    """
    world, rank = _group_size_and_rank(group)
    nbytes = buffer.numel() // world * buffer.element_size()
    record = _COMMS.start("reduce_scatter_tensor", nbytes, world, buffer.is_cuda) if _COMMS.enabled else None
    if _point_to_point_exchange(buffer, group):
        handle = exchange.reduce_owned(buffer, owned, group, True, out=out)
        return _run(handle, async_op, None, record)  # type: ignore[arg-type]
    exchange.check_ranges(buffer, owned, world)
    lo, hi = owned[rank]
    if out is not None and (out.numel() != hi - lo or out.dtype != buffer.dtype):
        raise ValueError(f"out must hold this rank's range: {hi - lo} elements of {buffer.dtype}")
    n = hi - lo
    if all(owned[r] == (r * n, (r + 1) * n) for r in range(world)) and world * n == buffer.numel():
        target = buffer[lo:hi] if out is None else out.view(-1)
        mine = target if target.is_contiguous() else torch.empty_like(target)
        work = _reduce_scatter_native(mine, buffer, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        return _run(work, async_op, None if mine is target else (lambda: target.copy_(mine)), record)
    scratch = buffer.clone()  # the rest of ``buffer`` keeps this rank's partial values
    work = dist.all_reduce(scratch, op=dist.ReduceOp.SUM, group=group, async_op=async_op)

    def finish() -> None:
        (buffer[lo:hi] if out is None else out.view(-1)).copy_(scratch[lo:hi])

    return _run(work, async_op, finish, record)


def all_gather_flat(
    output: torch.Tensor,
    input_shard: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    algorithm: AlgorithmChoice = "auto",
    prof: bool = False,
    log_name: str | None = None,
) -> CommHandle | None:
    """Concatenate every rank's ``input_shard`` into ``output``, in group-rank order.

    Args:
        output: the full flat buffer, group size x ``input_shard.numel()`` elements.
        input_shard: this rank's shard; may be a view of ``output`` at this rank's slice.
        group: process group (None: the world).
        async_op: return a :class:`CommHandle`; read ``output`` only after ``wait()``.
        algorithm: ``"auto"`` (measured choice), or force ``"native"``/``"all_reduce"``/``"exchange"``.
        prof, log_name: the comms logger's record (default name ``"all_gather_into_tensor"``), as for :func:`all_reduce`.

    Raises:
        ValueError: sizes not matching, mixed dtypes/devices, or non-contiguous tensors.
    """
    world, rank = _group_size_and_rank(group)
    _check_flat_pair("all_gather_flat", output, input_shard, world)
    staged = _nccl_staging(output, group)
    if staged is not None:  # CPU tensors on an NCCL group: gather on the GPU, copy the result back
        all_gather_flat(staged, input_shard.to(staged.device), group, algorithm=algorithm, prof=prof, log_name=log_name)
        output.copy_(staged)
        return _run(None, async_op, None)
    out, shard = output.view(-1), input_shard.view(-1)
    record = _record("all_gather_into_tensor", shard, world, prof, log_name) if _COMMS.enabled else None
    chosen = _resolve(algorithm, "all_gather", group, out, False, world)
    if chosen == "native":
        work = _all_gather_native(out, shard, group=group, async_op=async_op)
        return _run(work, async_op, None, record)

    n = shard.numel()
    lo, hi = rank * n, (rank + 1) * n
    if out[lo:hi].data_ptr() != shard.data_ptr():
        out[lo:hi].copy_(shard)
    if chosen == "exchange":
        shards = [(r * n, (r + 1) * n) for r in range(world)]
        return _run(exchange.gather_owned(out, shards, group, True), async_op, None, record)  # type: ignore[arg-type]
    # Everyone else's part is zero here, so the SUM hands each element its owner's value.
    out[:lo].zero_()
    out[hi:].zero_()
    work = dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return _run(work, async_op, None, record)


def broadcast(
    tensor: torch.Tensor,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str | None = None,
    debug: object = None,
) -> CommHandle | None:
    """Copy ``tensor`` from the rank with global rank ``src`` to every rank of ``group`` (``prof``,
    ``log_name``, ``debug``: as for :func:`all_reduce`)."""
    world, _ = _group_size_and_rank(group)
    record = _record("broadcast", tensor, world, prof, log_name) if _COMMS.enabled else None
    staged = _nccl_staging(tensor, group)
    work = dist.broadcast(tensor if staged is None else staged, src=src, group=group, async_op=async_op)
    return _run(work, async_op, _copy_back(None, staged, tensor), record)


def _shares_memory(tensor: torch.Tensor) -> bool:
    """True when some elements of ``tensor`` are the same memory (an ``expand``ed view)."""
    return any(stride == 0 and size > 1 for stride, size in zip(tensor.stride(), tensor.size()))


def broadcast_into(tensor: torch.Tensor, src: int = 0, group: dist.ProcessGroup | None = None) -> bool:
    """Give ``tensor`` the values of rank ``src``'s, whatever its layout; False if that is impossible.

    A contiguous tensor is broadcast in place. Any other view (transposed, sliced) travels as a
    contiguous copy and is written back element by element: broadcasting into it directly would
    write past its elements (a crash or corrupted memory with gloo). A view whose elements share
    memory (an ``expand``ed buffer) cannot hold different values per element, so it is left as
    it is and the result says whether it already equals ``src``'s (every rank receives the values).
    """
    if tensor.is_contiguous():
        broadcast(tensor, src=src, group=group)
        return True
    staged = tensor.detach().contiguous()
    broadcast(staged, src=src, group=group)
    if _shares_memory(tensor):
        return bool(torch.equal(staged, tensor))
    with torch.no_grad():
        tensor.copy_(staged)
    return True


def _flag_device(group: dist.ProcessGroup | None) -> torch.device:
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_max_flag(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank if ``flag`` is True on any rank (e.g. "some gradient overflowed").

    Example:
        >>> # all_reduce_max_flag(rank == 1)
        >>> # -> True
    """
    world, _ = _group_size_and_rank(group)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_flag_device(group))
    record = _record("all_reduce", t, world) if _COMMS.enabled else None
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if record is not None:
        record.complete()
    return bool(t.item())


# DeepSpeed-compatible names (deepspeed.comm) for the flat collectives.


def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    op: str | dist.ReduceOp | dist.ReduceOp.RedOpType = "sum",
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str | None = None,
    debug: object = None,
) -> CommHandle | None:
    """``deepspeed.comm.reduce_scatter_tensor``: :func:`reduce_scatter_flat`, input kept intact (``prof``,
    ``log_name``, ``debug``: as for :func:`all_reduce`)."""
    name = _op_name(op)
    if name not in ("sum", "avg"):
        raise ValueError(f"reduce_scatter_tensor supports SUM or AVG, got {op!r}")
    return reduce_scatter_flat(
        output_tensor, input_tensor, group, async_op, op=name, prof=prof, log_name=log_name  # type: ignore[arg-type]
    )


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str | None = None,
    debug: object = None,
) -> CommHandle | None:
    """``deepspeed.comm.all_gather_into_tensor``: :func:`all_gather_flat` (``prof``, ``log_name``, ``debug``:
    as for :func:`all_reduce`)."""
    return all_gather_flat(output_tensor, input_tensor, group, async_op, prof=prof, log_name=log_name)
