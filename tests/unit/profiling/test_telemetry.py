"""Telemetry pieces without a process group: timers, throughput, progress lines and events,
the post-clip norm, the comms logger's maths and table, the report logger, memory reports."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

from shardwise.comm import comms_logger as cl
from shardwise.config import load_config
from shardwise.monitor import MonitorMaster
from shardwise.monitor.base import Monitor
from shardwise.profiling import progress
from shardwise.profiling.flops_hook import FlopsProfilerHook
from shardwise.profiling.flops_profiler import FlopsProfiler
from shardwise.profiling.memory import format_bytes, memory_report, model_state_bytes
from shardwise.profiling.telemetry import Telemetry, build_telemetry
from shardwise.profiling.timers import PHASES, ThroughputTimer, WallClockTimers
from shardwise.runtime.step_hooks import ForwardContext
from shardwise.step_hook_factory import build_step_hooks
from shardwise.utils.logging import get_logger, set_log_level
from shardwise.utils.report import report_logger


class _Clock:
    def __init__(self, *ticks: float) -> None:
        self.ticks = list(ticks)

    def __call__(self) -> float:
        return self.ticks.pop(0)


class _Recorder(Monitor):
    name = "recorder"

    def __init__(self) -> None:
        self.events: list[tuple[str, float, int]] = []

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        self.events.extend(events)


# ---------------------------------------------------------------------------------- timers
def test_wall_clock_timers_micro_and_window():
    clock = _Clock(0.0, 0.002, 0.010, 0.013, 0.020, 0.024)
    timers = WallClockTimers(True, clock=clock)
    with timers.phase("fwd"):  # 2 ms
        pass
    with timers.phase("fwd"):  # 3 ms
        pass
    with timers.phase("step"):  # 4 ms
        pass
    window = timers.end_window()
    assert window["fwd"] == pytest.approx(5.0) and window["step"] == pytest.approx(4.0) and window["bwd"] == 0
    snapshot = timers.as_dict()
    assert len(snapshot) == 10
    assert snapshot["fwd_microstep"] == pytest.approx(3.0) and snapshot["fwd"] == pytest.approx(5.0)
    assert timers.end_window() == dict.fromkeys(PHASES, 0.0)  # a new window starts empty


def test_disabled_timers_cost_nothing_and_report_nothing():
    timers = WallClockTimers(False, clock=_Clock())  # any clock read would fail: no ticks
    with timers.phase("bwd"):
        pass
    assert timers.as_dict() == {} and timers.phase("fwd") is timers.phase("step")


def test_throughput_timer_skips_warm_up_steps():
    # each step: start at t, stop at t + duration; durations 1.0, 0.5, 0.25, 0.25 s
    clock = _Clock(0.0, 1.0, 2.0, 2.5, 3.0, 3.25, 4.0, 4.25)
    timer = ThroughputTimer(True, batch_size=8, start_step=2, clock=clock)
    rates = []
    for _ in range(4):
        timer.start()
        timer.stop(boundary=True)
        rates.append((timer.current_samples_per_sec, timer.avg_samples_per_sec))
    assert rates[0] == (8.0, None) and rates[1] == (16.0, None)  # first two steps: warm-up
    assert rates[2] == (32.0, 32.0) and rates[3] == (32.0, 32.0)


def test_throughput_spans_the_accumulation_window():
    clock = _Clock(1.0, 1.5)  # only two reads: window start and boundary end
    timer = ThroughputTimer(True, batch_size=4, start_step=0, clock=clock)
    timer.start()
    timer.stop(boundary=False)  # a micro step ends: no clock read, no device sync
    timer.start()  # already running
    timer.stop(boundary=True)
    assert timer.current_samples_per_sec == 8.0  # 4 samples over the window's 0.5 s


# ---------------------------------------------------------------------------------- norms
@pytest.mark.parametrize("clip", [0.5, 1.0, 100.0, 0.0])
def test_post_clip_norm_matches_torch_clipping(clip):
    torch.manual_seed(0)
    grads = [torch.randn(7, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)]
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    pre = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])))
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(params, clip)  # coef = clip / (norm + 1e-6), capped at 1
    after = float(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in params])))
    assert progress.post_clip_norm(pre, clip) == pytest.approx(after, rel=1e-12)
    assert progress.post_clip_norm(pre, clip) <= (clip if clip > 0 else pre)


# ---------------------------------------------------------------------------------- progress
def _stats(**kw) -> progress.StepStats:
    base = dict(
        step=4, samples=32, loss=1.25, lr=[0.001, 0.002], grad_norm_pre_clip=2.0, grad_norm_post_clip=1.0,
        loss_scale=1024.0, skipped=1, samples_per_sec=100.0, avg_samples_per_sec=90.0,
    )  # fmt: skip
    base.update(kw)
    return progress.StepStats(**base)


def test_progress_line_names_pre_and_post_clip():
    line = progress.progress_line(_stats())
    assert line == (
        "step=4, samples=32, loss=1.2500, lr=[0.001, 0.002], grad_norm_pre_clip=2, grad_norm_post_clip=1, "
        "loss_scale=1024, skipped=1, samples/s=100.0, avg_samples/s=90.0"
    )
    skipped = progress.progress_line(_stats(grad_norm_pre_clip=math.inf, grad_norm_post_clip=None, loss=None))
    assert "grad_norm_pre_clip=inf, grad_norm_post_clip=n/a" in skipped and "loss=" not in skipped


def test_step_events_names_and_values():
    events = progress.step_events(_stats())
    assert events == [
        ("Train/Samples/train_loss", 1.25, 32),
        ("Train/Samples/lr", 0.001, 32),
        ("Train/Samples/loss_scale", 1024.0, 32),
        ("Train/Samples/grad_norm_pre_clip", 2.0, 32),
        ("Train/Samples/grad_norm_post_clip", 1.0, 32),
        ("Train/Samples/samples_per_sec", 100.0, 32),
    ]
    overflow = progress.step_events(
        _stats(grad_norm_pre_clip=math.inf, grad_norm_post_clip=None, loss_scale=None)
    )
    assert [n for n, _, _ in overflow] == [
        "Train/Samples/train_loss",
        "Train/Samples/lr",
        "Train/Samples/samples_per_sec",
    ]


def test_telemetry_boundary_on_one_rank(caplog):
    recorder = _Recorder()
    clock = iter(float(i) / 1000 for i in range(1000))  # every read advances 1 ms
    telemetry = Telemetry(
        steps_per_print=2,
        timers=WallClockTimers(True, clock=lambda: next(clock)),
        throughput=ThroughputTimer(False, 8),
        monitor=MonitorMaster([recorder], enabled=True),
        gradient_clipping=1.0,
    )
    caplog.set_level(logging.INFO, logger="shardwise")
    get_logger().addHandler(caplog.handler)
    try:
        for step in (1, 2):
            for micro_loss in (0.5, 0.25):  # GAS 2: the engine hands over loss / GAS
                with telemetry.forward():
                    pass
                with telemetry.phase("bwd"):
                    pass
                telemetry.record_loss(torch.tensor(micro_loss))
            stats = telemetry.on_boundary(
                step=step, samples=8 * step, lr=[0.1], grad_norm=4.0, applied=True, loss_scale=1.0, skipped=0
            )
            assert stats.loss == 0.75 and stats.grad_norm_post_clip == pytest.approx(1.0, rel=1e-6)
    finally:
        get_logger().removeHandler(caplog.handler)
    names = [name for name, _, _ in recorder.events]
    assert names.count("Train/Samples/train_loss") == 2 and "Train/Samples/loss_scale" not in names
    assert names.count("Train/Samples/elapsed_time_ms_forward") == 2
    fwd = [v for n, v, _ in recorder.events if n == "Train/Samples/elapsed_time_ms_forward"]
    assert fwd == pytest.approx([2.0, 2.0])  # two 1 ms forwards per window
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("step=2, samples=16, loss=0.7500")
    # per step: two 1 ms forwards and two 1 ms backwards
    assert lines[1].startswith("time (ms) per step, mean/max over 1 ranks | fwd: 2.00/2.00 | bwd: 2.00/2.00")


def test_eval_forwards_are_not_timed_or_profiled():
    model = nn.Linear(3, 3)
    telemetry = Telemetry(
        steps_per_print=1,
        timers=WallClockTimers(True, clock=_Clock()),  # a clock read would fail: no ticks
        throughput=ThroughputTimer(True, 8, clock=_Clock()),
        monitor=MonitorMaster(),
    )
    profiler = FlopsProfiler(model)
    hook = FlopsProfilerHook(
        profiler, load_config({"train_batch_size": 8}).config.flops_profiler, telemetry.timers, {}
    )
    hook.adjust_forward((), {}, ForwardContext(global_step=1, training=False))
    with telemetry.forward(training=False):
        model(torch.randn(2, 3))
    assert profiler.stats == {}  # profile_step 1, but an eval forward


def test_build_telemetry_from_config():
    cfg = load_config(
        {
            "train_batch_size": 8,
            "steps_per_print": 5,
            "flops_profiler": {"enabled": True},
            "gradient_clipping": 0.5,
        }
    )
    telemetry = build_telemetry(cfg, torch.device("cpu"), rank=0, world_size=1)
    assert telemetry.timers.enabled  # the flops profiler forces the wall-clock timers on
    hooks = build_step_hooks(cfg.config, nn.Linear(2, 2), rank=0, telemetry=telemetry)
    assert [type(h) for h in hooks] == [FlopsProfilerHook] and telemetry.gradient_clipping == 0.5
    assert telemetry.throughput.enabled and telemetry.steps_per_print == 5
    quiet_cfg = load_config({"train_batch_size": 8})
    quiet = build_telemetry(quiet_cfg, torch.device("cpu"), 1, 2)
    assert not quiet.timers.enabled and not quiet.monitor.enabled and not quiet.tracks_loss
    assert not quiet.throughput.enabled  # nothing reports samples/s: no clock reads
    assert len(build_step_hooks(quiet_cfg.config, nn.Linear(2, 2), rank=1, telemetry=quiet)) == 0
    assert len(build_step_hooks(cfg.config, nn.Linear(2, 2), rank=1, telemetry=telemetry)) == 0  # rank 0 only


# ---------------------------------------------------------------------------------- comms logger
def test_bandwidth_formulas():
    # 1 MB in 1 ms on 4 ranks
    algbw, busbw = cl.bandwidth_gbps("all_reduce", 10**6, 1.0, 4)
    assert (algbw, busbw) == pytest.approx((16.0, 8.0 * 2 * 3 / 4))
    algbw, busbw = cl.bandwidth_gbps("all_gather_into_tensor", 10**6, 1.0, 4)  # size x n first
    assert (algbw, busbw) == pytest.approx((32.0, 32.0 * 3 / 4))
    assert cl.bandwidth_gbps("reduce_scatter_tensor", 10**6, 1.0, 4) == pytest.approx((32.0, 24.0))
    assert cl.bandwidth_gbps("all_to_all_single", 10**6, 1.0, 4) == pytest.approx((8.0, 6.0))
    assert cl.bandwidth_gbps("broadcast", 10**6, 1.0, 4) == pytest.approx((8.0, 8.0))
    assert cl.bandwidth_gbps("broadcast", 10**6, 0.0, 4) == (0.0, 0.0)


def test_humanize_and_trimmed_mean():
    assert cl.humanize_bytes(2) == "2.0 B" and cl.humanize_bytes(162) == "162.0 B"
    assert cl.humanize_bytes(1536) == "1.5 KB" and cl.humanize_bytes(3 * 2**30) == "3.0 GB"
    assert cl.trimmed_mean([5.0] * 18 + [0.0, 1000.0]) == 5.0 and cl.trimmed_mean([]) == 0.0


def test_comms_logger_records_filters_and_formats(caplog):
    logger = cl.CommsLogger()
    logger.configure({"enabled": True, "prof_all": False, "prof_ops": ["all_reduce"], "verbose": True})
    assert logger.start("broadcast", 16, 2, on_cuda=False) is None  # not in prof_ops
    pending = logger.start("all_reduce", 8, 2, on_cuda=False)
    assert pending is not None
    caplog.set_level(logging.INFO, logger="shardwise")
    get_logger().addHandler(caplog.handler)
    try:
        pending.complete()
    finally:
        get_logger().removeHandler(caplog.handler)
    assert caplog.records[0].getMessage().startswith("comm op: all_reduce | time (ms): ")
    for latency in (2.0, 4.0):
        logger.record("all_reduce", 1024, latency, 2)
    summary = logger.summary()
    assert list(summary) == ["all_reduce"] and sorted(summary["all_reduce"]) == [8, 1024]
    row = summary["all_reduce"][1024]
    assert (row["count"], row["total_latency_ms"], row["avg_latency_ms"], row["msg_size_str"]) == (
        2,
        6.0,
        3.0,
        "1.0 KB",
    )
    table = cl.format_summary(summary).splitlines()
    assert table[0].startswith("Comm. Op            Message Size        Count")
    assert table[1] == "all_reduce" and table[3].split()[:4] == ["1.0", "KB", "2", "6.00"]
    logger.reset()
    assert logger.summary() == {}
    logger.configure(None)
    assert not logger.enabled


def test_configure_accepts_config_objects_and_keywords():
    try:
        cfg = load_config(
            {"train_batch_size": 8, "comms_logger": {"enabled": True, "prof_ops": ["broadcast"]}}
        )
        cl.configure(cfg)
        assert cl.COMMS_LOGGER.enabled and cl.COMMS_LOGGER.prof_ops == ["broadcast"]
        cl.configure(verbose=True, prof_all=False)
        assert cl.COMMS_LOGGER.verbose and not cl.COMMS_LOGGER.prof_all
        with pytest.raises(ValueError):
            cl.configure_comms_logger({"enabeld": True})
    finally:
        cl.configure({"enabled": False, "prof_all": True, "prof_ops": [], "verbose": False})


# ---------------------------------------------------------------------------------- logging, memory
def test_report_logger_shows_at_default_level_and_follows_error(caplog):
    get_logger().addHandler(caplog.handler)
    try:
        get_logger().info("library detail")  # the library itself stays quiet at WARNING
        report_logger().info("requested output")
        set_log_level("error")
        report_logger().info("silenced")
        set_log_level("debug")
        report_logger().debug("debug detail")
    finally:
        set_log_level("warning")
        get_logger().removeHandler(caplog.handler)
    assert [r.getMessage() for r in caplog.records] == ["requested output", "debug detail"]


def test_model_state_bytes_and_report():
    model = nn.Linear(32, 16)
    model.weight.grad = torch.zeros_like(model.weight)
    optimizer = torch.optim.Adam(model.parameters())
    states = model_state_bytes(model, optimizer)
    assert (states.params, states.grads, states.optimizer_state) == ((32 * 16 + 16) * 4, 32 * 16 * 4, 0)
    model.bias.grad = torch.zeros_like(model.bias)
    optimizer.step()  # exp_avg and exp_avg_sq appear
    assert model_state_bytes(model, optimizer).optimizer_state == 2 * (32 * 16 + 16) * 4
    report = memory_report(model, optimizer).splitlines()
    assert report[0].startswith(f"model states on this rank: {format_bytes(4 * 528 * 4)}")
    assert "host RSS" in report[1]
