"""OneBitAdam in one process: its warm-up is Adam without bias correction (AdamW form), bit for bit."""

from __future__ import annotations

import pytest
import torch

from shardwise.config.errors import KeyedValueError
from shardwise.optim import AdamNoBiasCorrection, build_optimizer
from shardwise.optim.exchanging import GradientExchangingOptimizer
from shardwise.optim.onebit_adam import OneBitAdam


def _train(make, steps: int = 6) -> list[torch.Tensor]:
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
def test_warm_up_is_adam_without_bias_correction_bit_for_bit(weight_decay: float) -> None:
    hyper = {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": weight_decay}
    onebit = _train(lambda ps: OneBitAdam(ps, freeze_step=3, **hyper))  # one process: never compresses
    adam = _train(lambda ps: AdamNoBiasCorrection(ps, adam_w_mode=True, **hyper))
    for a, b in zip(onebit, adam):
        assert torch.equal(a, b)


def test_it_declares_its_own_exchange_and_stays_local_without_a_group() -> None:
    opt = OneBitAdam([torch.nn.Parameter(torch.zeros(3))], freeze_step=0)
    assert isinstance(opt, GradientExchangingOptimizer)
    assert not opt.exchanges_gradients  # one rank: nothing to exchange
    assert opt.rank_state_dict() == {}


def test_registry_builds_it_with_every_documented_key() -> None:
    params = {
        "lr": 1e-3,
        "freeze_step": 400,
        "bias_correction": False,
        "betas": [0.8, 0.999],
        "eps": 1e-8,
        "eps_inside_sqrt": False,
        "weight_decay": 3e-7,
        "amsgrad": False,
        "cuda_aware": False,
        "comm_backend_name": "nccl",
    }
    opt = build_optimizer("OneBitAdam", params, [torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, OneBitAdam)
    assert opt.freeze_step == 400
    assert opt.defaults["betas"] == (0.8, 0.999)


@pytest.mark.parametrize(
    ("key", "value"), [("amsgrad", True), ("eps_inside_sqrt", True), ("var_freeze_step", 10)]
)
def test_registry_names_the_key_it_refuses(key: str, value: object) -> None:
    with pytest.raises(KeyedValueError) as info:
        build_optimizer("onebitadam", {key: value}, [torch.nn.Parameter(torch.zeros(2))])
    assert info.value.key == f"optimizer.params.{key}"


def test_freeze_step_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="freeze_step"):
        OneBitAdam([torch.nn.Parameter(torch.zeros(1))], freeze_step=-1)
