"""ZeRO++'s quantized collectives (qwZ, qgZ) and the FSDP2 hooks that put them under stage 3.

* :func:`quantized_all_gather` (qwZ): each rank block-quantizes its shard to int8
  (:mod:`shardwise.comm.quantization`), one all-gather moves the packed int8 buffers, and
  every rank dequantizes every shard, its own included, so all ranks compute with the
  same weights. Error per element: at most its block's absmax / 254.
* :func:`quantized_reduce_scatter` (qgZ, the all-to-all scheme): each rank quantizes the
  ``W`` destination chunks of its input separately, one all-to-all sends chunk ``r`` to
  rank ``r``, and each rank dequantizes the ``W`` chunks it received and sums them in fp32,
  in rank order (deterministic). Error per element: at most ``sum_r absmax_r / 254``.
  DeepSpeed's qgZ uses int4 on its first hop; here both hops are one int8 hop.

Both are recorded by the comms logger with the bytes that actually travel (the packed
int8 buffer), under DeepSpeed's op names ``all_gather_into_tensor`` and
``all_to_all_single``. :class:`LoggedAllGather` is FSDP2's plain all-gather, recorded too
(installed only while the comms logger is on, so the exact run's bytes can be compared).

Inputs that are not floating point (FSDP2 gathers mixed-dtype units as raw bytes) are
gathered exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from shardwise.comm import quantization as q
from shardwise.comm.collectives import _all_gather_native
from shardwise.comm.comm_handle import _record
from shardwise.comm.comms_logger import COMMS_LOGGER as _COMMS
from shardwise.comm.group_type import Group


def _finish(record: Any) -> None:
    if record is not None:
        record.complete()


def quantized_all_gather(
    output: torch.Tensor, input_shard: torch.Tensor, group: Group = None, block: int = q.DEFAULT_BLOCK
) -> None:
    """qwZ: ``output`` (flat, W x n) gets every rank's int8-quantized-then-dequantized shard."""
    world = dist.get_world_size(group)
    out, shard = output.view(-1), input_shard.view(-1)
    n = shard.numel()
    if not shard.is_floating_point():
        record = _record("all_gather_into_tensor", shard, world) if _COMMS.enabled else None
        _all_gather_native(out, shard, group=group)
        _finish(record)
        return
    packed = q.quantize_packed(shard, block)
    gathered = torch.empty(world * packed.numel(), dtype=torch.int8, device=packed.device)
    record = _record("all_gather_into_tensor", packed, world) if _COMMS.enabled else None
    _all_gather_native(gathered, packed, group=group)
    _finish(record)
    size = packed.numel()
    for r in range(world):
        out[r * n : (r + 1) * n] = q.dequantize_packed(
            gathered[r * size : (r + 1) * size], n, out.dtype, block
        )


def quantized_reduce_scatter(
    output: torch.Tensor,
    input_full: torch.Tensor,
    group: Group = None,
    average: bool = False,
    block: int = q.DEFAULT_BLOCK,
) -> None:
    """qgZ: ``output`` (n elements) gets the sum (or mean) over ranks of their chunk of ``input_full`` (W x n),
    each contribution int8-quantized on the wire (one all-to-all)."""
    world = dist.get_world_size(group)
    out, inp = output.view(-1), input_full.view(-1)
    n = out.numel()
    if inp.numel() != world * n:
        raise ValueError(
            f"quantized_reduce_scatter: input has {inp.numel()} elements, expected {world} x {n}"
        )
    send = torch.cat([q.quantize_packed(inp[r * n : (r + 1) * n], block) for r in range(world)])
    recv = torch.empty_like(send)
    size = send.numel() // world
    record = _record("all_to_all_single", send, world) if _COMMS.enabled else None
    dist.all_to_all_single(recv, send, group=group)
    _finish(record)
    total = torch.zeros(n, dtype=torch.float32, device=out.device)
    for r in range(world):
        total += q.dequantize_packed(recv[r * size : (r + 1) * size], n, torch.float32, block)
    if average:
        total /= world
    out.copy_(total)


class FsdpHook:
    """What FSDP2's custom-collective hooks (``set_custom_all_gather``/``set_custom_reduce_scatter``)
    share: a plain buffer allocator, and the reduce-op check of the reduce-scatter hooks."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @staticmethod
    def reduce_op_name(op: object, hook: str) -> Literal["sum", "avg"]:
        """``"sum"`` or ``"avg"`` for FSDP2's ``ReduceOp``; anything else (NCCL-only ops such as
        PREMUL_SUM, which never reach these CPU hooks) is an error naming ``hook``."""
        if op == dist.ReduceOp.SUM:
            return "sum"
        if op == dist.ReduceOp.AVG:
            return "avg"
        raise ValueError(f"{hook}: FSDP2 asked for {op!r}; only SUM and AVG are supported")


class QuantizedAllGather(FsdpHook):
    """FSDP2 all-gather hook (``set_custom_all_gather``) running :func:`quantized_all_gather`."""

    def __init__(self, block: int = q.DEFAULT_BLOCK) -> None:
        self.block = block

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Group, async_op: bool = False
    ) -> None:
        quantized_all_gather(output_tensor, input_tensor, group, self.block)


class LoggedAllGather(FsdpHook):
    """FSDP2's plain all-gather, recorded by the comms logger (bit-identical: a copy of every shard)."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Group, async_op: bool = False
    ) -> None:
        world = dist.get_world_size(group)
        record = _record("all_gather_into_tensor", input_tensor, world) if _COMMS.enabled else None
        _all_gather_native(output_tensor, input_tensor, group=group)
        _finish(record)


class QuantizedReduceScatter(FsdpHook):
    """FSDP2 reduce-scatter hook (``set_custom_reduce_scatter``) running :func:`quantized_reduce_scatter`."""

    def __init__(self, block: int = q.DEFAULT_BLOCK) -> None:
        self.block = block

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Group,
        op: object,
        async_op: bool = False,
    ) -> None:
        average = self.reduce_op_name(op, "quantized reduce-scatter (qgZ)") == "avg"
        quantized_reduce_scatter(output_tensor, input_tensor, group, average, self.block)


def all_gather_hook(quantized: bool) -> QuantizedAllGather | LoggedAllGather | None:
    """The all-gather hook for stage 3's FSDP2 units: qwZ when ``quantized``; else, while the comms
    logger is on, :class:`LoggedAllGather` (bit-identical, recorded); else None (FSDP2's own)."""
    if quantized:
        return QuantizedAllGather()
    return LoggedAllGather() if _COMMS.enabled else None
