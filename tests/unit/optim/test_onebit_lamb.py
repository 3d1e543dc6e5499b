"""OneBitLamb in one process: its warm-up is Lamb without bias correction bit for bit (a trust
ratio per parameter, also on ZeRO stage 0's flat masters), it records the lamb coefficients,
and after the warm-up the variance is frozen and the factor stays within its bounds."""

from __future__ import annotations

import pytest
import torch

from shardwise.config.errors import KeyedValueError
from shardwise.optim import Lamb, build_optimizer
from shardwise.optim.exchanging import GradientExchangingOptimizer
from shardwise.optim.onebit_lamb import OneBitLamb
from shardwise.zero.flat_group import FlatGroup

HYPER = {
    "lr": 1e-2,
    "betas": (0.8, 0.99),
    "eps": 1e-6,
    "weight_decay": 0.01,
    "max_coeff": 3.0,
    "min_coeff": 0.05,
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _train(make, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = make(model.parameters())
    data = torch.randn(steps, 4, 5, generator=torch.Generator().manual_seed(1))
    for x in data:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return model, opt


def _trust_ratio(p: torch.Tensor, update: torch.Tensor) -> float:
    w, u = float(p.detach().norm()), float(update.detach().norm())
    return 1.0 if w == 0 or u == 0 else min(max(w / u, HYPER["min_coeff"]), HYPER["max_coeff"])


def test_warm_up_is_lamb_without_bias_correction_and_records_the_coefficients() -> None:
    steps = 5
    onebit_model, onebit = _train(
        lambda ps: OneBitLamb(ps, freeze_step=steps, coeff_beta=0.7, **HYPER), steps
    )
    lamb_model, _ = _train(lambda ps: Lamb(ps, bias_correction=False, **HYPER), steps)
    for a, b in zip(onebit_model.parameters(), lamb_model.parameters()):
        assert torch.equal(a, b)
    # the recorded coefficients: an EMA (coeff_beta) of each parameter's own trust ratio, replayed
    model = _model()
    data = torch.randn(steps, 4, 5, generator=torch.Generator().manual_seed(1))
    reference = Lamb(model.parameters(), bias_correction=False, **HYPER)
    expected = [0.0] * len(list(model.parameters()))
    for x in data:
        reference.zero_grad()
        model(x).pow(2).mean().backward()
        ratios = []
        for p in model.parameters():
            state = reference.state.get(p) or {}
            m = state.get("exp_avg", torch.zeros_like(p)) * 0.8 + 0.2 * p.grad
            v = state.get("exp_avg_sq", torch.zeros_like(p)) * 0.99 + 0.01 * p.grad * p.grad
            ratios.append(_trust_ratio(p, m / (v.sqrt() + HYPER["eps"]) + HYPER["weight_decay"] * p))
        reference.step()
        expected = [0.7 * e + 0.3 * r if r != 1.0 else e for e, r in zip(expected, ratios)]
    recorded = [float(onebit.state[p]["lamb_coeff_freeze"]) for p in onebit_model.parameters()]
    assert recorded == pytest.approx(expected, rel=1e-5)


def test_stage0_masters_are_whole_parameters_so_lamb_is_per_parameter() -> None:
    """ZeRO stage 0 steps the inner optimizer on its flat masters: one tensor per parameter (never a
    bucket), so Lamb's trust ratio is per parameter there, as FusedLamb's."""
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((4, 3), (3,), (6, 2), (5,))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    flat = FlatGroup(
        params,
        rank=0,
        world_size=1,
        bucket_numel=16,
        shard=False,
        full_grad_buffer=True,
        grad_dtype=torch.float32,
    )
    masters = flat.master_params()
    assert [m.shape for m in masters] == [p.shape for p in twins]
    inner, direct = Lamb(masters, **HYPER), Lamb(twins, **HYPER)
    for step in range(3):
        grads = [
            torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i))
            for i, p in enumerate(twins)
        ]
        for master, twin, g in zip(masters, twins, grads):
            master.grad, twin.grad = g.clone(), g.clone()
        inner.step()
        direct.step()
    for master, twin in zip(masters, twins):
        assert torch.equal(master, twin)


def test_compression_phase_freezes_the_variance_and_bounds_the_factor() -> None:
    model, opt = _train(
        lambda ps: OneBitLamb(
            ps, freeze_step=3, factor_min=0.8, factor_max=1.5, factor_threshold=0.05, **HYPER
        ),
        3,
    )
    frozen = {p: opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()}
    last = {p: 1.0 for p in model.parameters()}
    data = torch.randn(6, 4, 5, generator=torch.Generator().manual_seed(2))
    for x in data:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        for p in model.parameters():
            state = opt.state[p]
            assert torch.equal(state["exp_avg_sq"], frozen[p])
            factor = float(state["last_factor"])
            assert 0.8 <= factor <= 1.5
            assert last[p] * 0.95 * (1 - 1e-6) <= factor <= last[p] * 1.05 * (1 + 1e-6)  # stored in fp32
            last[p] = factor
            assert "scaling_coeff" in state and "exp_avg_sq_fresh" in state
    assert opt.steps_taken() == 9


def test_it_declares_its_own_exchange() -> None:
    opt = OneBitLamb([torch.nn.Parameter(torch.zeros(3))], freeze_step=1)
    assert isinstance(opt, GradientExchangingOptimizer)
    assert not opt.exchanges_gradients  # one rank: nothing to exchange


def test_registry_builds_it_with_every_documented_key() -> None:
    params = {
        "lr": 1e-3,
        "freeze_step": 400,
        "bias_correction": False,
        "betas": [0.8, 0.999],
        "eps": 1e-8,
        "weight_decay": 0.01,
        "max_coeff": 0.3,
        "min_coeff": 0.01,
        "cuda_aware": False,
        "comm_backend_name": "mpi",
        "coeff_beta": 0.8,
        "factor_max": 3.0,
        "factor_min": 0.6,
        "factor_threshold": 0.2,
    }
    opt = build_optimizer("OneBitLamb", params, [torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, OneBitLamb)
    assert (opt.freeze_step, opt.coeff_beta, opt.factor_max, opt.factor_min, opt.factor_threshold) == (
        400,
        0.8,
        3.0,
        0.6,
        0.2,
    )
    assert opt.defaults["max_coeff"] == 0.3 and opt.defaults["betas"] == (0.8, 0.999)


@pytest.mark.parametrize(
    ("key", "value"),
    [("amsgrad", True), ("eps_inside_sqrt", True), ("max_grad_norm", 1.0), ("var_freeze_step", 10)],
)
def test_registry_names_the_key_it_refuses(key: str, value: object) -> None:
    with pytest.raises(KeyedValueError) as info:
        build_optimizer("onebitlamb", {key: value}, [torch.nn.Parameter(torch.zeros(2))])
    assert info.value.key == f"optimizer.params.{key}"


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"freeze_step": 0}, "freeze_step"),
        ({"factor_min": 2.0, "factor_max": 1.0}, "factor_min"),
        ({"coeff_beta": 1.0}, "coeff_beta"),
    ],
)
def test_bad_values_are_refused(kwargs: dict[str, float], word: str) -> None:
    with pytest.raises(ValueError, match=word):
        OneBitLamb([torch.nn.Parameter(torch.zeros(1))], **kwargs)
