"""The one interface between the engine and a ZeRO stage: :class:`ZeroStrategy`.

Every stage's optimizer implements it explicitly (``ZeroOptimizer`` for stages 0-2 in
:mod:`shardwise.zero.sharded_optimizer`, ``Stage3Optimizer`` in :mod:`shardwise.zero.stage3`),
:func:`shardwise.zero.factory.build_zero_optimizer` returns it, and the engine is typed
against it: the engine never asks which stage it runs. What differs between stages is
*declared* by the strategy (e.g. whether gradient sync can be switched off, and why not),
never inferred from the stage number.

A micro step, as the engine drives it::

    strategy.prepare_backward(is_boundary)   # before autograd runs
    loss.backward()                          # hooks reduce gradients (stages 0-2) / FSDP2 (3)
    strategy.after_backward()                # this backward's reductions are complete
    ...
    result = strategy.step(loss_scale)       # at the accumulation boundary only
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from shardwise.zero.state_layout import GradientLayout, StateLayout

if TYPE_CHECKING:
    import torch

__all__ = ["GradientSyncRefused", "StepResult", "ZeroStrategy", "sharded_gradients_refusal"]


@dataclass(frozen=True)
class StepResult:
    """Outcome of one optimizer step.

    Attributes:
        applied: the update was applied. It is not applied exactly when the global gradient
            norm is non-finite (inf/NaN), in every precision.
        grad_norm: the true global norm (averaged over ranks, unscaled, before clipping);
            ``inf`` when the step was skipped.
        overflow: the skip is an overflow the loss scaler answers (fp16, or bf16 with
            ``check_grad_overflow``); False for a skipped fp32 step, which the scaler never sees.
    """

    applied: bool
    grad_norm: float
    overflow: bool


@runtime_checkable
class ZeroStrategy(Protocol):
    """What the engine needs from a ZeRO stage (implemented by every stage's optimizer).

    Runtime-checkable: ``isinstance(x, ZeroStrategy)`` is how ``checkpoint/`` tells a strategy
    (which describes its own state) from a plain torch optimizer.

    Attributes:
        optimizer: the inner torch optimizer (stepping this rank's fp32 masters/shards).
        gradient_sync_toggle: whether :meth:`set_gradient_sync` can switch gradient
            reduction off (``engine.no_sync()``); declared by the strategy.
        gradient_sync_refusal: why it cannot (the engine's error message); empty when it can.
        overflow: the last boundary step was skipped (non-finite gradients); DeepSpeed's name,
            read by accelerate as "step was skipped".
    """

    optimizer: torch.optim.Optimizer
    gradient_sync_toggle: bool
    gradient_sync_refusal: str
    overflow: bool

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's param groups (schedulers write ``lr`` here)."""
        ...

    def prepare_backward(self, is_boundary: bool) -> None:
        """Called before each backward; ``is_boundary``: this backward ends the accumulation window."""
        ...

    def after_backward(self) -> None:
        """Called after each backward: complete this backward's gradient reductions."""
        ...

    def end_window(self) -> None:
        """Unmanaged accumulation (``managed_gradient_accumulation: false``): the window ends at this
        ``step()`` after backwards prepared as non-boundary; finish what a boundary backward would have
        (reduce deferred gradients, drop gathered weights the step is about to change)."""
        ...

    def step(self, loss_scale: float = 1.0) -> StepResult:
        """One optimizer step at an accumulation boundary (collective: every rank calls it)."""
        ...

    def zero_grad(self) -> None:
        """Drop the accumulated gradients."""
        ...

    def set_gradient_sync(self, enabled: bool) -> None:
        """Switch gradient reduction off (accumulate locally) or back on.

        Raises:
            RuntimeError: ``enabled`` is False and ``gradient_sync_toggle`` is False
                (message: ``gradient_sync_refusal``).
        """
        ...

    def broadcast_parameters(self) -> None:
        """Make every data-parallel rank hold the first rank's parameters (at start-up)."""
        ...

    def close(self) -> None:
        """Release what the strategy holds outside Python objects (offload swap files, hooks)."""
        ...

    def model_state_bytes(self) -> int:
        """Bytes of parameters, gradients, masters and optimizer state this rank holds."""
        ...

    def state_layout(self) -> StateLayout:
        """Where each named parameter's fp32 values and optimizer state sit, in plain tensors
        (a snapshot: ask again after a step or a load). ``checkpoint/`` adapts it to DCP."""
        ...

    def release_gathered_parameters(self) -> None:
        """Free every gathered copy of partitioned parameters (``engine.empty_partition_cache()``);
        the next forward gathers again. Nothing to do where parameters are never partitioned."""
        ...

    def wait_for_parameters(self) -> None:
        """Complete parameter communication the step left in flight (stages 1-2 with
        ``overlap_comm``: the post-step all-gather), so the parameter tensors hold the updated
        values; a no-op where none is left. Forwards, ``state_dict`` and the strategy's own
        methods wait by themselves; user code reading parameter tensors directly between
        ``step()`` and the next forward calls this first. The default: nothing is ever left in
        flight (stage 3: FSDP2 gathers inside the forward)."""
        return None

    def gradient_layout(self) -> GradientLayout:
        """Where each parameter's reduced gradient sits now, in the same holdings as
        :meth:`state_layout`; ``unavailable`` says why there is none (``deepspeed.utils.safe_get_full_grad``)."""
        ...


class GradientSyncRefused(RuntimeError, AssertionError):
    """``no_sync()`` refused (gradients sharded every micro step, or a nested ``no_sync()``).

    Also an ``AssertionError``: DeepSpeed raises that type for both, and its callers catch it.
    """


def sharded_gradients_refusal(stage: int) -> str:
    """Why ``no_sync()`` is refused where gradients are sharded every micro step (stages 2 and 3).

    Example:
        >>> sharded_gradients_refusal(2).startswith("no_sync() is not possible at ZeRO stage 2")
        True
    """
    return (
        f"no_sync() is not possible at ZeRO stage {stage}: gradients are sharded and must be "
        "reduce-scattered every micro step; use gradient_accumulation_steps instead"
    )
