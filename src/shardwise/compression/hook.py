"""The engine's compression step hook: advances the scheduler after every optimizer step.

Built by :func:`shardwise.step_hook_factory.build_step_hooks` when ``compression_training``
enables something; its state (the scheduler's) is saved in checkpoints by the step-hook seam.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from shardwise.compression.scheduler import CompressionScheduler
from shardwise.runtime.step_hooks import ForwardContext, StepOutcome

__all__ = ["CompressionHook", "build_compression_hook"]


class CompressionHook:
    """A :class:`~shardwise.runtime.step_hooks.StepHook` driving a :class:`CompressionScheduler`."""

    name = "compression"

    def __init__(self, scheduler: CompressionScheduler) -> None:
        self.scheduler = scheduler

    def adjust_forward(
        self, args: tuple[object, ...], kwargs: dict[str, object], context: ForwardContext
    ) -> tuple[tuple[object, ...], dict[str, object]]:
        return args, kwargs

    def after_optimizer_step(self, outcome: StepOutcome) -> None:
        self.scheduler.step(outcome.global_step)

    def state_dict(self) -> dict[str, object]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self.scheduler.load_state_dict(state)


def build_compression_hook(model: nn.Module) -> CompressionHook | None:
    """The hook for a model ``init_compression`` prepared (by ``initialize`` from the config's
    ``compression_training``, or by the script itself); None for any other model."""
    from shardwise.compression.compress import compression_scheduler

    scheduler = compression_scheduler(model)
    return None if scheduler is None else CompressionHook(scheduler)
