"""LR schedulers against the traces measured on DeepSpeed 0.19.8 (spec section 4).

Every trace is driven through the torch wrapper with a real optimizer: after the k-th
``scheduler.step()`` (iteration i = k - 1) the optimizer's param group must hold the
spec's value for that i.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from shardwise.schedulers import (
    SCHEDULERS,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
    lr_at,
    momentum_at,
)
from shardwise.schedulers.formulas import OneCycleSchedule, WarmupSchedule

pytestmark = pytest.mark.numeric

TOL = 1e-5


def _sgd(lr: float = 0.1, groups: int = 1) -> torch.optim.SGD:
    params = [{"params": [torch.nn.Parameter(torch.ones(2))]} for _ in range(groups)]
    return torch.optim.SGD(params, lr=lr)


def _adamw(lr: float = 0.1) -> torch.optim.AdamW:
    return torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=lr)


def _train_step(opt: torch.optim.Optimizer) -> None:
    """One real optimizer update, so the scheduler runs beside a live optimizer as in training."""
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.full_like(p, 0.5)
    opt.step()
    opt.zero_grad()


def _trace(opt: torch.optim.Optimizer, sched: object, steps: int, key: str = "lr") -> list[float]:
    values = []
    for _ in range(steps):
        _train_step(opt)
        sched.step()  # type: ignore[attr-defined]
        value = opt.param_groups[0][key]
        values.append(value[0] if key == "betas" else value)
    return values


def _close(actual: list[float], expected: list[float]) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= TOL, f"iteration {i}: got {a}, expected {e}\nfull trace: {actual}"


# ----------------------------------------------------------------------------- verified traces


def test_warmup_lr_log_trace() -> None:
    opt = _sgd()
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=5, warmup_type="log")
    _close(_trace(opt, sched, 7), [0, 0.0430677, 0.0682606, 0.0861353, 0.1, 0.1, 0.1])


def test_warmup_lr_linear_trace() -> None:
    opt = _sgd()
    sched = WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=4, warmup_type="linear")
    _close(_trace(opt, sched, 7), [0.01, 0.0325, 0.055, 0.0775, 0.1, 0.1, 0.1])


def test_warmup_lr_first_two_updates_use_min_lr() -> None:
    # Update 1 uses the constructor's LR, update 2 the LR at iteration 0 (gamma 0): both are min.
    opt = _sgd(lr=0.5)
    sched = WarmupLR(opt, warmup_min_lr=0.02, warmup_max_lr=0.1, warmup_num_steps=4, warmup_type="linear")
    used = []
    for _ in range(3):
        used.append(opt.param_groups[0]["lr"])
        _train_step(opt)
        sched.step()
    _close(used, [0.02, 0.02, 0.04])


def test_warmup_lr_max_none_uses_group_lr_and_num_steps_floor_of_two() -> None:
    opt = _sgd(lr=0.3)
    sched = WarmupLR(opt, warmup_min_lr=0.1, warmup_num_steps=1, warmup_type="linear")
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    # N = max(2, 1) = 2: iteration 1 is half way, not the end of warmup.
    _close(_trace(opt, sched, 3), [0.1, 0.2, 0.3])


def test_warmup_decay_lr_trace() -> None:
    opt = _sgd()
    sched = WarmupDecayLR(
        opt,
        total_num_steps=10,
        warmup_min_lr=0.0,
        warmup_max_lr=0.1,
        warmup_num_steps=4,
        warmup_type="linear",
    )
    expected = [0, 0.025, 0.05, 0.075, 0.1, 0.08333, 0.06667, 0.05, 0.03333, 0.01667, 0, 0]
    _close(_trace(opt, sched, 12), expected)


def test_warmup_cosine_lr_trace_and_zero_initial_lr() -> None:
    opt = _sgd(lr=0.1)
    sched = WarmupCosineLR(
        opt,
        total_num_steps=10,
        warmup_min_ratio=0.1,
        warmup_num_steps=4,
        cos_min_ratio=0.01,
        warmup_type="linear",
    )
    assert opt.param_groups[0]["lr"] == 0.0  # the very first update uses lr 0 (verified)
    expected = [
        0.01,
        0.0325,
        0.055,
        0.0775,
        0.0933683,
        0.07525,
        0.0505,
        0.02575,
        0.0076317,
        0.001,
        0.001,
        0.001,
    ]
    _close(_trace(opt, sched, 12), expected)


_ONE_CYCLE = {
    "cycle_min_lr": 0.01,
    "cycle_max_lr": 0.1,
    "cycle_first_step_size": 3,
    "cycle_second_step_size": 3,
    "decay_step_size": 2,
    "decay_lr_rate": 0.5,
    "cycle_min_mom": 0.8,
    "cycle_max_mom": 0.9,
    "decay_mom_rate": 0.1,
}


def test_one_cycle_lr_and_beta0_traces() -> None:
    opt = _adamw()
    sched = OneCycle(opt, **_ONE_CYCLE)
    # At init: cycle_min_lr and betas (cycle_min_mom, 0.99), not the formula's max_mom.
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
    assert opt.param_groups[0]["betas"] == pytest.approx((0.8, 0.99))
    lrs, beta0s, beta1s = [], [], []
    for _ in range(12):
        _train_step(opt)
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        beta0s.append(opt.param_groups[0]["betas"][0])
        beta1s.append(opt.param_groups[0]["betas"][1])
    _close(lrs, [0.04, 0.07, 0.1, 0.07, 0.04, 0.01, 0.008, 0.006667, 0.005714, 0.005, 0.004444, 0.004])
    # beta0 grows past 1 in the decay phase, faithfully copied (verified: 1.17). The spec prints
    # 4 decimals, so compare at that precision and against the exact thirds at 1e-5.
    spec_beta0 = [0.8667, 0.8333, 0.8, 0.8333, 0.8667, 0.9, 0.945, 0.99, 1.035, 1.08, 1.125, 1.17]
    assert [round(b, 4) for b in beta0s] == spec_beta0
    third = 0.1 / 3
    _close(beta0s, [0.9 - third, 0.9 - 2 * third, 0.8, 0.9 - 2 * third, 0.9 - third, *spec_beta0[5:]])
    assert beta1s == [0.99] * 12
    assert sched.get_mom() == [(pytest.approx(1.17), 0.99)]


def test_one_cycle_staircase_trace() -> None:
    opt = _adamw()
    sched = OneCycle(
        opt, cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=4, cycle_first_stair_count=2
    )
    _close(_trace(opt, sched, 10), [0, 0.5, 0.5, 1, 0.5, 0.5, 0, 0, 0, 0])


def test_one_cycle_without_betas_warns_and_leaves_momentum(caplog: pytest.LogCaptureFixture) -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.5)
    logger = logging.getLogger("shardwise")
    logger.addHandler(caplog.handler)
    try:
        sched = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=3)
    finally:
        logger.removeHandler(caplog.handler)
    assert "betas" in caplog.text
    assert not sched.cycle_momentum and sched.get_mom() is None
    _close(_trace(opt, sched, 2), [0.04, 0.07])
    assert "betas" not in opt.param_groups[0]
    assert opt.param_groups[0]["momentum"] == 0.5


def test_lr_range_test_staircase_trace() -> None:
    opt = _sgd()
    sched = LRRangeTest(
        opt,
        lr_range_test_min_lr=0.01,
        lr_range_test_step_size=2,
        lr_range_test_step_rate=1.0,
        lr_range_test_staircase=True,
    )
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
    expected = [0.01, 0.02, 0.02, 0.03, 0.03, 0.04, 0.04, 0.05, 0.05, 0.06, 0.06, 0.07]
    _close(_trace(opt, sched, 12), expected)


def test_lr_range_test_smooth() -> None:
    opt = _sgd()
    sched = LRRangeTest(
        opt, lr_range_test_min_lr=0.01, lr_range_test_step_size=2, lr_range_test_step_rate=1.0
    )
    _close(_trace(opt, sched, 3), [0.015, 0.02, 0.025])


# ----------------------------------------------------------------------------- torch schedulers by name


def test_torch_step_lr_by_name() -> None:
    # Spec: StepLR(step_size=3, gamma=0.5) with lr 0.1 gives 0.1, 0.1, 0.05, 0.05, 0.05, 0.025 after each step.
    opt = _sgd(lr=0.1)
    sched = build_scheduler("StepLR", {"step_size": 3, "gamma": 0.5}, opt)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    _close(_trace(opt, sched, 6), [0.1, 0.1, 0.05, 0.05, 0.05, 0.025])


def test_build_our_schedulers_by_name_and_unwrap() -> None:
    class Wrapper:
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

    opt = _sgd()
    sched = build_scheduler("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 4}, Wrapper(opt))
    assert isinstance(sched, SCHEDULERS["WarmupDecayLR"])
    assert sched.optimizer is opt
    assert set(SCHEDULERS) == {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"}


def test_unknown_name_suggests_closest() -> None:
    with pytest.raises(ValueError, match=r"Did you mean 'WarmupLR'\?") as info:
        build_scheduler("WarmUpLR", {}, _sgd())
    assert "OneCycle" in str(info.value) and "StepLR" in str(info.value)
    with pytest.raises(ValueError, match=r"Did you mean 'CosineAnnealingLR'\?"):
        build_scheduler("CosineAnealingLR", {"T_max": 3}, _sgd())


def test_unknown_and_missing_params() -> None:
    with pytest.raises(ValueError, match=r"warmup_num_step .*Did you mean 'warmup_num_steps'"):
        build_scheduler("WarmupLR", {"warmup_num_step": 10}, _sgd())
    with pytest.raises(ValueError, match=r"requires params \['total_num_steps'\]"):
        build_scheduler("WarmupCosineLR", {}, _sgd())
    with pytest.raises(ValueError, match=r"\['cycle_min_lr', 'cycle_max_lr'\]"):
        build_scheduler("OneCycle", {}, _sgd())
    with pytest.raises(ValueError, match=r"stepsize .*step_size"):
        build_scheduler("StepLR", {"stepsize": 3}, _sgd())


# ----------------------------------------------------------------------------- state and stepping


def test_state_dict_round_trip_and_lazy_lr() -> None:
    opt = _sgd()
    kwargs = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 4, "warmup_type": "linear"}
    sched = WarmupLR(opt, **kwargs)
    for _ in range(3):
        sched.step()
    assert sched.state_dict() == {"last_batch_iteration": 2}

    opt2 = _sgd(lr=0.7)
    restored = WarmupLR(opt2, **kwargs)
    restored.load_state_dict(sched.state_dict())
    assert restored.last_batch_iteration == 2
    assert opt2.param_groups[0]["lr"] == 0.0  # untouched until the next step()
    restored.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.075)
    with pytest.raises(ValueError, match="last_batch_iteration"):
        restored.load_state_dict({"epoch": 3})


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (WarmupLR, {}),
        (WarmupDecayLR, {"total_num_steps": 10}),
        (WarmupCosineLR, {"total_num_steps": 10}),
        (OneCycle, {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}),
        (LRRangeTest, {}),
    ],
)
def test_state_dict_is_exactly_last_batch_iteration(cls: type, kwargs: dict) -> None:
    sched = cls(_adamw(), **kwargs)
    assert sched.state_dict() == {"last_batch_iteration": -1}
    sched.step()
    sched.step()
    assert sched.state_dict() == {"last_batch_iteration": 1}
    assert sched.get_last_lr() == [sched.optimizer.param_groups[0]["lr"]]


def test_step_with_explicit_iteration_jumps() -> None:
    opt = _sgd()
    sched = WarmupDecayLR(
        opt,
        total_num_steps=10,
        warmup_min_lr=0.0,
        warmup_max_lr=0.1,
        warmup_num_steps=4,
        warmup_type="linear",
    )
    sched.step(7)
    assert sched.last_batch_iteration == 7
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.03333, abs=TOL)
    assert sched.get_last_lr() == [opt.param_groups[0]["lr"]]


def test_tensor_lr_is_filled_in_place() -> None:
    lr = torch.tensor(0.1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=lr)
    sched = WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=4, warmup_type="linear")
    assert opt.param_groups[0]["lr"] is lr
    sched.step()
    sched.step()
    assert opt.param_groups[0]["lr"] is lr
    assert lr.item() == pytest.approx(0.0325)


# ----------------------------------------------------------------------------- per-group values


def test_scalar_broadcast_and_per_group_lists() -> None:
    opt = _sgd(groups=2)
    WarmupLR(opt, warmup_min_lr=0.05, warmup_max_lr=0.1)
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.05]

    opt = _sgd(groups=2)
    sched = WarmupLR(
        opt, warmup_min_lr=[0.0, 0.01], warmup_max_lr=[0.1, 0.2], warmup_num_steps=2, warmup_type="linear"
    )
    sched.step(1)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.05, 0.105])

    opt = _sgd(groups=2)
    sched = OneCycle(opt, cycle_min_lr=[0.01, 0.02], cycle_max_lr=0.1, cycle_first_step_size=3)
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.04, 0.02 + 0.08 / 3])


@pytest.mark.parametrize(
    ("cls", "kwargs", "name"),
    [
        (WarmupLR, {"warmup_min_lr": [0.0, 0.0, 0.0]}, "warmup_min_lr"),
        (WarmupDecayLR, {"total_num_steps": 5, "warmup_max_lr": [0.1]}, "warmup_max_lr"),
        (OneCycle, {"cycle_min_lr": 0.0, "cycle_max_lr": [0.1]}, "cycle_max_lr"),
        (LRRangeTest, {"lr_range_test_min_lr": [0.1, 0.1, 0.1]}, "lr_range_test_min_lr"),
    ],
)
def test_list_length_must_match_groups(cls: type, kwargs: dict, name: str) -> None:
    got = len(kwargs[name])
    with pytest.raises(ValueError, match=rf"expected 2 value for {name}, got {got}"):
        cls(_sgd(groups=2), **kwargs)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("cls", "kwargs", "pattern"),
    [
        (WarmupLR, {"warmup_num_steps": 0}, r"warmup_num_steps=0 .*integer >= 1"),
        (WarmupLR, {"warmup_num_steps": 2.5}, r"warmup_num_steps=2.5"),
        (WarmupLR, {"warmup_min_lr": -0.1}, r"warmup_min_lr=-0.1 .*>= 0"),
        (WarmupDecayLR, {"total_num_steps": -1}, r"total_num_steps=-1"),
        (WarmupCosineLR, {"total_num_steps": 10, "cos_min_ratio": math.nan}, r"cos_min_ratio=nan .*finite"),
        (
            OneCycle,
            {"cycle_min_lr": 0.0, "cycle_max_lr": 1.0, "cycle_first_step_size": 0},
            r"cycle_first_step_size=0",
        ),
        (
            OneCycle,
            {"cycle_min_lr": 0.0, "cycle_max_lr": 1.0, "cycle_second_step_size": -2},
            r"cycle_second_step_size=-2",
        ),
        (LRRangeTest, {"lr_range_test_step_size": 0}, r"lr_range_test_step_size=0"),
        (LRRangeTest, {"lr_range_test_staircase": "yes"}, r"lr_range_test_staircase='yes' .*boolean"),
        (WarmupLR, {"last_batch_iteration": -5}, r"last_batch_iteration=-5"),
    ],
)
def test_invalid_parameters_raise_value_error(cls: type, kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern) as info:
        cls(_sgd(), **kwargs)
    assert "Fix:" in str(info.value)


def test_unknown_warmup_type_falls_back_to_log() -> None:
    opt = _sgd()
    sched = WarmupLR(opt, warmup_max_lr=0.1, warmup_num_steps=5, warmup_type="cosine")
    _close(_trace(opt, sched, 2), [0.0, 0.0430677])


def test_rejects_objects_without_an_optimizer() -> None:
    with pytest.raises(ValueError, match="needs a torch optimizer"):
        WarmupLR(object())


# ----------------------------------------------------------------------------- pure formulas


def test_pure_lr_at_matches_the_wrappers() -> None:
    params = {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 4, "warmup_type": "linear"}
    assert [lr_at("WarmupLR", params, i) for i in range(-1, 2)] == pytest.approx([0.01, 0.01, 0.0325])
    cos = {"total_num_steps": 10, "warmup_min_ratio": 0.1, "warmup_num_steps": 4, "cos_min_ratio": 0.01}
    cos["warmup_type"] = "linear"
    assert lr_at("WarmupCosineLR", cos, -1, base_lr=0.1) == 0.0
    assert lr_at("WarmupCosineLR", cos, 4, base_lr=0.1) == pytest.approx(0.0933683, abs=TOL)
    with pytest.raises(ValueError, match="base_lr"):
        lr_at("WarmupCosineLR", cos, 4)
    assert lr_at("OneCycle", _ONE_CYCLE, -1) == 0.01
    assert lr_at("OneCycle", _ONE_CYCLE, 6) == pytest.approx(0.008)
    assert momentum_at(_ONE_CYCLE, -1) == 0.8
    assert momentum_at(_ONE_CYCLE, 11) == pytest.approx(1.17)
    with pytest.raises(ValueError, match="Did you mean 'OneCycle'"):
        lr_at("OneCycles", _ONE_CYCLE, 0)


def test_formula_dataclasses_validate_and_edge_cases() -> None:
    assert WarmupSchedule(warmup_min_lr=0.2, warmup_max_lr=0.4, warmup_num_steps=3).lr(-7) == 0.2
    # Uneven halves: s1 = 2, s2 = 4, total 6. Peak at i = 1, back to min at i = 5.
    s = OneCycleSchedule(
        cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=2, cycle_second_step_size=4
    )
    assert [s.lr(i) for i in range(6)] == pytest.approx([0.5, 1.0, 0.75, 0.5, 0.25, 0.0])
    # s2 = 0: a pure ramp, then the decay phase (disabled here, so min_lr).
    ramp = OneCycleSchedule(
        cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=4, cycle_second_step_size=0
    )
    assert [ramp.lr(i) for i in range(5)] == pytest.approx([0.25, 0.5, 0.75, 0.0, 0.0])
    with pytest.raises(ValueError, match="cycle_min_mom"):
        OneCycleSchedule(cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_min_mom=True)  # type: ignore[arg-type]


def test_deepspeed_attributes_of_the_schedulers() -> None:
    """min_lrs/max_lrs/warmup_num_steps/warmup_type/step_ratio/get_lr_ratio: DeepSpeed's readable state."""
    import torch

    from shardwise.schedulers.lr_schedulers import OneCycle, WarmupCosineLR, WarmupLR

    def adam(*lrs: float) -> torch.optim.Optimizer:
        return torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs])

    warm = WarmupLR(adam(0.1, 0.2), warmup_num_steps=1, warmup_type="linear")
    assert (warm.min_lrs, warm.max_lrs, warm.warmup_num_steps, warm.warmup_type) == ([0.0, 0.0], [0.1, 0.2], 2, "linear")
    cosine = WarmupCosineLR(adam(0.01), total_num_steps=10, warmup_num_steps=10, cos_min_ratio=0.1,
                            warmup_type="unknown")
    assert cosine.get_lr_ratio() == 0.0 and cosine.warmup_type == "log" and cosine.total_num_steps == 10
    cosine.step(12)
    assert cosine.get_lr_ratio() == pytest.approx(0.1)
    cycle = OneCycle(adam(0.1), cycle_min_lr=[0.001], cycle_max_lr=[0.01], cycle_first_step_size=4,
                     cycle_second_step_size=0)
    assert (cycle.min_lrs, cycle.max_lrs, cycle.step_ratio) == ([0.001], [0.01], 1.0)
    assert OneCycle(adam(0.1), 0.001, 0.01, cycle_first_step_size=4).step_ratio == 0.5
