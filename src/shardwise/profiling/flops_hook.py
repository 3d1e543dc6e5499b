"""The flops profiler in training, as a step hook (:class:`~shardwise.runtime.step_hooks.StepHook`).

With ``"flops_profiler": {"enabled": true, "profile_step": N}`` rank 0 profiles the
training forwards of the optimizer step taken while ``global_steps == N`` (it starts at the
first of them) and, after that step, writes the report (to the log or ``output_file``) with
the window's backward and step latency from the wall-clock timers, which the profiler
forces on (:func:`shardwise.profiling.telemetry.build_telemetry`). Evaluation forwards are
not profiled. It keeps no state across a checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from torch import nn

from shardwise.profiling.flops_profiler import FlopsProfiler
from shardwise.profiling.timers import BACKWARD, STEP, WallClockTimers

if TYPE_CHECKING:
    from shardwise.config.sections.observability import FlopsProfilerConfig
    from shardwise.runtime.step_hooks import ForwardContext, StepOutcome

__all__ = ["FlopsProfilerHook", "build_flops_profiler_hook"]


class FlopsProfilerHook:
    """Starts the profiler at ``profile_step``'s first training forward, reports after that step.

    Args:
        profiler: the profiler over the model.
        settings: the ``flops_profiler`` config section (``profile_step``, ``module_depth``...).
        timers: the engine's wall-clock timers (the report's backward and step latency).
        context: run facts for the report (world/dp/mp sizes, samples per step).

    Example:
        >>> import torch
        >>> from shardwise.config import load_config
        >>> from shardwise.runtime.step_hooks import ForwardContext
        >>> model = torch.nn.Linear(2, 2)
        >>> settings = load_config({"train_batch_size": 8}).config.flops_profiler  # profile_step 1
        >>> hook = FlopsProfilerHook(FlopsProfiler(model), settings, WallClockTimers(False), {})
        >>> _ = hook.adjust_forward((), {}, ForwardContext(global_step=1, training=True))
        >>> hook.profiling
        True
    """

    name = "flops_profiler"

    def __init__(
        self,
        profiler: FlopsProfiler,
        settings: FlopsProfilerConfig,
        timers: WallClockTimers,
        context: Mapping[str, object],
    ) -> None:
        self.profiler = profiler
        self.settings = settings
        self.timers = timers
        self.context = dict(context)
        self.profiling = False

    def adjust_forward(
        self, args: tuple[object, ...], kwargs: dict[str, object], context: ForwardContext
    ) -> tuple[tuple[object, ...], dict[str, object]]:
        """Start profiling at the profiled step's first training forward; the arguments pass unchanged."""
        if context.training and not self.profiling and context.global_step == self.settings.profile_step:
            self.profiler.start_profile()
            self.profiling = True
        return args, kwargs

    def after_optimizer_step(self, outcome: StepOutcome) -> None:
        """After the profiled step: stop, write the report, remove the profiler's hooks."""
        if not self.profiling:
            return
        self.profiler.stop_profile()
        self.profiling = False
        window = self.timers.as_dict()  # the window just closed (the profiler forces the timers on)
        context = dict(self.context)
        context["bwd_latency_s"] = window.get(BACKWARD, 0.0) / 1000.0
        context["step_latency_s"] = window.get(STEP, 0.0) / 1000.0
        settings = self.settings
        self.profiler.print_model_profile(
            profile_step=settings.profile_step,
            module_depth=settings.module_depth,
            top_modules=settings.top_modules,
            detailed=settings.detailed,
            output_file=settings.output_file,
            context=context,
        )
        self.profiler.end_profile()

    def state_dict(self) -> dict[str, object]:
        """Nothing to keep: a resumed run past ``profile_step`` does not profile again."""
        return {}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Nothing to restore."""


def build_flops_profiler_hook(
    settings: FlopsProfilerConfig,
    model: nn.Module,
    rank: int,
    timers: WallClockTimers,
    context: Mapping[str, object],
) -> FlopsProfilerHook | None:
    """The profiler hook where the config enables it (rank 0, ``profile_step >= 0``), else None.

    Args:
        settings: the config's ``flops_profiler`` section.
        model: the module to profile.
        rank: global rank (only rank 0 profiles).
        timers: the engine's wall-clock timers.
        context: run facts for the report (``Telemetry.context``).
    """
    if not settings.enabled or rank != 0 or settings.profile_step < 0:
        return None
    profiler = FlopsProfiler(model, recompute_fwd_factor=settings.recompute_fwd_factor)
    return FlopsProfilerHook(profiler, settings, timers, context)
