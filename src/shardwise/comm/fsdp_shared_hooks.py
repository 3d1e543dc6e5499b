"""ZeRO stage 3 on one host: FSDP2's all-gathers and reduce-scatters through shared memory.

ZeRO's stages 0-2 keep their flat buffers in shared memory (their
:class:`~shardwise.comm.host_transport.HostTransport` allocates them). Stage 3's buffers belong
to FSDP2, which allocates them per unit and per collective, so here the collectives themselves are replaced through FSDP2's hooks (``set_custom_all_gather`` and
``set_custom_reduce_scatter``), with a small staging buffer per rank in shared memory
(:mod:`shardwise.comm.host_transport` opens it):

* all-gather: each rank stages its shard of the unit (one copy of ``1/world`` of the unit),
  then copies the other ranks' shards out of their staging buffers; gloo would have sent the
  unit over loopback TCP, at a CPU cost of several times that copy on each rank;
* reduce-scatter: FSDP2 asks the hook for the buffer it packs the unit's gradients into; the
  hook hands it the staging buffer itself, so each rank then sums its slice over the ranks'
  buffers, in rank order, straight into its shard gradient: no copy at all, one summing pass.

Both are synchronous (fenced by the shared barrier on entry and exit, like every collective of
:mod:`shardwise.comm.shared_memory`): the work is a memory copy, which FSDP2's asynchronous
path would only have moved to gloo's thread on the same cores. The staging buffers are sized
for the largest unit (its shard for the gather, the whole unit for the reduction, at 4 bytes an
element); a call the buffers cannot take (a larger dtype, another group such as hpZ's secondary
one) goes through gloo as before, decided from numbers every rank shares. Sums in rank order
make every rank's result identical and the same as gloo's with two ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from shardwise import comm
from shardwise.comm import collectives
from shardwise.comm.fsdp_internals import unit_padded_shard_numel, unit_shard_groups
from shardwise.comm.group_type import Group
from shardwise.comm.host_transport import open_host_transport, report_gloo, report_shared
from shardwise.comm.quantized_collectives import FsdpHook, LoggedAllGather
from shardwise.comm.shared_memory import SharedBuffers

__all__ = ["SharedAllGather", "SharedReduceScatter", "open_unit_comms"]

_STAGING_ITEMSIZE = 4  # fp32 and narrower dtypes fit
_LABEL = "ZeRO stage 3"


class SharedAllGather(FsdpHook):
    """FSDP2 all-gather hook through :meth:`SharedBuffers.gather_shards` (gloo outside its group)."""

    def __init__(self, buffers: SharedBuffers, group: Group, capacity: int) -> None:
        self.buffers, self.group, self.capacity = buffers, group, capacity
        self._fallback = LoggedAllGather()

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Group, async_op: bool = False
    ) -> None:
        if group is not self.group or input_tensor.numel() * input_tensor.element_size() > self.capacity:
            self._fallback(output_tensor, input_tensor, group, async_op)
            return
        self.buffers.gather_shards(output_tensor, input_tensor)


class SharedReduceScatter(FsdpHook):
    """FSDP2 reduce-scatter hook through :meth:`SharedBuffers.sum_shards` (gloo outside its group).

    FSDP2 allocates the packed gradient (the reduce-scatter's input) first, then the output
    shard; the first allocation after each reduction that fits is the staging buffer itself.
    """

    def __init__(self, buffers: SharedBuffers, group: Group, capacity: int) -> None:
        self.buffers, self.group, self.capacity = buffers, group, capacity
        self._input_next = True

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(size)
        if self._input_next and numel * torch.empty((), dtype=dtype).element_size() <= self.capacity:
            self._input_next = False
            return self.buffers.staging(numel, dtype).view(*size)
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Group,
        op: object,
        async_op: bool = False,
    ) -> None:
        self._input_next = True
        op_name = self.reduce_op_name(op, "stage 3 reduce-scatter hook")
        staging = self.buffers.staging(1, output_tensor.dtype)
        lo, hi = staging.data_ptr(), staging.data_ptr() + self.capacity
        if lo <= output_tensor.data_ptr() < hi:  # FSDP2 changed its allocation order: never alias
            raise RuntimeError(
                "stage 3 reduce-scatter hook: the output shard was allocated in the staging buffer"
            )
        nbytes = input_tensor.numel() * input_tensor.element_size()
        if group is not self.group or nbytes > self.capacity:
            collectives.reduce_scatter_flat(output_tensor, input_tensor, group, op=op_name)
            return
        self.buffers.sum_shards(output_tensor, input_tensor)
        if op_name == "avg":
            output_tensor.div_(comm.get_world_size(group))


def _largest_unit_shard(fsdp_modules: Sequence[Any]) -> int:
    """Elements in the largest unit's padded shard (what one rank contributes to its all-gather)."""
    largest = 0
    for module in fsdp_modules:
        for numel in unit_padded_shard_numel(module):
            largest = max(largest, numel)
    return largest


def _unit_group(fsdp_modules: Sequence[Any]) -> Group:
    """The process group FSDP2 gathers and reduces the units over (one for all units), or None."""
    groups = {id(group): group for module in fsdp_modules for group in unit_shard_groups(module)}
    return next(iter(groups.values())) if len(groups) == 1 else None


def open_unit_comms(
    fsdp_modules: Sequence[object], rank: int
) -> tuple[SharedAllGather, SharedReduceScatter] | None:
    """The two hooks when every rank of the units' group runs on this host over gloo on CPU;
    None otherwise (``comm.host_transport`` says why on rank 0). Collective."""
    group = _unit_group(fsdp_modules)
    if group is None:
        return None
    world = comm.get_world_size(group)
    opened = open_host_transport(group, torch.device("cpu"), label=_LABEL, rank=rank, world_size=world)
    if opened is None:
        return None
    shard_bytes = _largest_unit_shard(fsdp_modules) * _STAGING_ITEMSIZE
    gather = opened.allocate(shard_bytes, torch.uint8)
    reduce = opened.allocate(shard_bytes * world, torch.uint8) if not isinstance(gather, str) else gather
    if isinstance(reduce, str):
        report_gloo(_LABEL, "FSDP2's collectives", reduce, rank)
        return None
    assert not isinstance(gather, str)
    report_shared(
        _LABEL,
        world,
        "FSDP2's all-gathers and reduce-scatters go",
        rank,
        extra=f"{shard_bytes * (world + 1) / 2**20:.1f} MiB of staging per rank; ",
    )
    return SharedAllGather(gather, group, shard_bytes), SharedReduceScatter(
        reduce, group, shard_bytes * world
    )
