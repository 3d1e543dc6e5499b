"""The Megatron-style RNG tracker on CPU: seeds per spec 6.6, fork semantics, errors."""

from __future__ import annotations

import pytest
import torch

from shardwise import checkpointing
from shardwise.checkpointing.rng import MODEL_PARALLEL_RNG, RngStatesTracker


def test_model_parallel_seed_is_seed_plus_2718_plus_the_tensor_parallel_rank() -> None:
    checkpointing.model_parallel_cuda_manual_seed(100, tp_rank=3)
    with checkpointing.get_cuda_rng_tracker().fork():
        tracked = torch.rand(3)
    default = torch.rand(3)
    torch.manual_seed(100 + 2718 + 3)
    expected_tracked = torch.rand(3)
    torch.manual_seed(100)
    assert torch.equal(tracked, expected_tracked) and torch.equal(default, torch.rand(3))


def test_the_default_rank_comes_from_the_configured_mpu() -> None:
    class Mpu:
        def get_model_parallel_group(self) -> None:
            return None

        def get_model_parallel_rank(self) -> int:
            return 1

        def get_model_parallel_world_size(self) -> int:
            return 2

    checkpointing.configure(Mpu())
    try:
        checkpointing.model_parallel_cuda_manual_seed(5)
        with checkpointing.get_cuda_rng_tracker().fork():
            tracked = torch.rand(2)
        torch.manual_seed(5 + 2718 + 1)
        assert torch.equal(tracked, torch.rand(2))
    finally:
        checkpointing.configure(None)
        checkpointing.settings._current = checkpointing.CheckpointingSettings()


def test_fork_advances_its_stream_and_leaves_the_default_generator_alone() -> None:
    tracker = RngStatesTracker()
    torch.manual_seed(1)
    tracker.add("s", 9)
    before = torch.get_rng_state()
    with tracker.fork("s"):
        first = torch.rand(2)
    with tracker.fork("s"):
        second = torch.rand(2)
    assert torch.equal(torch.get_rng_state(), before) and not torch.equal(first, second)


def test_tracker_errors_name_the_problem() -> None:
    tracker = RngStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="'a'"):
        tracker.add("a", 2)
    with pytest.raises(KeyError, match="model_parallel_cuda_manual_seed"), tracker.fork(MODEL_PARALLEL_RNG):
        pass
    assert checkpointing.CudaRNGStatesTracker is RngStatesTracker
