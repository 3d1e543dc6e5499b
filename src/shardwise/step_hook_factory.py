"""Build the step hooks a config enables, in the order the engine calls them.

It sits above every feature package (it imports them) and below ``initialize``, which calls
it. A feature that acts on the training step adds its hook here (one ``build_*_hook`` call
returning a :class:`~shardwise.runtime.step_hooks.StepHook` or None) and lives in its own
package; the engine does not change. Today: the legacy curriculum
(:mod:`shardwise.data_efficiency.curriculum_hook`), random-LTD
(:mod:`shardwise.data_efficiency.random_ltd_hook`), progressive layer drop
(:mod:`shardwise.runtime.progressive_layer_drop`), the compression scheduler
(:mod:`shardwise.compression.hook`), the flops profiler (:mod:`shardwise.profiling.flops_hook`) and the
autotuning experiment's measurement (:mod:`shardwise.autotuning.metric_hook`), in that order (the
profiler sees the final arguments; the autotuning hook may end the run, so it comes last).
"""

from __future__ import annotations

from torch import nn

from shardwise.autotuning.metric_hook import build_autotuning_hook
from shardwise.compression.hook import build_compression_hook
from shardwise.config.model import ShardwiseConfig
from shardwise.data_efficiency.curriculum_hook import build_legacy_curriculum_hook
from shardwise.data_efficiency.random_ltd_hook import build_random_ltd_hook
from shardwise.profiling.flops_hook import build_flops_profiler_hook
from shardwise.profiling.telemetry import Telemetry
from shardwise.runtime.progressive_layer_drop import build_progressive_layer_drop_hook
from shardwise.runtime.step_hooks import StepHook, StepHooks

__all__ = ["build_step_hooks"]


def build_step_hooks(
    config: ShardwiseConfig, model: nn.Module, *, rank: int, telemetry: Telemetry
) -> StepHooks:
    """The configured hooks, in calling order (empty when no feature needs one).

    Args:
        config: the validated config model (``ShardwiseConfig``).
        model: the (placed, possibly sharded) module.
        rank: global rank.
        telemetry: the engine's telemetry (its timers and run facts feed the profiler's report).

    Example:
        >>> import torch
        >>> from shardwise.config import load_config
        >>> from shardwise.profiling.telemetry import build_telemetry
        >>> cfg = load_config({"train_batch_size": 8, "flops_profiler": {"enabled": True}})
        >>> telemetry = build_telemetry(cfg, torch.device("cpu"), 0, 1)
        >>> [hook.name for hook in build_step_hooks(cfg.config, torch.nn.Linear(2, 2), rank=0, telemetry=telemetry)]
        ['flops_profiler']
    """
    candidates: list[StepHook | None] = [
        build_legacy_curriculum_hook(config.curriculum_learning),
        build_random_ltd_hook(config.data_efficiency, model, global_batch_size=_int(config.train_batch_size)),
        build_progressive_layer_drop_hook(config.progressive_layer_drop, model.forward),
        build_compression_hook(model),
        build_flops_profiler_hook(config.flops_profiler, model, rank, telemetry.timers, telemetry.context),
        # last: it may end the run after writing
        build_autotuning_hook(
            config.autotuning, model, rank=rank, micro_batch=int(config.train_micro_batch_size_per_gpu or 1)
        ),
    ]
    return StepHooks([hook for hook in candidates if hook is not None])


def _int(value: int | None) -> int:
    """A batch key ``initialize`` resolved (never None after resolution)."""
    assert value is not None, "train_batch_size is resolved before the step hooks are built"
    return value
