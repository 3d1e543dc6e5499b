"""deepspeed.utils.timer's SynchronizedWallClockTimer / NoopTimer (shardwise.profiling.named_timers), on a
fake clock: sums, resets, a running timer read mid-interval, DeepSpeed's get_mean scale, the log line."""

from __future__ import annotations

import logging

import pytest

from shardwise.profiling import named_timers as nt
from shardwise.utils.report import report_logger


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [0.0]
    monkeypatch.setattr(nt.time, "perf_counter", lambda: now[0])
    return now


def test_intervals_sum_reset_and_mean(clock: list[float]) -> None:
    timers = nt.SynchronizedWallClockTimer()
    for seconds in (0.002, 0.004, 0.003):
        timers("fwd").start()
        clock[0] += seconds
        timers("fwd").stop()
    assert timers("fwd").elapsed(reset=False) == pytest.approx(9.0)
    assert timers("fwd").mean() == pytest.approx(3.0)
    assert timers.get_mean(["fwd", "missing"], normalizer=2.0) == {"fwd": pytest.approx(1500.0)}
    assert timers("fwd").elapsed() == pytest.approx(9.0) and timers("fwd").elapsed() == 0.0  # reset by default
    timers("bwd").start()
    clock[0] += 0.005
    assert timers("bwd").elapsed() == pytest.approx(5.0) and timers("bwd").started_  # still running
    with pytest.raises(AssertionError, match="already been started"):
        timers("bwd").start()
    assert sorted(timers.get_timers()) == ["bwd", "fwd"]


def test_log_line_and_noop(clock: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    timers = nt.SynchronizedWallClockTimer()
    timers("step").start()
    clock[0] += 0.010
    timers("step").stop()
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    report_logger().addHandler(handler)
    try:
        timers.log(["step", "missing"], normalizer=2.0)
    finally:
        report_logger().removeHandler(handler)
    assert seen == ["[Rank 0] time (ms) | step: 5.00"]
    noop = nt.NoopTimer()
    noop("x").start()
    noop("x").stop()
    assert noop("x").elapsed() == 0 and noop.get_timers() == {} and noop.get_mean(["x"]) is None
