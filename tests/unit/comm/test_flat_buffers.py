"""The gloo implementation of a flat buffer and the transport chosen for one rank (pure parts;
the collectives over ranks are tested in tests/distributed/test_shared_memory_transport.py and
the ZeRO parity tests, under both transports)."""

from __future__ import annotations

import pytest
import torch

from shardwise.comm.flat_buffers import PrivateBuffer, land
from shardwise.comm.host_transport import GlooTransport, choose_host_transport

CPU = torch.device("cpu")


def test_a_private_buffer_is_zero_filled_and_asynchronous() -> None:
    buffer = PrivateBuffer(5, torch.float16, CPU, group=None, rank=0, world=1)
    assert buffer.mine.dtype == torch.float16 and torch.equal(
        buffer.mine, torch.zeros(5, dtype=torch.float16)
    )
    assert buffer.synchronous is False
    buffer.release()  # not releasable: keeps its memory
    assert buffer.mine.numel() == 5


def test_a_releasable_private_buffer_holds_memory_only_between_reserve_and_release() -> None:
    buffer = PrivateBuffer(4, torch.float32, CPU, group=None, rank=0, world=1, releasable=True)
    with pytest.raises(AssertionError, match="reserved before use"):
        _ = buffer.mine
    buffer.reserve()
    first = buffer.mine
    first.fill_(3.0)
    buffer.reserve()  # already reserved: the same memory
    assert buffer.mine is first
    buffer.release()
    with pytest.raises(AssertionError):
        _ = buffer.mine
    buffer.reserve()
    assert buffer.mine is not first and buffer.mine.numel() == 4


def test_land_copies_adds_or_leaves_the_sums_in_place() -> None:
    sums, target = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])
    land(sums, target, accumulate=True)
    assert target.tolist() == [11.0, 22.0]
    land(sums, target, accumulate=False)
    assert target.tolist() == [1.0, 2.0]
    land(sums, None, accumulate=True)  # the sums stay where they are
    land(sums, sums, accumulate=True)
    assert sums.tolist() == [1.0, 2.0]


def test_one_rank_takes_gloo_and_gets_one_staging_buffer_per_bucket() -> None:
    transport = choose_host_transport({CPU}, None, label="ZeRO stage 2", rank=0, world_size=1)
    assert isinstance(transport, GlooTransport)
    staging = transport.allocate_staging([3, 7], torch.float32, CPU)
    for store, numel in zip(staging, (3, 7)):
        store.reserve()
        assert store.mine.numel() == numel and not store.synchronous
    transport.report("ZeRO stage 2", "nothing", "gradients")  # gloo: the opening said why, nothing more
