"""Progressive layer drop: the schedule formula, the hook's order and state, and the config errors."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from shardwise.config import ConfigError, load_config
from shardwise.runtime.progressive_layer_drop import (
    build_progressive_layer_drop_hook,
    keep_layer,
    layer_keep_probability,
    pld_theta,
)
from shardwise.runtime.step_hooks import ForwardContext, StepOutcome


def _config(**section: Any) -> Any:
    return load_config({"train_batch_size": 2, "progressive_layer_drop": {"enabled": True, **section}}).config.progressive_layer_drop


def _forward(x: Any, progressive_layer_drop: bool = False, pld_theta: float = 1.0) -> Any:
    return x


def test_theta_follows_the_formula_and_decays_to_theta() -> None:
    assert pld_theta(0, 0.5, 0.001) == 1.0
    assert pld_theta(1000, 0.5, 0.001) == pytest.approx(0.5 * math.exp(-1.0) + 0.5, rel=1e-15)
    assert pld_theta(10**7, 0.3, 0.01) == pytest.approx(0.3)
    assert pld_theta(5, 1.0, 0.5) == 1.0  # theta 1.0 (the config default): never drops


def test_the_hook_updates_after_each_step_from_the_step_count_before_it() -> None:
    hook = build_progressive_layer_drop_hook(_config(theta=0.5, gamma=0.2), _forward)
    assert hook is not None
    seen = []
    for step in range(1, 5):
        _, kwargs = hook.adjust_forward((), {"a": 1}, ForwardContext(global_step=step - 1, training=True))
        seen.append(kwargs["pld_theta"])
        assert kwargs["progressive_layer_drop"] is True and kwargs["a"] == 1
        hook.after_optimizer_step(StepOutcome(step, step * 2, True, 1.0))
    assert seen == [1.0, 1.0, pld_theta(1, 0.5, 0.2), pld_theta(2, 0.5, 0.2)]
    assert hook.adjust_forward((), {}, ForwardContext(global_step=4, training=False)) == ((), {})
    fresh = build_progressive_layer_drop_hook(_config(theta=0.5, gamma=0.2), _forward)
    assert fresh is not None
    fresh.load_state_dict(hook.state_dict())
    assert fresh.theta == hook.theta == pld_theta(3, 0.5, 0.2)


def test_a_checkpointed_theta_that_is_not_a_number_is_refused_naming_the_key() -> None:
    hook = build_progressive_layer_drop_hook(_config(theta=0.5, gamma=0.2), _forward)
    assert hook is not None
    for bad in ("0.5", True, None):
        with pytest.raises(ValueError, match=r"progressive_layer_drop.*'theta'.*not a number"):
            hook.load_state_dict({"theta": bad})
    hook.load_state_dict({"theta": 1})  # an int is a number
    assert hook.theta == 1.0


def test_disabled_or_absent_section_builds_no_hook() -> None:
    assert build_progressive_layer_drop_hook(load_config({"train_batch_size": 2}).config.progressive_layer_drop, _forward) is None
    assert build_progressive_layer_drop_hook(_config(enabled=False), _forward) is None


@pytest.mark.parametrize(("key", "value"), [("theta", 1.5), ("theta", -0.1), ("gamma", -1.0)])
def test_out_of_range_settings_name_the_key(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"progressive_layer_drop.{key}"):
        build_progressive_layer_drop_hook(_config(**{key: value}), _forward)


def test_a_forward_without_the_keyword_arguments_is_refused_with_a_fix() -> None:
    with pytest.raises(ConfigError, match="pld_theta") as info:
        build_progressive_layer_drop_hook(_config(theta=0.5), torch.nn.Linear(2, 2).forward)
    assert "keep_layer" in str(info.value)
    assert build_progressive_layer_drop_hook(_config(theta=0.5), lambda x, **kw: x) is not None


def test_deeper_layers_are_kept_less_often() -> None:
    assert [layer_keep_probability(0.5, i, 2) for i in range(2)] == [0.75, 0.5]
    gen = torch.Generator().manual_seed(0)
    kept = [sum(keep_layer(0.5, i, 4, gen) for _ in range(4000)) / 4000 for i in range(4)]
    # binomial standard deviation <= 0.008 for 4000 draws: 5 sigma is 0.04
    assert kept == pytest.approx([0.875, 0.75, 0.625, 0.5], abs=0.04)
    with pytest.raises(ValueError, match="layer_index"):
        layer_keep_probability(0.5, 4, 4)
