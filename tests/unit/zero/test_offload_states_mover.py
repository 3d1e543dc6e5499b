"""The storage moves behind ``offload_states`` (zero/offload_states.py), on plain tensors: views
follow their buffer, the device storage is freed and regrown, references nobody listed are valid
again after the reload, shared segments are copied but not freed, and bad arguments are refused."""

from __future__ import annotations

import logging

import pytest
import torch

import shardwise
from shardwise.zero.offload_states import OffloadStateType, StateOffloader, StateOffloading, get_state_devices

LP, OPT = OffloadStateType.lp_params, OffloadStateType.optim_states


def test_a_buffer_and_its_views_move_and_come_back() -> None:
    buffer = torch.arange(8, dtype=torch.float32)
    first, second = buffer[0:3], buffer[3:7].view(2, 2)
    hidden = buffer[6:8]  # a reference the strategy does not list (FSDP2's own handle, say)
    moment = torch.full((4,), 2.0)
    original = buffer.untyped_storage()
    offloader = StateOffloader()
    held = {LP: [buffer, first, second], OPT: [moment]}
    offloader.offload(held, [LP], pin_memory=True, non_blocking=False)
    assert original.nbytes() == 0  # the device storage is freed
    assert all(offloader.is_offloaded(t) for t in (buffer, first, second)) and not offloader.is_offloaded(
        moment
    )
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()  # still one buffer
    assert first.tolist() == [0.0, 1.0, 2.0] and second.tolist() == [[3.0, 4.0], [5.0, 6.0]]
    assert offloader.offloaded == {LP}
    first.add_(10.0)  # a write to the host copy while offloaded is kept
    offloader.reload(non_blocking=False)
    assert buffer.untyped_storage() is not None and original.nbytes() == 32
    assert buffer.untyped_storage().data_ptr() == original.data_ptr()  # back in the same storage
    assert first.tolist() == [10.0, 11.0, 12.0] and buffer[0].item() == 10.0
    assert hidden.tolist() == [6.0, 7.0]  # the unlisted view sees the restored storage
    assert offloader.offloaded == set() and not offloader.is_offloaded(buffer)


def test_shared_segments_are_copied_but_not_freed() -> None:
    segment = torch.zeros(4).share_memory_()
    offloader = StateOffloader()
    offloader.offload({LP: [segment]}, [LP], pin_memory=False, non_blocking=False)
    assert offloader.is_offloaded(segment)
    offloader.reload(non_blocking=False)
    assert segment.untyped_storage().is_shared() and segment.tolist() == [0.0] * 4


def test_a_state_offloaded_twice_or_not_held_is_not_moved_again() -> None:
    moment = torch.ones(3)
    offloader = StateOffloader()
    offloader.offload(
        {OPT: [moment]}, [OPT, OffloadStateType.contiguous_grad_buffer], pin_memory=False, non_blocking=False
    )
    host = moment.untyped_storage().data_ptr()
    offloader.offload({OPT: [moment]}, [OPT], pin_memory=False, non_blocking=False)
    assert moment.untyped_storage().data_ptr() == host
    assert offloader.offloaded == {OPT}  # contiguous_grad_buffer: not this strategy's state


class _Strategy(StateOffloading):
    def __init__(self) -> None:
        self.moment = torch.ones(2)

    def held_states(self) -> dict[OffloadStateType, list[torch.Tensor]]:
        return {OPT: [self.moment]}


def test_device_and_names_are_checked(caplog: pytest.LogCaptureFixture) -> None:
    strategy = _Strategy()
    with pytest.raises(ValueError, match="'nvme'"):
        strategy.offload_states(device="nvme")
    with pytest.raises(ValueError, match="'grads' is not a state name"):
        strategy.offload_states(include=["grads"])
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        strategy.offload_states(device="none")
    assert "nothing moved" in caplog.text and strategy.offloaded_states == set()
    strategy.offload_states(include=["optim_states"])
    assert strategy.offloaded_states == {OPT} and strategy.state_offloader.is_offloaded(strategy.moment)
    strategy.reload_states()
    assert strategy.offloaded_states == set()


def test_state_devices_as_deepspeed_reports_them() -> None:
    strategy = _Strategy()
    assert get_state_devices(strategy, "optim_states") == {torch.device("cpu")}
    assert get_state_devices(strategy, OffloadStateType.lp_params) == set()  # not held: no device
    with pytest.raises(TypeError, match="ZeRO strategy"):
        get_state_devices(object(), "optim_states")


def test_stage3_with_offload_param_is_refused() -> None:
    """As in DeepSpeed: parameters the config offloads are not moved again (a world of one)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
    }
    engine, *_ = shardwise.initialize(model=model, config=config)
    with pytest.raises(RuntimeError, match="offload_param keeps the parameters on the host"):
        engine.offload_states()
    assert engine.optimizer.offloaded_states == set()
