"""The shared step maths (zero/step_math.py) and the strategy interface every stage implements."""

from __future__ import annotations

import inspect
import math
import random

import pytest

from shardwise.optim.clipping import clip_coefficient
from shardwise.zero.sharded_optimizer import ZeroOptimizer
from shardwise.zero.stage3 import Stage3Optimizer
from shardwise.zero.step_math import fp32, plan_step
from shardwise.zero.strategy import StepResult, ZeroStrategy, sharded_gradients_refusal


def _deepspeed_combined_scale(squared: float, mean_divisor: float, scale: float, clip: float) -> float:
    """DeepSpeed's ``combined_scale`` for the step: the averaging divisor times the loss scale,
    times the clip factor when the true norm exceeds ``clip``."""
    divisor = mean_divisor * scale
    norm = math.sqrt(squared) / divisor
    factor = (norm + 1e-6) / clip if clip > 0 else 0.0
    return divisor * factor if factor > 1 else divisor


def test_the_divisor_is_the_combined_scale_rounded_to_fp32_for_both_stages():
    rng = random.Random(0)
    for _ in range(2000):
        squared = rng.uniform(0, 1e4) * 10 ** rng.randint(-8, 8)
        pre = rng.choice([1.0, 0.5, 1 / 3, 0.25])
        post = rng.choice([1.0, 2.0, 3.0, 8.0, 2.0 / 3])
        scale = rng.choice([1.0, 2.0**8, 2.0**16, 0.5])
        clip = rng.choice([0.0, 0.05, 1.0, 1e3])
        plan = plan_step(squared, mean_divisor=post, loss_scale=scale, max_norm=clip, check_overflow=False)
        assert plan.grad_norm == math.sqrt(squared) / (post * scale)
        expected = _deepspeed_combined_scale(squared, post, scale, clip)
        assert plan.divisor == fp32(expected) and fp32(plan.divisor) == plan.divisor
        assert plan.divisor == pytest.approx(
            1 / clip_coefficient(math.sqrt(squared), clip, post * scale), rel=2**-23
        )
        plan3 = plan_step(
            squared, mean_divisor=post / pre, loss_scale=scale, max_norm=clip, check_overflow=True
        )
        assert plan3.divisor == fp32(_deepspeed_combined_scale(squared, post / pre, scale, clip))
        assert plan.apply and plan3.apply and not plan.overflow and not plan3.overflow


def test_fp32_rounds_to_nearest_and_saturates():
    assert fp32(1.0) == 1.0 and fp32(2.0**-149) == 2.0**-149 and fp32(2.0**-151) == 0.0
    assert fp32(1 + 2.0**-24) == 1.0 and fp32(1 + 2.0**-23) == 1 + 2.0**-23
    assert fp32(1e39) == math.inf and fp32(-1e39) == -math.inf


@pytest.mark.parametrize("squared", [math.inf, math.nan])
@pytest.mark.parametrize("check_overflow", [True, False])
def test_a_non_finite_norm_skips_in_every_precision(squared, check_overflow):
    plan = plan_step(squared, mean_divisor=2.0, loss_scale=4.0, max_norm=1.0, check_overflow=check_overflow)
    assert not plan.apply and plan.grad_norm == math.inf and plan.divisor == math.inf
    # only precisions that check for overflows hand it to the loss scaler
    assert plan.overflow is check_overflow
    assert plan.result() == StepResult(applied=False, grad_norm=math.inf, overflow=check_overflow)


def test_clipping_and_unscaling_in_one_divisor():
    plan = plan_step(400.0, mean_divisor=2.0, loss_scale=4.0, max_norm=0.0, check_overflow=True)
    assert plan.grad_norm == 2.5 and plan.divisor == 8.0  # no clip: average and unscale
    clipped = plan_step(400.0, mean_divisor=2.0, loss_scale=4.0, max_norm=1.0, check_overflow=True)
    assert clipped.divisor == pytest.approx(8 * 2.5, rel=1e-6)  # norm 2.5 clipped to 1
    assert plan.result() == StepResult(applied=True, grad_norm=2.5, overflow=False)


@pytest.mark.parametrize("cls", [ZeroOptimizer, Stage3Optimizer])
def test_every_stage_implements_the_strategy_explicitly(cls):
    assert ZeroStrategy in cls.__mro__
    members = [
        "param_groups", "prepare_backward", "after_backward", "step", "zero_grad", "set_gradient_sync",
        "broadcast_parameters", "close", "model_state_bytes",
    ]  # fmt: skip
    for name in members:
        assert getattr(cls, name) is not getattr(ZeroStrategy, name), (
            f"{cls.__name__}.{name} is not implemented"
        )
    assert not inspect.isabstract(cls)


def test_the_refusal_names_the_stage_and_the_alternative():
    message = sharded_gradients_refusal(3)
    assert (
        message.startswith("no_sync() is not possible at ZeRO stage 3")
        and "gradient_accumulation_steps" in message
    )
