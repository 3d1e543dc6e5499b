"""The step-hook seam: features that act around forward and after each optimizer step.

A feature that must act on the training step (curriculum's ``curriculum_seqlen`` forward
argument, random-LTD's kept-token count, compression schedules, profiling) implements
:class:`StepHook` in its own package, without touching the engine.
:func:`shardwise.step_hook_factory.build_step_hooks` builds the hooks the config enables,
``initialize`` hands them to the engine, and the engine calls them, in order, through
:class:`StepHooks`:

- ``adjust_forward(args, kwargs, context)`` before every forward (training and eval; the
  context says which): each hook receives the previous hook's output;
- ``after_optimizer_step(outcome)`` after every optimizer step (at each accumulation
  boundary, applied or skipped), once the counters and the step's report are done;
- ``state_dict()`` / ``load_state_dict()``: saved in the checkpoint's common part under the
  hook's ``name`` and restored on load (a checkpoint without it loads; the hook keeps its state).

Example:
    >>> class AddSeqlen:
    ...     name = "curriculum"
    ...     def adjust_forward(self, args, kwargs, context):
    ...         return args, {**kwargs, "curriculum_seqlen": 8 * (context.global_step + 1)}
    ...     def after_optimizer_step(self, outcome): pass
    ...     def state_dict(self): return {}
    ...     def load_state_dict(self, state): pass
    >>> hooks = StepHooks([AddSeqlen()])
    >>> hooks.adjust_forward((1,), {}, ForwardContext(global_step=2, training=True))
    ((1,), {'curriculum_seqlen': 24})
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from shardwise.utils.logging import logger

__all__ = ["ForwardContext", "StepHook", "StepHooks", "StepOutcome"]


@dataclass(frozen=True)
class ForwardContext:
    """What a hook knows about the forward it adjusts.

    Attributes:
        global_step: optimizer steps taken so far (the forward belongs to step ``global_step + 1``).
        training: the module is in training mode (False: an evaluation forward).
    """

    global_step: int
    training: bool


@dataclass(frozen=True)
class StepOutcome:
    """What a hook learns after an optimizer step.

    Attributes:
        global_step: ``global_steps`` after this step.
        global_samples: ``global_samples`` after this step.
        applied: the parameters were updated (False: skipped, non-finite gradients).
        grad_norm: the global norm before clipping (``inf`` when skipped).
    """

    global_step: int
    global_samples: int
    applied: bool
    grad_norm: float


class StepHook(Protocol):
    """A feature acting around forward and after each optimizer step (see the module docstring).

    Attributes:
        name: a stable name: it keys the hook's state in checkpoints.
    """

    name: str

    def adjust_forward(
        self, args: tuple[object, ...], kwargs: dict[str, object], context: ForwardContext
    ) -> tuple[tuple[object, ...], dict[str, object]]:
        """Return the forward's (possibly changed) positional and keyword arguments."""
        ...

    def after_optimizer_step(self, outcome: StepOutcome) -> None:
        """Act after an optimizer step (every rank calls it, at every accumulation boundary)."""
        ...

    def state_dict(self) -> dict[str, object]:
        """What the hook needs to continue after a resume (picklable plain values). It is saved
        once, in the checkpoint's common part (rank 0's): it must be the same on every rank."""
        ...

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore what :meth:`state_dict` returned."""
        ...


def state_number(state: Mapping[str, object], key: str, owner: str) -> float:
    """``state[key]`` as a float, or a clear error naming the hook and the key when the checkpoint
    holds something else there."""
    value = state[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"step hook {owner!r}: the checkpoint's {key!r} is {value!r}, not a number; load a "
            "checkpoint this feature wrote, or start without its state"
        )
    return float(value)


class StepHooks:
    """The engine's hooks, called in order; ``Stateful`` over all of them (keyed by name).

    Args:
        hooks: the hooks, in calling order; names must be unique.

    Raises:
        ValueError: two hooks share a name, or a name is empty.
    """

    def __init__(self, hooks: Sequence[StepHook] = ()) -> None:
        names = [hook.name for hook in hooks]
        for name in names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"a step hook needs a non-empty string name, got {name!r}")
            if names.count(name) > 1:
                raise ValueError(f"two step hooks are named {name!r}: names key their checkpoint state")
        self._hooks = list(hooks)

    def __iter__(self) -> Iterator[StepHook]:
        return iter(self._hooks)

    def __len__(self) -> int:
        return len(self._hooks)

    def named(self, name: str) -> StepHook | None:
        """The hook called ``name``, or None when the config enables no such hook."""
        return next((hook for hook in self._hooks if hook.name == name), None)

    def adjust_forward(
        self, args: tuple[object, ...], kwargs: dict[str, object], context: ForwardContext
    ) -> tuple[tuple[object, ...], dict[str, object]]:
        """Pass the forward's arguments through every hook, in order."""
        for hook in self._hooks:
            args, kwargs = hook.adjust_forward(args, kwargs, context)
        return args, kwargs

    def after_optimizer_step(self, outcome: StepOutcome) -> None:
        """Tell every hook, in order, that an optimizer step ended."""
        for hook in self._hooks:
            hook.after_optimizer_step(outcome)

    def state_dict(self) -> dict[str, dict[str, object]]:
        """``{hook name: its state}`` (the checkpoint's ``step_hooks`` entry)."""
        return {hook.name: hook.state_dict() for hook in self._hooks}

    def load_state_dict(self, state: Mapping[str, Mapping[str, object]]) -> None:
        """Restore each hook from its entry; a hook without one keeps its state (older checkpoint)."""
        for hook in self._hooks:
            if hook.name in state:
                hook.load_state_dict(state[hook.name])
        unused = sorted(set(state) - {hook.name for hook in self._hooks})
        if unused:
            logger.warning(
                "the checkpoint holds state for step hooks this run does not have (%s): it is not used; "
                "enable the same features in the config to continue them",
                ", ".join(unused),
            )
