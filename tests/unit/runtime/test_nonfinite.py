"""The non-finite step policy: warnings naming the step, the consecutive limit, the fp16 scaler's share."""

from __future__ import annotations

import logging

import pytest

from shardwise.config import ConfigError, load_config
from shardwise.precision.loss_scaler import DynamicLossScaler, NoOpLossScaler, StaticLossScaler
from shardwise.runtime.nonfinite import NonFiniteSteps, NonFiniteStepsError, scaler_adapts
from shardwise.utils.logging import get_logger


@pytest.fixture
def warnings(caplog):
    caplog.set_level(logging.WARNING, logger="shardwise")
    get_logger().addHandler(caplog.handler)
    yield caplog
    get_logger().removeHandler(caplog.handler)


def test_each_skipped_step_warns_with_its_number_and_an_applied_step_resets(warnings):
    guard = NonFiniteSteps(limit=3)
    guard.record(step=4, applied=False, scaler_adapts=False)
    guard.record(step=5, applied=False, scaler_adapts=False)
    guard.record(step=6, applied=True, scaler_adapts=False)
    guard.record(step=7, applied=False, scaler_adapts=False)
    messages = [r.getMessage() for r in warnings.records]
    assert [m.split(":")[0] for m in messages] == ["step 4", "step 5", "step 7"]
    assert "skipped_steps" in messages[0] and "(1 in a row" in messages[0] and "(2 in a row" in messages[1]
    assert guard.consecutive == 1


def test_the_limit_raises_naming_the_count_the_step_and_the_fix(warnings):
    guard = NonFiniteSteps(limit=2)
    guard.record(step=10, applied=False, scaler_adapts=False)
    with pytest.raises(NonFiniteStepsError) as info:
        guard.record(step=11, applied=False, scaler_adapts=False)
    message = str(info.value)
    assert message.startswith("2 consecutive optimizer steps, the last at global step 11,")
    assert "max_consecutive_nonfinite_steps=2" in message and "gradient_clipping" in message
    assert isinstance(info.value, RuntimeError)


def test_overflows_the_dynamic_scaler_answers_are_neither_counted_nor_warned(warnings):
    guard = NonFiniteSteps(limit=1)
    for step in range(1, 30):
        guard.record(step=step, applied=False, scaler_adapts=True)
    assert guard.consecutive == 0 and not warnings.records


def test_the_scaler_adapts_only_above_its_minimum():
    dynamic = DynamicLossScaler(initial_scale_power=1, hysteresis=1, min_loss_scale=1.0)
    assert scaler_adapts(dynamic)  # scale 2 > 1
    dynamic.update_scale(overflow=True)  # 2 -> 1
    assert not scaler_adapts(dynamic)  # at the minimum: further overflows count
    assert not scaler_adapts(StaticLossScaler(128.0)) and not scaler_adapts(NoOpLossScaler())


@pytest.mark.parametrize("limit", [0, -1, True, 2.5])
def test_the_limit_must_be_a_positive_whole_number(limit):
    with pytest.raises(ValueError, match="max_consecutive_nonfinite_steps"):
        NonFiniteSteps(limit)


def test_the_config_key_defaults_to_20_and_rejects_non_counts():
    assert load_config({"train_batch_size": 8}).config.max_consecutive_nonfinite_steps == 20
    assert (
        load_config(
            {"train_batch_size": 8, "max_consecutive_nonfinite_steps": 3}
        ).config.max_consecutive_nonfinite_steps
        == 3
    )
    for bad in (0, True, "many"):
        with pytest.raises(ConfigError) as info:
            load_config({"train_batch_size": 8, "max_consecutive_nonfinite_steps": bad})
        assert "max_consecutive_nonfinite_steps" in str(info.value)
