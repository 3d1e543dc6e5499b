"""How checkpoint inputs are kept: DeepSpeed's activation rule, host memory, the contiguous
buffer's slots (exhaustion, release at backward or when a graph is dropped, a second read)."""

from __future__ import annotations

import gc

import pytest
import torch

from shardwise import checkpointing
from shardwise.checkpointing.contiguous import ContiguousPool
from shardwise.checkpointing.settings import CheckpointingSettings
from shardwise.checkpointing.storage import ActivationStorage, Stored
from shardwise.config import ConfigError

CONTIGUOUS = CheckpointingSettings(
    partition_activations=True, contiguous_memory_optimization=True, number_checkpoints=2
)


def test_only_activations_are_transformed() -> None:
    store = ActivationStorage(CheckpointingSettings(partition_activations=True, mp_size=4, mp_rank=0))
    assert store.pack(torch.ones(3, dtype=torch.long)) is not None
    ints, param, tiny = torch.ones(8, dtype=torch.long), torch.nn.Parameter(torch.ones(8)), torch.ones(3)
    assert store.pack(ints) is ints and store.pack(param) is param and store.pack(tiny) is tiny
    marked = torch.ones(8)
    marked.no_checkpointing = True  # type: ignore[attr-defined]
    assert store.pack(marked) is marked


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]  # a GPU machine adds the offload case


@pytest.mark.parametrize("device", DEVICES)
def test_cpu_checkpointing_keeps_saved_activations_in_host_memory(device: str) -> None:
    store = ActivationStorage(CheckpointingSettings(cpu_checkpointing=True))
    x = torch.randn(2, 3, 4, device=device)
    stored = store.pack(x)
    assert isinstance(stored, Stored) and stored.data.device.type == "cpu"
    if device == "cpu":
        assert stored.data.data_ptr() == x.data_ptr()  # already in host memory: kept without a copy
    else:
        assert stored.data.is_pinned()
    back = store.unpack(stored)
    assert back.device == x.device and back.shape == x.shape and torch.equal(back, x)


def test_the_contiguous_buffer_hands_out_slots_and_copies_out_on_unpack() -> None:
    store = ActivationStorage(CONTIGUOUS)
    a, b = torch.randn(2, 5), torch.randn(2, 5)
    sa, sb = store.pack(a), store.pack(b)
    assert store.pool is not None and store.pool.allocated_bytes() == 2 * 10 * 4
    assert sa.data.data_ptr() + 10 * 4 == sb.data.data_ptr() or sb.data.data_ptr() + 40 == sa.data.data_ptr()
    with pytest.raises(ConfigError) as info:
        store.pack(torch.randn(2, 5))
    assert info.value.key == "activation_checkpointing.number_checkpoints" and "reset()" in info.value.fix
    got = store.unpack(sa)
    assert torch.equal(got, a) and got.data_ptr() != sa.data.data_ptr()
    store.pack(torch.randn(2, 5))  # the slot read by backward is free again
    with pytest.raises(RuntimeError, match="read twice"):
        store.unpack(sa)


def test_a_graph_dropped_without_backward_gives_its_slot_back() -> None:
    store = ActivationStorage(CONTIGUOUS)
    stored = store.pack(torch.randn(6))
    assert store.pool is not None
    assert store.pool.free_slots(torch.float32, torch.device("cpu"), 6) == 1
    del stored
    gc.collect()
    assert store.pool.free_slots(torch.float32, torch.device("cpu"), 6) == 2


def test_forwards_without_backward_fill_the_buffer_until_reset() -> None:
    checkpointing.configure(
        None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=1
    )
    try:
        lin = torch.nn.Linear(4, 4)
        x = torch.randn(2, 4, requires_grad=True)
        kept = checkpointing.checkpoint(lin, x)  # graph alive, slot taken
        with pytest.raises(ConfigError):
            checkpointing.checkpoint(lin, x)
        checkpointing.reset()  # DeepSpeed's reset: new buffers; the live graph keeps its own slot
        again = checkpointing.checkpoint(lin, x)
        (kept.sum() + again.sum()).backward()
        assert x.grad is not None
    finally:
        checkpointing.configure(None)


def test_pool_slots_are_released_once() -> None:
    pool = ContiguousPool(slots=1)
    slot = pool.take(torch.ones(2))
    slot.release()
    slot.release()
    assert pool.free_slots(torch.float32, torch.device("cpu"), 2) == 1
