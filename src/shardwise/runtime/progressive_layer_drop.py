"""Progressive layer drop (PLD): the ``progressive_layer_drop`` section as a step hook.

PLD (Zhang & He, 2020) trains a transformer while skipping layers stochastically, with a
keep probability that starts at 1 and decays towards ``theta``:
``theta(t) = (1 - theta) * exp(-gamma * t) + theta``. As in DeepSpeed (<= 0.19.6), the engine
owns the schedule and the *model* drops the layers: every training forward receives
``progressive_layer_drop=True, pld_theta=<current value>``; the value is updated once per
optimizer step (at each accumulation boundary, from the step count before that step), so the
first two optimizer steps run with ``pld_theta == 1.0``. Evaluation forwards get nothing.

:func:`layer_keep_probability` and :func:`keep_layer` give the paper's per-layer rule (deeper
layers are dropped more often) for models that want it; ``engine.get_pld_theta()`` returns the
current value. A model whose ``forward`` cannot take the two keyword arguments is refused at
``initialize`` (DeepSpeed fails at the first forward with a TypeError instead).

Example:
    >>> from shardwise.config import load_config
    >>> from shardwise.runtime.step_hooks import ForwardContext, StepOutcome, state_number
    >>> cfg = load_config({"train_batch_size": 2,
    ...                    "progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.1}}).config
    >>> hook = build_progressive_layer_drop_hook(cfg.progressive_layer_drop, lambda x, **kw: x)
    >>> hook.adjust_forward((1,), {}, ForwardContext(global_step=0, training=True))[1]
    {'progressive_layer_drop': True, 'pld_theta': 1.0}
    >>> for step in (1, 2): hook.after_optimizer_step(StepOutcome(step, 2 * step, True, 1.0))
    >>> round(hook.theta, 6)  # (1 - 0.5) * exp(-0.1 * 1) + 0.5
    0.952419
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping

import torch

from shardwise.config.errors import ConfigError
from shardwise.config.sections.legacy import ProgressiveLayerDropConfig
from shardwise.runtime.step_hooks import ForwardContext, StepOutcome, state_number

__all__ = [
    "ProgressiveLayerDropHook",
    "build_progressive_layer_drop_hook",
    "keep_layer",
    "layer_keep_probability",
    "pld_theta",
]

FORWARD_KWARGS = ("progressive_layer_drop", "pld_theta")


def pld_theta(step: int, theta: float, gamma: float) -> float:
    """The keep probability after ``step`` steps: ``(1 - theta) * exp(-gamma * step) + theta``."""
    return (1.0 - theta) * math.exp(-gamma * step) + theta


def layer_keep_probability(theta: float, layer_index: int, num_layers: int) -> float:
    """The paper's per-layer keep probability: ``1 - (i + 1) / L * (1 - theta)`` for layer ``i`` of ``L``.

    Example:
        >>> [round(layer_keep_probability(0.5, i, 4), 3) for i in range(4)]
        [0.875, 0.75, 0.625, 0.5]
    """
    if not 0 <= layer_index < num_layers:
        raise ValueError(f"layer_index must be in [0, {num_layers}), got {layer_index}")
    return 1.0 - (layer_index + 1) / num_layers * (1.0 - theta)


def keep_layer(
    theta: float, layer_index: int, num_layers: int, generator: torch.Generator | None = None
) -> bool:
    """Draw whether layer ``layer_index`` runs in this training forward (a Bernoulli draw)."""
    probability = layer_keep_probability(theta, layer_index, num_layers)
    return bool(torch.rand((), generator=generator).item() < probability)


class ProgressiveLayerDropHook:
    """Passes the PLD keep probability to every training forward (see the module docstring).

    Attributes:
        theta: the value the next training forward receives.
    """

    name = "progressive_layer_drop"

    def __init__(self, theta: float, gamma: float) -> None:
        self.target, self.gamma = theta, gamma
        self.theta = 1.0

    def adjust_forward(
        self, args: tuple[object, ...], kwargs: dict[str, object], context: ForwardContext
    ) -> tuple[tuple[object, ...], dict[str, object]]:
        """Add ``progressive_layer_drop=True, pld_theta=theta`` to training forwards."""
        if not context.training:
            return args, kwargs
        return args, {**kwargs, "progressive_layer_drop": True, "pld_theta": self.theta}

    def after_optimizer_step(self, outcome: StepOutcome) -> None:
        """Update theta from the step count before this step (DeepSpeed's order)."""
        self.theta = pld_theta(outcome.global_step - 1, self.target, self.gamma)

    def state_dict(self) -> dict[str, object]:
        """The current theta."""
        return {"theta": self.theta}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore the current theta."""
        self.theta = state_number(state, "theta", self.name)


def _accepts(forward: Callable[..., object], names: tuple[str, ...]) -> bool:
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): let the call decide
        return True
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return True
    keyword = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return all(name in keyword for name in names)


def build_progressive_layer_drop_hook(
    section: ProgressiveLayerDropConfig | None, forward: Callable[..., object]
) -> ProgressiveLayerDropHook | None:
    """The hook for an enabled ``progressive_layer_drop`` section, else None.

    Args:
        section: the config's ``progressive_layer_drop`` section (None when absent).
        forward: the model's forward (its signature is checked).

    Raises:
        ConfigError: theta outside [0, 1], a negative gamma, or a forward that cannot take the
            ``progressive_layer_drop`` / ``pld_theta`` keyword arguments.
    """
    if section is None or not section.enabled:
        return None
    if not 0.0 <= section.theta <= 1.0:
        raise ConfigError(
            "progressive_layer_drop.theta",
            "is the keep probability the schedule decays to: it must be in [0, 1]",
            "use e.g. 0.5 (the value of the PLD paper)",
            value=section.theta,
        )
    if section.gamma < 0:
        raise ConfigError(
            "progressive_layer_drop.gamma",
            "is the decay rate of the keep probability: it must be >= 0",
            "use e.g. 0.001",
            value=section.gamma,
        )
    if not _accepts(forward, FORWARD_KWARGS):
        raise ConfigError(
            "progressive_layer_drop.enabled",
            "makes every training forward receive progressive_layer_drop=True and pld_theta=<float>, "
            "and the model's forward takes neither (nor **kwargs)",
            "add `progressive_layer_drop=False, pld_theta=1.0` (or **kwargs) to the model's forward and drop "
            "layers with shardwise.runtime.progressive_layer_drop.keep_layer, or disable the section",
            value=True,
        )
    return ProgressiveLayerDropHook(section.theta, section.gamma)
