"""What a training step reports: the progress line, the timer line and the monitor events.

Pure functions over plain numbers (no torch, no process group), so the formats are
tested in milliseconds. :mod:`shardwise.profiling.telemetry` gathers the numbers and
calls these.

Event names follow DeepSpeed (spec 11.3) where it has them (``Train/Samples/lr``,
``Train/Samples/loss_scale``, ``Train/Samples/train_loss``, the five
``Train/Samples/elapsed_time_ms_*``), plus the gradient norm before and after
clipping and the throughput, which DeepSpeed's monitors do not write. The step axis is
``global_samples``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardwise.profiling.timers import MONITOR_NAMES, PHASES

TRAIN_LOSS = "Train/Samples/train_loss"
LR = "Train/Samples/lr"
LOSS_SCALE = "Train/Samples/loss_scale"
GRAD_NORM_PRE_CLIP = "Train/Samples/grad_norm_pre_clip"
GRAD_NORM_POST_CLIP = "Train/Samples/grad_norm_post_clip"
SAMPLES_PER_SEC = "Train/Samples/samples_per_sec"

# The clipping coefficient's epsilon, as in the optimizer step: coef = clip / (norm + eps).
CLIP_EPS = 1e-6


def post_clip_norm(pre_clip: float | None, clipping: float) -> float | None:
    """The global gradient norm after clipping, given the norm before it.

    The optimizer multiplies gradients by ``clip / (norm + 1e-6)`` when that is below 1,
    so the clipped norm is ``norm * clip / (norm + 1e-6)`` (just under ``clip``), and the
    norm itself otherwise. ``clipping == 0`` means no clipping.

    Example:
        >>> post_clip_norm(4.0, 1.0) == 4.0 * 1.0 / (4.0 + 1e-6)
        True
        >>> post_clip_norm(0.5, 1.0), post_clip_norm(4.0, 0.0), post_clip_norm(None, 1.0)
        (0.5, 4.0, None)
    """
    if pre_clip is None:
        return None
    if clipping > 0:
        factor = (pre_clip + CLIP_EPS) / clipping
        if factor > 1.0:
            return pre_clip / factor
    return pre_clip


@dataclass(frozen=True)
class StepStats:
    """The numbers of one optimizer step, as reported.

    Attributes:
        step: optimizer steps so far (``global_steps``, after this one).
        samples: samples so far over all ranks (``global_samples``): the monitors' step axis.
        loss: mean over data-parallel ranks of the loss summed over the window's
            ``engine.backward`` calls (each already divided by the accumulation steps),
            None when the engine saw no loss.
        lr: learning rate per param group.
        grad_norm_pre_clip: global norm before clipping (inf after an overflow), or None.
        grad_norm_post_clip: global norm after clipping; None when the step was skipped.
        loss_scale: the fp16 loss scale, None without loss scaling.
        skipped: steps skipped so far (overflow).
        samples_per_sec: this step's throughput, None before it is measured.
        avg_samples_per_sec: running average after the warm-up steps.
    """

    step: int
    samples: int
    loss: float | None
    lr: Sequence[float]
    grad_norm_pre_clip: float | None
    grad_norm_post_clip: float | None
    loss_scale: float | None
    skipped: int
    samples_per_sec: float | None = None
    avg_samples_per_sec: float | None = None


def _num(value: float | None, spec: str = ".4g") -> str:
    return "n/a" if value is None else format(value, spec)


def progress_line(stats: StepStats) -> str:
    """The ``steps_per_print`` line.

    Example:
        >>> progress_line(StepStats(step=10, samples=160, loss=2.5, lr=[1e-3], grad_norm_pre_clip=3.0,
        ...     grad_norm_post_clip=1.0, loss_scale=None, skipped=0, samples_per_sec=800.0))
        'step=10, samples=160, loss=2.5000, lr=[0.001], grad_norm_pre_clip=3, grad_norm_post_clip=1, skipped=0, samples/s=800.0'
    """
    parts = [f"step={stats.step}", f"samples={stats.samples}"]
    if stats.loss is not None:
        parts.append(f"loss={stats.loss:.4f}")
    parts.append("lr=[" + ", ".join(format(lr, ".6g") for lr in stats.lr) + "]")
    parts.append(f"grad_norm_pre_clip={_num(stats.grad_norm_pre_clip)}")
    parts.append(f"grad_norm_post_clip={_num(stats.grad_norm_post_clip)}")
    if stats.loss_scale is not None:
        parts.append(f"loss_scale={stats.loss_scale:g}")
    parts.append(f"skipped={stats.skipped}")
    if stats.samples_per_sec is not None:
        parts.append(f"samples/s={stats.samples_per_sec:.1f}")
    if stats.avg_samples_per_sec is not None:
        parts.append(f"avg_samples/s={stats.avg_samples_per_sec:.1f}")
    return ", ".join(parts)


def step_events(stats: StepStats) -> list[tuple[str, float, int]]:
    """Monitor events of one step (timers excluded), at ``stats.samples``.

    The norm events are written only when finite (an overflowed step has no meaningful
    norm; ``skipped`` says it happened), the loss scale only under loss scaling.

    Example:
        >>> [name for name, _, _ in step_events(StepStats(1, 8, 2.0, [0.1], 3.0, 1.0, None, 0))]
        ['Train/Samples/train_loss', 'Train/Samples/lr', 'Train/Samples/grad_norm_pre_clip', 'Train/Samples/grad_norm_post_clip']
    """
    at = stats.samples
    events: list[tuple[str, float, int]] = []
    if stats.loss is not None:
        events.append((TRAIN_LOSS, stats.loss, at))
    if stats.lr:
        events.append((LR, float(stats.lr[0]), at))
    if stats.loss_scale is not None:
        events.append((LOSS_SCALE, float(stats.loss_scale), at))
    finite_pre = stats.grad_norm_pre_clip is not None and stats.grad_norm_pre_clip != float("inf")
    if finite_pre and stats.grad_norm_pre_clip == stats.grad_norm_pre_clip:  # not NaN
        events.append((GRAD_NORM_PRE_CLIP, float(stats.grad_norm_pre_clip), at))  # type: ignore[arg-type]
        if stats.grad_norm_post_clip is not None:
            events.append((GRAD_NORM_POST_CLIP, float(stats.grad_norm_post_clip), at))
    if stats.samples_per_sec is not None:
        events.append((SAMPLES_PER_SEC, float(stats.samples_per_sec), at))
    return events


def timer_events(window_ms: Mapping[str, float], samples: int) -> list[tuple[str, float, int]]:
    """The five ``Train/Samples/elapsed_time_ms_*`` events of a window.

    Example:
        >>> timer_events({"fwd": 1.5, "bwd": 3.0, "bwd_inner": 2.0, "bwd_allreduce": 1.0, "step": 0.5}, 16)[0]
        ('Train/Samples/elapsed_time_ms_forward', 1.5, 16)
    """
    return [(MONITOR_NAMES[name], float(window_ms[name]), samples) for name in PHASES]


def timers_line(
    mean_ms: Mapping[str, float], max_ms: Mapping[str, float], world_size: int, steps: int = 1
) -> str:
    """The ``wall_clock_breakdown`` line: per phase the mean and the slowest rank, per step.

    Args:
        mean_ms: per phase, the mean over ranks of the time summed over ``steps`` steps.
        max_ms: per phase, the largest rank's sum.
        world_size: ranks aggregated.
        steps: optimizer steps the sums cover (values are divided by it).

    Example:
        >>> timers_line({"fwd": 2.0, "bwd": 4.0, "bwd_inner": 3.0, "bwd_allreduce": 1.0, "step": 1.0},
        ...             {"fwd": 2.5, "bwd": 5.0, "bwd_inner": 3.0, "bwd_allreduce": 2.0, "step": 1.0}, 2)
        'time (ms) per step, mean/max over 2 ranks | fwd: 2.00/2.50 | bwd: 4.00/5.00 | bwd_inner: 3.00/3.00 | bwd_allreduce: 1.00/2.00 | step: 1.00/1.00'
    """
    per = max(steps, 1)
    cells = [f"{name}: {mean_ms[name] / per:.2f}/{max_ms[name] / per:.2f}" for name in PHASES]
    return f"time (ms) per step, mean/max over {world_size} ranks | " + " | ".join(cells)


def mean_and_max(rows: Sequence[Sequence[float]]) -> tuple[list[float], list[float]]:
    """Column means and maxima of per-rank rows.

    Example:
        >>> mean_and_max([[1.0, 4.0], [3.0, 2.0]])
        ([2.0, 3.0], [3.0, 4.0])
    """
    columns = list(zip(*rows))
    return [sum(c) / len(c) for c in columns], [max(c) for c in columns]
