"""ZeroOneAdam in one process: its schedule is DeepSpeed's counters, its first
``var_update_scaler`` steps are Adam without bias correction (AdamW form) bit for bit, and the
registry builds it with every documented key."""

from __future__ import annotations

import pytest
import torch

from shardwise.config.errors import KeyedValueError
from shardwise.optim import AdamNoBiasCorrection, build_optimizer
from shardwise.optim.exchanging import GradientExchangingOptimizer
from shardwise.optim.zero_one_adam import ZeroOneAdam
from shardwise.optim.zero_one_schedule import is_sync_step, is_variance_step


def _deepspeed_counters(steps: int, var_scaler: int, freeze: int, local_scaler: int, clipper: int):
    """DeepSpeed's per-parameter counters (zoadam.py), stepped literally: (variance steps, sync steps)."""
    var_interval, var_counter, local_interval, local_counter = 1, 0, 1, 0
    variance, sync = [], []
    for t in range(1, steps + 1):
        if t <= freeze:
            if t % var_interval == 0:
                variance.append(t)
                var_counter += 1
                if var_counter == var_scaler:
                    var_counter, var_interval = 0, var_interval * 2
        else:
            if t % local_interval == 0:
                sync.append(t)
            local_counter += 1
            if local_counter == local_scaler:
                local_counter, local_interval = 0, min(clipper, local_interval * 2)
    return variance, sync


@pytest.mark.parametrize(
    ("var_scaler", "freeze", "local_scaler", "clipper"),
    [(1, 40, 1, 16), (2, 30, 3, 5), (3, 200, 2, 8), (16, 100, 7, 16)],
)
def test_schedule_is_deepspeeds_counters(
    var_scaler: int, freeze: int, local_scaler: int, clipper: int
) -> None:
    steps = freeze + 120
    variance, sync = _deepspeed_counters(steps, var_scaler, freeze, local_scaler, clipper)
    assert [t for t in range(1, freeze + 1) if is_variance_step(t, var_scaler)] == variance
    found = [
        t
        for t in range(freeze + 1, steps + 1)
        if is_sync_step(t, var_freeze_step=freeze, scaler=local_scaler, clipper=clipper)
    ]
    assert found == sync


def _train(make, steps: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    opt = make(model.parameters())
    data = torch.randn(steps, 4, 5, generator=torch.Generator().manual_seed(1))
    for x in data:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_variance_steps_are_adam_without_bias_correction_bit_for_bit(weight_decay: float) -> None:
    hyper = {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": weight_decay}
    adam = lambda steps: _train(lambda ps: AdamNoBiasCorrection(ps, adam_w_mode=True, **hyper), steps)  # noqa: E731
    zero_one = lambda steps: _train(  # noqa: E731
        lambda ps: ZeroOneAdam(ps, var_update_scaler=4, var_freeze_step=100, **hyper), steps
    )
    assert all(torch.equal(a, b) for a, b in zip(zero_one(4), adam(4)))  # steps 1-4: variance steps
    assert not all(torch.equal(a, b) for a, b in zip(zero_one(5), adam(5)))  # step 5: variance kept


def test_variance_freezes_after_var_freeze_step() -> None:
    model = torch.nn.Linear(3, 2)
    opt = ZeroOneAdam(
        model.parameters(), lr=1e-2, var_freeze_step=3, var_update_scaler=100, local_step_clipper=4
    )
    for step in range(1, 8):
        opt.zero_grad()
        model(torch.randn(4, 3)).pow(2).sum().backward()
        before = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()] if step > 1 else None
        opt.step()
        if before is not None:
            same = all(torch.equal(b, opt.state[p]["exp_avg_sq"]) for b, p in zip(before, model.parameters()))
            assert same == (step > 3), step
    assert opt.steps_taken() == 7


def test_it_declares_its_own_exchange_and_stays_local_without_a_group() -> None:
    opt = ZeroOneAdam([torch.nn.Parameter(torch.zeros(3))], var_freeze_step=0)
    assert isinstance(opt, GradientExchangingOptimizer)
    assert not opt.exchanges_gradients and not opt.communicates_next_step  # one rank: nothing to send
    assert opt.rank_state_dict() == {}


def test_registry_builds_it_with_every_documented_key() -> None:
    params = {
        "lr": 1e-3,
        "betas": [0.8, 0.999],
        "eps": 1e-8,
        "weight_decay": 3e-7,
        "bias_correction": False,
        "var_freeze_step": 400,
        "var_update_scaler": 8,
        "local_step_scaler": 100,
        "local_step_clipper": 4,
        "cuda_aware": False,
        "comm_backend_name": "nccl",
    }
    opt = build_optimizer("ZeroOneAdam", params, [torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, ZeroOneAdam)
    assert (opt.var_freeze_step, opt.var_update_scaler, opt.local_step_scaler, opt.local_step_clipper) == (
        400,
        8,
        100,
        4,
    )
    assert opt.defaults["betas"] == (0.8, 0.999)


@pytest.mark.parametrize(
    ("key", "value"),
    [("amsgrad", True), ("eps_inside_sqrt", True), ("max_grad_norm", 1.0), ("freeze_step", 10)],
)
def test_registry_names_the_key_it_refuses(key: str, value: object) -> None:
    with pytest.raises(KeyedValueError) as info:
        build_optimizer("zerooneadam", {key: value}, [torch.nn.Parameter(torch.zeros(2))])
    assert info.value.key == f"optimizer.params.{key}"


@pytest.mark.parametrize("key", ["var_update_scaler", "local_step_scaler", "local_step_clipper"])
def test_intervals_must_be_positive(key: str) -> None:
    with pytest.raises(ValueError, match=key):
        ZeroOneAdam([torch.nn.Parameter(torch.zeros(1))], **{key: 0})
