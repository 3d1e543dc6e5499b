"""Step telemetry: everything the engine reports, behind a few calls.

The engine stays an orchestrator: it wraps its phases in ``telemetry.phase(...)``,
hands over the loss of each backward, and at each accumulation boundary calls
:meth:`Telemetry.on_boundary` with the step's numbers. This module decides the rest:

* the wall-clock timers (``wall_clock_breakdown``) and the throughput timer;
* the window loss, averaged over ranks;
* every ``steps_per_print`` steps, one progress line (and with the timers, one timer
  line aggregated over ranks), through :func:`shardwise.utils.report.report_logger`
  so it shows on rank 0 at the default log level;
* at every boundary, monitor events (rank 0 writes);
* the start-up memory report.

The flops profiler acts on the step through its own step hook
(:mod:`shardwise.profiling.flops_hook`); this module only forces the timers on for it.

Values that need every rank (the loss mean, timer mean and max) are gathered with one
small all-gather, only on boundaries where something will be printed or logged, and
every rank makes the same decision, so the collective always matches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from shardwise.config.resolve import ResolvedConfig
from shardwise.monitor.master import MonitorMaster, build_monitor
from shardwise.precision.loss_scaler import NoOpLossScaler
from shardwise.profiling import progress
from shardwise.profiling.memory import memory_report
from shardwise.profiling.timers import FORWARD, PHASES, ThroughputTimer, WallClockTimers
from shardwise.utils.report import report_logger

__all__ = ["Telemetry", "build_telemetry"]

_UNTIMED = contextlib.nullcontext()


class Telemetry:
    """Timers, progress reporting and monitors of one engine.

    Args:
        steps_per_print: progress-line interval in optimizer steps (None: never).
        timers: the wall-clock timers (disabled unless ``wall_clock_breakdown``).
        throughput: the samples/s timer.
        monitor: the monitor fan-out (``engine.monitor``).
        gradient_clipping: the clip threshold (for the post-clip norm); 0 = none.
        loss_scaling: whether a loss scale is reported (fp16).
        rank: global rank.
        world_size: ranks the values are aggregated over.
        device: where the gathered tensor lives (CUDA under nccl).
        memory_breakdown: log the memory report at start-up.
        context: run facts for reports (world/dp/mp sizes, samples per step).

    Example:
        >>> t = Telemetry(steps_per_print=None, timers=WallClockTimers(False),
        ...               throughput=ThroughputTimer(False, 8), monitor=MonitorMaster())
        >>> with t.phase("fwd"):
        ...     pass
    """

    def __init__(
        self,
        *,
        steps_per_print: int | None,
        timers: WallClockTimers,
        throughput: ThroughputTimer,
        monitor: MonitorMaster,
        gradient_clipping: float = 0.0,
        loss_scaling: bool = False,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | None = None,
        memory_breakdown: bool = False,
        context: dict[str, Any] | None = None,
    ) -> None:
        self.steps_per_print = steps_per_print
        self.timers = timers
        self.throughput = throughput
        self.monitor = monitor
        self.gradient_clipping = gradient_clipping
        self.loss_scaling = loss_scaling
        self.rank = rank
        self.world_size = world_size
        self.device = device or torch.device("cpu")
        self.memory_breakdown = memory_breakdown
        self.context = dict(context or {})
        self.tracks_loss = bool(steps_per_print) or monitor.enabled
        self._loss_sum: torch.Tensor | None = None
        self._interval = dict.fromkeys(PHASES, 0.0)
        self._interval_steps = 0
        self.last_stats: progress.StepStats | None = None

    # ------------------------------------------------------------------ engine hooks
    def phase(self, name: str) -> AbstractContextManager[None]:
        """Time phase ``name`` (``"fwd"``, ``"bwd"``, ``"bwd_inner"``, ``"bwd_allreduce"``, ``"step"``)."""
        return self.timers.phase(name)

    def forward(self, training: bool = True) -> AbstractContextManager[None]:
        """Enter around the module's forward: starts the clocks.

        Forwards in eval mode (``training=False``: evaluation between steps) are not timed
        or counted in the throughput.
        """
        if not training:
            return _UNTIMED
        self.throughput.start()
        return self.timers.phase(FORWARD)

    def record_loss(self, loss: torch.Tensor) -> None:
        """Add one backward's (already GAS-divided) loss to the window; no device sync."""
        if not self.tracks_loss:
            return
        value = loss.detach().float()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value

    def after_step(self, boundary: bool) -> None:
        """``step()`` finished (every micro step): stops the throughput clock."""
        self.throughput.stop(boundary)

    def on_start(self, model: nn.Module, optimizer: object) -> None:
        """Once, when the engine is ready: the memory report if ``memory_breakdown``."""
        if self.memory_breakdown and self.rank == 0:
            report_logger().info(
                "memory at start-up (rank 0):\n%s", memory_report(model, optimizer, self.device)
            )

    # ------------------------------------------------------------------ the boundary
    def on_boundary(
        self,
        *,
        step: int,
        samples: int,
        lr: Sequence[float],
        grad_norm: float | None,
        applied: bool,
        loss_scale: float,
        skipped: int,
    ) -> progress.StepStats:
        """Report one optimizer step (call on every rank, after the counters moved).

        Args:
            step: ``global_steps`` after this step.
            samples: ``global_samples`` after this step.
            lr: learning rate per param group.
            grad_norm: the norm before clipping (inf after an overflow), or None.
            applied: whether the optimizer updated the parameters.
            loss_scale: current loss scale.
            skipped: steps skipped so far.

        Returns:
            The reported numbers (also kept as ``last_stats``).
        """
        window = self.timers.end_window()
        checkpoint_times = _checkpoint_window()
        for name in PHASES:
            self._interval[name] += window[name]
        self._interval_steps += 1
        printing = bool(self.steps_per_print) and step % self.steps_per_print == 0  # type: ignore[operator]
        loss, window_mean, interval_mean, interval_max = self._gather(
            window, printing or self.monitor.enabled
        )
        stats = progress.StepStats(
            step=step,
            samples=samples,
            loss=loss,
            lr=list(lr),
            grad_norm_pre_clip=grad_norm,
            grad_norm_post_clip=progress.post_clip_norm(grad_norm, self.gradient_clipping)
            if applied
            else None,
            loss_scale=loss_scale if self.loss_scaling else None,
            skipped=skipped,
            samples_per_sec=self.throughput.current_samples_per_sec if self.throughput.enabled else None,
            avg_samples_per_sec=self.throughput.avg_samples_per_sec if self.throughput.enabled else None,
        )
        self.last_stats = stats
        if self.monitor.enabled:
            events = progress.step_events(stats)
            if self.timers.enabled:
                events += progress.timer_events(window_mean, samples)
            self.monitor.write_events(events)
        if printing:
            log = report_logger()
            log.info("%s", progress.progress_line(stats))
            if self.timers.enabled:
                log.info(
                    "%s",
                    progress.timers_line(interval_mean, interval_max, self.world_size, self._interval_steps),
                )
            if checkpoint_times is not None:
                log.info(
                    "activation checkpointing (rank %d, last step): forward %.2f ms, recompute %.2f ms",
                    self.rank,
                    checkpoint_times["act_ckpt_forward"],
                    checkpoint_times["act_ckpt_recompute"],
                )
            self._interval = dict.fromkeys(PHASES, 0.0)
            self._interval_steps = 0
        return stats

    def _gather(
        self, window: dict[str, float], needed: bool
    ) -> tuple[float | None, dict[str, float], dict[str, float], dict[str, float]]:
        """Window loss mean, window timer means, interval timer mean and max, over ranks."""
        loss_sum = self._loss_sum
        self._loss_sum = None
        if not needed:
            return None, window, dict(self._interval), dict(self._interval)
        row = [0.0 if loss_sum is None else float(loss_sum), 0.0 if loss_sum is None else 1.0]
        row += [window[name] for name in PHASES] + [self._interval[name] for name in PHASES]
        rows = self._all_gather(row)
        means, maxes = progress.mean_and_max(rows)
        counted = sum(r[1] for r in rows)
        loss = sum(r[0] for r in rows) / counted if counted else None
        n = len(PHASES)
        window_mean = dict(zip(PHASES, means[2 : 2 + n]))
        interval_mean = dict(zip(PHASES, means[2 + n :]))
        interval_max = dict(zip(PHASES, maxes[2 + n :]))
        return loss, window_mean, interval_mean, interval_max

    def _all_gather(self, row: list[float]) -> list[list[float]]:
        from shardwise.comm.init import is_initialized

        if self.world_size == 1 or not is_initialized():
            return [row]
        from shardwise.comm.collectives import all_gather_flat

        mine = torch.tensor(row, dtype=torch.float64, device=self.device)
        out = torch.empty(len(row) * self.world_size, dtype=torch.float64, device=self.device)
        all_gather_flat(out, mine)
        return out.view(self.world_size, len(row)).tolist()

    def wall_clock_timers(self) -> dict[str, float]:
        """``engine.get_wall_clock_timers()``: the last micro step and window, in ms.

        With ``activation_checkpointing.profile`` on, also the last window's checkpointed
        forward and recompute times (``act_ckpt_forward``, ``act_ckpt_recompute``).
        """
        timers = self.timers.as_dict()
        from shardwise.checkpointing import current_settings, profile_times

        if current_settings().profile:
            timers.update(profile_times().last_window)
        return timers


def _checkpoint_window() -> dict[str, float] | None:
    """Close the activation-checkpointing profile window (None when ``profile`` is off)."""
    from shardwise.checkpointing import current_settings, profile_times

    if not current_settings().profile:
        return None
    return profile_times().end_window()


def build_telemetry(
    config: ResolvedConfig,
    device: torch.device,
    rank: int,
    world_size: int,
    *,
    dp_size: int | None = None,
    mp_size: int = 1,
    precision: Any = None,
    monitor: MonitorMaster | None = None,
) -> Telemetry:
    """Build the engine's telemetry from a resolved config.

    Args:
        config: the resolved config (its ``batch`` gives the sizes).
        device: the training device.
        rank: global rank.
        world_size: all ranks.
        dp_size: data-parallel ranks (defaults to ``world_size``).
        mp_size: model-parallel ranks.
        precision: the precision policy; the loss scale is reported when it scales losses (fp16).
        monitor: a monitor fan-out already built (else built here from the config).

    Raises:
        ConfigError: an enabled monitor's package is missing.

    Example:
        >>> from shardwise.config import load_config
        >>> cfg = load_config({"train_batch_size": 8, "steps_per_print": 10})
        >>> build_telemetry(cfg, torch.device("cpu"), 0, 1).steps_per_print
        10
    """
    sections, batch = config.config, config.batch
    # Enabling the flops profiler (a step hook) forces the timers on: its report needs bwd and step latency.
    timers_on = bool(sections.wall_clock_breakdown or sections.flops_profiler.enabled)
    throughput_cfg = sections.timers.throughput
    loss_scaling = precision is not None and not isinstance(precision.loss_scaler, NoOpLossScaler)
    monitor = monitor if monitor is not None else build_monitor(config, rank)
    return Telemetry(
        steps_per_print=sections.steps_per_print,
        timers=WallClockTimers(timers_on, device),
        throughput=ThroughputTimer(
            # measured only when reported: no clock reads or device syncs otherwise
            throughput_cfg.enabled and bool(sections.steps_per_print or monitor.enabled),
            batch.train_batch_size,
            device=device,
            synchronized=throughput_cfg.synchronized,
        ),
        monitor=monitor,
        gradient_clipping=float(sections.gradient_clipping),
        loss_scaling=loss_scaling,
        rank=rank,
        world_size=world_size,
        device=device,
        memory_breakdown=bool(sections.memory_breakdown),
        context={
            "world_size": world_size,
            "dp_size": dp_size if dp_size is not None else world_size,
            "mp_size": mp_size,
            "batch_size": batch.micro_batch_per_gpu * batch.gradient_accumulation_steps,
        },
    )
