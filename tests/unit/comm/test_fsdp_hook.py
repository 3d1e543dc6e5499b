"""The base of stage 3's FSDP2 collective hooks (comm/quantized_collectives.FsdpHook)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwise.comm.fsdp_shared_hooks import SharedAllGather, SharedReduceScatter
from shardwise.comm.quantized_collectives import FsdpHook, QuantizedReduceScatter
from shardwise.zero.deferred_reduce_scatter import DeferredReduceScatter


def test_reduce_op_name_accepts_sum_and_avg_and_names_the_hook_otherwise() -> None:
    assert FsdpHook.reduce_op_name(dist.ReduceOp.SUM, "h") == "sum"
    assert FsdpHook.reduce_op_name(dist.ReduceOp.AVG, "h") == "avg"
    with pytest.raises(ValueError, match=r"my hook: FSDP2 asked for .*MAX.*only SUM and AVG"):
        FsdpHook.reduce_op_name(dist.ReduceOp.MAX, "my hook")


def test_every_stage3_hook_allocates_plain_buffers_by_default() -> None:
    for hook in (FsdpHook(), QuantizedReduceScatter(), DeferredReduceScatter()):
        t = hook.allocate((3, 2), dtype=torch.bfloat16, device=torch.device("cpu"))
        assert t.shape == (3, 2) and t.dtype == torch.bfloat16
    assert issubclass(SharedAllGather, FsdpHook) and issubclass(SharedReduceScatter, FsdpHook)
