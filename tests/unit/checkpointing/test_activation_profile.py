"""profile and synchronize_checkpoint_boundary: forward and recompute times are recorded and
reach the engine's wall-clock breakdown; the device is synchronized around every call."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from shardwise import checkpointing
from shardwise.checkpointing import profile
from shardwise.config import load_config
from shardwise.profiling.telemetry import build_telemetry


@pytest.fixture(autouse=True)
def _defaults() -> Iterator[None]:
    checkpointing.configure(None)
    checkpointing.profile_times().reset()
    yield
    checkpointing.configure(None)
    checkpointing.profile_times().reset()


@pytest.mark.parametrize("fn", [checkpointing.checkpoint, checkpointing.non_reentrant_checkpoint])
def test_profile_records_forward_and_recompute_and_the_telemetry_reports_them(fn) -> None:
    checkpointing.configure(None, profile=True)
    lin = torch.nn.Linear(8, 8)
    fn(lin, torch.randn(4, 8, requires_grad=True)).sum().backward()
    times = checkpointing.profile_times()
    assert (times.forward_calls, times.recompute_calls) == (1, 1)
    assert times.forward_ms > 0 and times.recompute_ms > 0
    telemetry = build_telemetry(load_config({"train_batch_size": 1}), torch.device("cpu"), 0, 1)
    telemetry.on_boundary(
        step=1, samples=1, lr=[0.1], grad_norm=None, applied=True, loss_scale=1.0, skipped=0
    )
    timers = telemetry.wall_clock_timers()
    assert timers["act_ckpt_forward"] > 0 and timers["act_ckpt_recompute"] > 0
    assert times.forward_ms == 0.0  # the window closed at the boundary


def test_without_profile_nothing_is_recorded_or_reported() -> None:
    lin = torch.nn.Linear(8, 8)
    checkpointing.checkpoint(lin, torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert checkpointing.profile_times().forward_calls == 0
    telemetry = build_telemetry(load_config({"train_batch_size": 1}), torch.device("cpu"), 0, 1)
    assert "act_ckpt_forward" not in telemetry.wall_clock_timers()


@pytest.mark.parametrize("sync", [True, False])
def test_synchronize_checkpoint_boundary_syncs_before_and_after_forward_and_recompute(
    monkeypatch, sync
) -> None:
    calls = []
    monkeypatch.setattr(profile, "synchronize_device", lambda: calls.append(1))
    checkpointing.configure(None, synchronize=sync)
    lin = torch.nn.Linear(8, 8)
    checkpointing.checkpoint(lin, torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert len(calls) == (4 if sync else 0)
