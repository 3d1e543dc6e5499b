"""``data_efficiency.data_routing.random_ltd`` as a step hook: checks the section against the
model's wrapped layers and sets their kept-token count on every training forward.

The schedule moves to ``global_steps`` on each training forward (DeepSpeed's ``update_seq``),
and every :class:`~shardwise.data_efficiency.random_ltd.RandomLTDLayer` of the model then keeps
that many tokens. The hook's state (DeepSpeed's ``random_ltd`` checkpoint entry:
``consumed_layer_tokens``, ``current_steps``, ``current_value``, ``min_value``, ``max_value``) is
saved in checkpoints. The model must have been converted with
:func:`~shardwise.data_efficiency.random_ltd.convert_to_random_ltd` before ``initialize``.

``random_ltd_layer_id`` decides which wrapped layers drop tokens (:func:`active_layers`): every
id it lists must be a wrapped layer, a layer the caller chose to wrap (``layer_ids``) must be
listed, and wrappers of every layer (no ``layer_ids``, DeepSpeed's form) that are not listed run
on every token. A mismatch is a ConfigError naming the ids on both sides.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from shardwise.config.errors import ConfigError
from shardwise.config.sections.data_efficiency import DataEfficiencyConfig, RandomLTDConfig
from shardwise.data_efficiency.random_ltd import RandomLTDLayer, random_ltd_layers
from shardwise.data_efficiency.schedule import RandomLTDSchedule
from shardwise.runtime.step_hooks import ForwardContext, StepOutcome

__all__ = ["RandomLTDHook", "active_layers", "build_random_ltd_hook"]

_PATH = "data_efficiency.data_routing.random_ltd"


class RandomLTDHook:
    """Sets the kept-token count of the model's random-LTD layers from the schedule.

    Attributes:
        schedule: the kept-length schedule (its state is saved in checkpoints).
        layers: the model's wrapped layers.
    """

    name = "random_ltd"

    def __init__(
        self, schedule: RandomLTDSchedule, layers: list[RandomLTDLayer], section: RandomLTDConfig | None = None
    ) -> None:
        self.schedule = schedule
        self.layers = layers
        self.section = section

    def bind(self, model: nn.Module) -> list[RandomLTDLayer]:
        """Find the model's wrapped layers again and give them the section's settings and the
        schedule's current count (DeepSpeed's ``engine.random_ltd_initialize()``: layers wrapped or
        replaced after ``initialize``). Returns the layers that drop tokens.

        Raises:
            ConfigError: the wrapped layers do not match ``random_ltd_layer_id`` (:func:`active_layers`).
        """
        if self.section is None:
            raise ValueError("this RandomLTDHook was built without its config section; build it with build_random_ltd_hook")
        self.layers = _configure(self.section, model)
        for layer in self.layers:
            layer.kept_tokens = self.schedule.current_value
        return self.layers

    def adjust_forward(
        self, args: tuple[object, ...], kwargs: dict[str, object], context: ForwardContext
    ) -> tuple[tuple[object, ...], dict[str, object]]:
        """On a training forward: move the schedule to ``global_step``, set every layer's count."""
        if context.training:
            kept = self.schedule.update(context.global_step)
            for layer in self.layers:
                layer.kept_tokens = kept
        return args, kwargs

    def after_optimizer_step(self, outcome: StepOutcome) -> None:
        """Nothing: the count follows the step counter at the next forward."""

    def state_dict(self) -> dict[str, object]:
        """DeepSpeed's ``random_ltd`` entry."""
        return {**self.schedule.state_dict()}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore the schedule and the layers' count."""
        self.schedule.load_state_dict(state)
        for layer in self.layers:
            layer.kept_tokens = self.schedule.current_value


def _check(section: RandomLTDConfig) -> tuple[int, str]:
    """Refuse an inconsistent section; return its checked ``(total_layer_num, model_type)``."""
    ids = list(section.random_ltd_layer_id)
    total = section.total_layer_num
    if total is None or total < 1:
        raise ConfigError(
            f"{_PATH}.total_layer_num",
            "must be the model's number of layers (>= 1)",
            "set it to the number of transformer layers",
            value=total,
        )
    if section.random_ltd_layer_num is None or section.random_ltd_layer_num != len(ids):
        raise ConfigError(
            f"{_PATH}.random_ltd_layer_num",
            f"must equal the length of random_ltd_layer_id ({len(ids)})",
            "list exactly random_ltd_layer_num layer ids",
            value=section.random_ltd_layer_num,
        )
    if len(set(ids)) != len(ids) or any(not 0 <= i < total for i in ids):
        raise ConfigError(
            f"{_PATH}.random_ltd_layer_id",
            f"ids must be distinct and in [0, total_layer_num={total})",
            "fix the ids or total_layer_num",
            value=ids,
        )
    if section.model_type not in ("decoder", "encoder"):
        raise ConfigError(
            f"{_PATH}.model_type", 'must be "decoder" or "encoder"', "set one", value=section.model_type
        )
    if section.hidden_state_order not in ("batch_seq_dim", "seq_batch_dim"):
        raise ConfigError(
            f"{_PATH}.hidden_state_order",
            'must be "batch_seq_dim" or "seq_batch_dim"',
            "set the layout of the layers' hidden states",
            value=section.hidden_state_order,
        )
    lr_schedule = section.layer_token_lr_schedule or {}
    if lr_schedule.get("enabled"):
        raise ConfigError(
            f"{_PATH}.layer_token_lr_schedule.enabled",
            "is not implemented (DeepSpeed raises NotImplementedError too)",
            "set it to false and use the config's scheduler",
            value=True,
        )
    schedule = section.random_ltd_schedule
    if schedule.schedule_type != "fixed_linear":
        raise ConfigError(
            f"{_PATH}.random_ltd_schedule.schedule_type",
            'must be "fixed_linear"',
            'set "fixed_linear"',
            value=schedule.schedule_type,
        )
    if not 0 < schedule.min_value <= schedule.max_value:
        raise ConfigError(
            f"{_PATH}.random_ltd_schedule.min_value",
            f"must be in (0, max_value={schedule.max_value}]",
            "set min_value to the first kept length and max_value to the full length",
            value=schedule.min_value,
        )
    for key in ("require_steps", "seq_per_step"):
        value = schedule.schedule_config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"{_PATH}.random_ltd_schedule.schedule_config.{key}",
                "must be an integer >= 1",
                f'add "{key}" to schedule_config',
                value=value,
            )
    model_type = section.model_type
    assert model_type is not None  # one of the two names, checked above
    return total, model_type


_CONVERT = "shardwise.data_efficiency.convert_to_random_ltd(model, LayerClass)"


def active_layers(ids: list[int], layers: list[RandomLTDLayer]) -> list[RandomLTDLayer]:
    """The wrapped layers that drop tokens: those whose ``layer_id`` is in ``ids``
    (``random_ltd_layer_id``), in module order.

    Raises:
        ConfigError: (key ``random_ltd_layer_id``) no wrapper, a wrapper without a layer id, an id
            that is not wrapped, or a layer the caller chose to wrap that the config does not list.

    Example:
        >>> from torch import nn
        >>> wrapped = [RandomLTDLayer(nn.Identity(), layer_id=i) for i in range(3)]
        >>> [layer.layer_id for layer in active_layers([2, 0], wrapped)]
        [0, 2]
    """
    key = f"{_PATH}.random_ltd_layer_id"
    if not layers:
        raise ConfigError(
            key,
            "lists the layers that drop tokens, but the model has no RandomLTDLayer wrapper",
            f"call {_CONVERT} before initialize",
            value=ids,
        )
    unnumbered = [layer for layer in layers if layer.layer_id is None]
    if unnumbered:
        raise ConfigError(
            key,
            f"{len(unnumbered)} RandomLTDLayer wrapper(s) carry no layer_id, so they cannot be matched to "
            "the ids",
            f"wrap the layers with {_CONVERT}, or pass layer_id= to RandomLTDLayer",
            value=ids,
        )
    wrapped = sorted(int(layer.layer_id) for layer in layers)  # type: ignore[arg-type]
    missing = [i for i in ids if i not in wrapped]
    if missing:
        raise ConfigError(
            key,
            f"layers {missing} are listed but not wrapped (the model's RandomLTDLayer wrappers are layers "
            f"{wrapped})",
            f"call {_CONVERT} without layer_ids to wrap every layer (the config then picks), or pass "
            "layer_ids=random_ltd_layer_id",
            value=ids,
        )
    chosen = sorted(int(layer.layer_id) for layer in layers if layer.chosen)  # type: ignore[arg-type]
    unlisted = [i for i in chosen if i not in ids]
    if unlisted:
        raise ConfigError(
            key,
            f"convert_to_random_ltd was given layer_ids {chosen}, but the config does not list {unlisted}",
            "list the same layers in random_ltd_layer_id as in convert_to_random_ltd's layer_ids, or call it "
            "without layer_ids to let the config pick",
            value=ids,
        )
    return [layer for layer in layers if layer.layer_id in ids]


def build_random_ltd_hook(
    efficiency: DataEfficiencyConfig, model: nn.Module, *, global_batch_size: int
) -> RandomLTDHook | None:
    """The hook for an enabled ``data_routing.random_ltd``, else None.

    The wrapped layers listed in ``random_ltd_layer_id`` drop tokens (:func:`active_layers`) and
    take ``hidden_state_order``, ``model_type`` and ``model_mask_name`` from the section.

    Raises:
        ConfigError: an inconsistent section, or a model whose wrapped layers do not match it.
    """
    section = efficiency.data_routing.random_ltd
    if not (efficiency.enabled and efficiency.data_routing.enabled and section.enabled):
        return None
    total_layers, _ = _check(section)
    layers = _configure(section, model)
    sched = section.random_ltd_schedule
    schedule = RandomLTDSchedule(
        sched.min_value,
        sched.max_value,
        sched.schedule_config["require_steps"],
        sched.schedule_config["seq_per_step"],
        total_layers=total_layers,
        ltd_layers=len(section.random_ltd_layer_id),
        global_batch_size=global_batch_size,
    )
    return RandomLTDHook(schedule, layers, section)


def _configure(section: RandomLTDConfig, model: nn.Module) -> list[RandomLTDLayer]:
    """The model's wrapped layers that drop tokens, given the (checked) section's layout settings."""
    _, model_type = _check(section)
    layers = active_layers(list(section.random_ltd_layer_id), random_ltd_layers(model))
    for layer in layers:
        layer.seq_dim = 0 if section.hidden_state_order == "seq_batch_dim" else 1
        layer.model_type = model_type
        layer.mask_name = section.model_mask_name
    return layers
