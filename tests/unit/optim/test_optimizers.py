"""Tests for shardwise.optim: Lamb/Lion/uncorrected Adam vs per-parameter references, the
registry's name resolution and errors, client optimizers, and clipping maths (spec §3.2, §7.3)."""

from __future__ import annotations

import copy
import math
import multiprocessing
import os
import re
import sys
import tempfile
import types

import pytest
import torch

from shardwise.optim import (
    OPTIMIZERS,
    ZERO_SUPPORTED_OPTIMIZERS,
    AdamNoBiasCorrection,
    Lamb,
    Lion,
    build_optimizer,
    clip_coefficient,
    clip_coefficient_tensor,
    global_norm,
    gradient_divisor,
    is_zero_supported,
    resolve_client_optimizer,
    scale_,
    squared_norm,
)
from shardwise.optim.fused_adam import DeepSpeedCPUAdam, FusedAdam
from shardwise.optim.onebit_adam import OneBitAdam
from shardwise.optim.onebit_lamb import OneBitLamb
from shardwise.optim.zero_one_adam import ZeroOneAdam

pytestmark = pytest.mark.numeric

# --------------------------------------------------------------------------- fixtures


def _make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    """A mix of shapes, including a zero tensor (trust ratio falls back to 1)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2), (1,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    params.append(torch.nn.Parameter(torch.zeros(4)))
    params.append(torch.nn.Parameter(100.0 * torch.randn(6, generator=gen)))  # large weights: clamps
    return params


def _grads(params: list[torch.Tensor], step: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    return [torch.randn(p.shape, generator=gen) * (0.1 + i) for i, p in enumerate(params)]


def _clone(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


# --------------------------------------------------------------------------- references


def _ref_lamb(
    weights: list[torch.Tensor],
    grad_seq: list[list[torch.Tensor | None]],
    *,
    lr: float,
    bias_correction: bool,
    betas: tuple[float, float],
    eps: float,
    eps_inside_sqrt: bool,
    weight_decay: float,
    max_coeff: float,
    min_coeff: float,
) -> list[torch.Tensor]:
    """FusedLamb, one tensor at a time, in plain arithmetic."""
    b1, b2 = betas
    w = [x.clone() for x in weights]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    t = [0] * len(w)
    for grads in grad_seq:
        for i, g in enumerate(grads):
            if g is None:
                continue
            t[i] += 1
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            denom = torch.sqrt(v[i] + eps) if eps_inside_sqrt else torch.sqrt(v[i]) + eps
            u = m[i] / denom + weight_decay * w[i]
            w_norm, u_norm = w[i].norm().item(), u.norm().item()
            ratio = min(max(w_norm / u_norm, min_coeff), max_coeff) if w_norm > 0 and u_norm > 0 else 1.0
            step_size = lr * math.sqrt(1 - b2 ** t[i]) / (1 - b1 ** t[i]) if bias_correction else lr
            w[i] = w[i] - step_size * ratio * u
    return w


def _ref_lion(weights, grad_seq, *, lr, betas, weight_decay):
    b1, b2 = betas
    w = [x.clone() for x in weights]
    m = [torch.zeros_like(x) for x in w]
    for grads in grad_seq:
        for i, g in enumerate(grads):
            c = b1 * m[i] + (1 - b1) * g
            w[i] = w[i] * (1 - lr * weight_decay) - lr * torch.sign(c)
            m[i] = b2 * m[i] + (1 - b2) * g
    return w


def _ref_adam_nobc(weights, grad_seq, *, lr, betas, eps, weight_decay, adam_w_mode):
    b1, b2 = betas
    w = [x.clone() for x in weights]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    for grads in grad_seq:
        for i, g in enumerate(grads):
            if not adam_w_mode:
                g = g + weight_decay * w[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            update = m[i] / (torch.sqrt(v[i]) + eps)
            if adam_w_mode:
                update = update + weight_decay * w[i]
            w[i] = w[i] - lr * update
    return w


def _run(opt: torch.optim.Optimizer, params, grad_seq) -> None:
    for grads in grad_seq:
        for p, g in zip(params, grads):
            p.grad = None if g is None else g.clone()
        opt.step()


def _assert_all_close(actual, expected) -> None:
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.detach(), e, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- Lamb

LAMB_CASES = [
    {},  # FusedLamb defaults
    {"lr": 2e-2, "weight_decay": 0.01, "max_coeff": 0.3, "min_coeff": 0.01, "bias_correction": False},
    {"lr": 5e-3, "eps_inside_sqrt": True, "betas": (0.8, 0.99), "eps": 1e-6},
    {"lr": 1e-2, "weight_decay": 0.1, "max_coeff": 0.5, "min_coeff": 0.08},
]


@pytest.mark.parametrize("kwargs", LAMB_CASES)
def test_lamb_matches_reference(kwargs):
    params = _make_params()
    start = _clone(params)
    grad_seq = [_grads(params, s) for s in range(5)]
    _run(Lamb(params, **kwargs), params, grad_seq)
    cfg = {
        "lr": 1e-3,
        "bias_correction": True,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "eps_inside_sqrt": False,
        "weight_decay": 0.0,
        "max_coeff": 10.0,
        "min_coeff": 0.01,
        **kwargs,
    }
    _assert_all_close(params, _ref_lamb(start, grad_seq, **cfg))
    assert not torch.equal(params[0].detach(), start[0])


def test_lamb_hand_computed_first_step():
    # w=[3,4] (norm 5), g=[1,1]: u = m/(sqrt(v)+eps) = sqrt(10)*[1,1], ratio = 5/|u|,
    # step_size = lr*sqrt(1-0.999)/(1-0.9); so w moves by lr*sqrt(0.001)/0.1 * 5/sqrt(2) each.
    p = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    p.grad = torch.ones(2)
    Lamb([p], lr=0.01).step()
    moved = 0.01 * math.sqrt(0.001) / 0.1 * 5 / math.sqrt(2)
    torch.testing.assert_close(p.detach(), torch.tensor([3.0 - moved, 4.0 - moved]), rtol=1e-6, atol=1e-6)


def test_lamb_trust_ratio_clamps_and_zero_weights():
    big = torch.nn.Parameter(torch.full((4,), 1000.0))
    zero = torch.nn.Parameter(torch.zeros(4))
    for p in (big, zero):
        p.grad = torch.ones(4)
    Lamb([big, zero], lr=0.1, bias_correction=False, max_coeff=2.0).step()
    # u = 0.1/(sqrt(0.001)+1e-8) per element, |w|/|u| is huge -> clamped to 2.
    u = 0.1 / (math.sqrt(0.001) + 1e-8)
    torch.testing.assert_close(big.detach(), torch.full((4,), 1000.0 - 0.1 * 2.0 * u))
    # zero weights: ratio 1.
    torch.testing.assert_close(zero.detach(), torch.full((4,), -0.1 * u))


def test_lamb_params_without_grad_keep_their_own_step_count():
    params = _make_params()
    start = _clone(params)
    grad_seq = [_grads(params, s) for s in range(4)]
    grad_seq[0][1] = None  # param 1 misses the first step: its bias correction lags by one
    grad_seq[2][3] = None
    _run(Lamb(params, lr=1e-2, weight_decay=0.01), params, grad_seq)
    expected = _ref_lamb(
        start,
        grad_seq,
        lr=1e-2,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        eps_inside_sqrt=False,
        weight_decay=0.01,
        max_coeff=10.0,
        min_coeff=0.01,
    )
    _assert_all_close(params, expected)


def test_lamb_max_grad_norm_clips_per_group_without_touching_grads():
    params = _make_params()
    start = _clone(params)
    grads = _grads(params, 0)
    total = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
    for p, g in zip(params, grads):
        p.grad = g.clone()
    Lamb(params, lr=1e-2, max_grad_norm=1.0).step()
    factor = 1.0 / ((total + 1e-6) / 1.0)
    expected = _ref_lamb(
        start,
        [[g * factor for g in grads]],
        lr=1e-2,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        eps_inside_sqrt=False,
        weight_decay=0.0,
        max_coeff=10.0,
        min_coeff=0.01,
    )
    _assert_all_close(params, expected)
    torch.testing.assert_close(params[0].grad, grads[0])


def test_lamb_rejects_amsgrad_and_bad_values():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="amsgrad"):
        Lamb(p, amsgrad=True)
    with pytest.raises(ValueError, match="min_coeff"):
        Lamb(p, min_coeff=2.0, max_coeff=1.0)


def test_lamb_state_dict_round_trip():
    params = _make_params()
    grad_seq = [_grads(params, s) for s in range(4)]
    opt = Lamb(params, lr=1e-2)
    _run(opt, params, grad_seq[:2])
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = Lamb(twin, lr=1e-2)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # state_dict() shares tensors
    _run(opt, params, grad_seq[2:])
    _run(opt2, twin, grad_seq[2:])
    for a, b in zip(params, twin):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# --------------------------------------------------------------------------- Lion


@pytest.mark.parametrize(
    "kwargs", [{}, {"lr": 3e-4, "betas": (0.95, 0.98), "weight_decay": 0.1}, {"weight_decay": 0.5}]
)
def test_lion_matches_reference(kwargs):
    params = _make_params()
    start = _clone(params)
    grad_seq = [_grads(params, s) for s in range(6)]
    _run(Lion(params, **kwargs), params, grad_seq)
    cfg = {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0, **kwargs}
    _assert_all_close(params, _ref_lion(start, grad_seq, **cfg))


def test_lion_first_step_is_sign_of_gradient():
    p = torch.nn.Parameter(torch.tensor([2.0, -1.0, 0.5]))
    p.grad = torch.tensor([0.3, -7.0, 0.0])
    Lion([p], lr=0.1, weight_decay=0.5).step()
    torch.testing.assert_close(
        p.detach(), torch.tensor([2.0, -1.0, 0.5]) * 0.95 - 0.1 * torch.tensor([1.0, -1.0, 0.0])
    )


def test_lion_defaults_are_deepspeeds():
    opt = Lion([torch.nn.Parameter(torch.zeros(1))])
    assert opt.defaults == {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0}


# --------------------------------------------------------------------------- uncorrected Adam


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_adam_no_bias_correction_matches_reference(adam_w_mode):
    params = _make_params()
    start = _clone(params)
    grad_seq = [_grads(params, s) for s in range(5)]
    _run(AdamNoBiasCorrection(params, lr=1e-2, weight_decay=0.05, adam_w_mode=adam_w_mode), params, grad_seq)
    expected = _ref_adam_nobc(
        start, grad_seq, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05, adam_w_mode=adam_w_mode
    )
    _assert_all_close(params, expected)


# --------------------------------------------------------------------------- registry: Adam family


def _model_params() -> list[torch.nn.Parameter]:
    return list(torch.nn.Linear(3, 2).parameters())


def test_adam_is_adamw_by_default_with_fusedadam_defaults():
    opt = build_optimizer("Adam", {}, _model_params())
    assert type(opt) is FusedAdam and opt.defaults["decoupled_weight_decay"] is True  # DeepSpeed's class
    d = opt.defaults
    assert (d["lr"], tuple(d["betas"]), d["eps"], d["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 0.0)
    assert d["fused"] is True  # CPU fp32: fused measured ~4x faster than foreach


def test_adam_w_mode_false_gives_adam_and_adamw_ignores_it():
    adam = build_optimizer("adam", {"adam_w_mode": False}, _model_params())
    assert type(adam) is FusedAdam and adam.defaults["decoupled_weight_decay"] is False
    opt = build_optimizer("AdamW", {"adam_w_mode": False, "weight_decay": 0.1}, _model_params())
    assert type(opt) is FusedAdam and opt.defaults["decoupled_weight_decay"] is True
    assert opt.defaults["weight_decay"] == 0.1
    assert build_optimizer("ADAMW", {}, _model_params()).defaults["decoupled_weight_decay"]  # case-insensitive


def test_weight_decay_default_zero_except_torch_adam():
    assert build_optimizer("AdamW", {}, _model_params()).defaults["weight_decay"] == 0.0
    opt = build_optimizer("Adam", {"torch_adam": True, "adam_w_mode": True}, _model_params())
    assert type(opt) is torch.optim.AdamW
    assert opt.defaults["weight_decay"] == 0.01  # torch.optim.AdamW's own default, as DeepSpeed
    opt = build_optimizer("Adam", {"torch_adam": True, "adam_w_mode": False}, _model_params())
    assert type(opt) is torch.optim.Adam and opt.defaults["weight_decay"] == 0.0


def test_betas_list_and_config_not_mutated():
    cfg = {"lr": 3e-4, "betas": [0.8, 0.95], "adam_w_mode": True}
    opt = build_optimizer("Adam", cfg, _model_params())
    assert opt.defaults["betas"] == (0.8, 0.95)
    assert cfg == {"lr": 3e-4, "betas": [0.8, 0.95], "adam_w_mode": True}


def test_bias_correction_false_uses_uncorrected_update():
    opt = build_optimizer("Adam", {"bias_correction": False, "weight_decay": 0.01}, _model_params())
    assert type(opt) is AdamNoBiasCorrection
    assert opt.defaults["adam_w_mode"] is True and opt.defaults["weight_decay"] == 0.01
    opt = build_optimizer("Adam", {"bias_correction": False, "adam_w_mode": False}, _model_params())
    assert opt.defaults["adam_w_mode"] is False
    assert type(build_optimizer("Adam", {"bias_correction": True}, _model_params())) is FusedAdam
    with pytest.raises(ValueError, match="always bias-correct"):
        build_optimizer("Adam", {"bias_correction": False, "torch_adam": True}, _model_params())


def test_amsgrad_rejected_unless_torch_adam():
    with pytest.raises(ValueError, match="amsgrad"):
        build_optimizer("Adam", {"amsgrad": True}, _model_params())
    opt = build_optimizer("Adam", {"amsgrad": True, "torch_adam": True}, _model_params())
    assert opt.defaults["amsgrad"] is True
    assert build_optimizer("Adam", {"amsgrad": False}, _model_params()).defaults["amsgrad"] is False


def test_adam_update_equals_plain_torch_adamw():
    a, b = _model_params(), _model_params()
    for x, y in zip(a, b):
        y.data.copy_(x.data)
    ours = build_optimizer("Adam", {"lr": 1e-2, "weight_decay": 0.1}, a)
    ref = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(3):
        for x, y, g in zip(a, b, _grads(a, step)):
            x.grad, y.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_fusedadam_steps_bitwise_as_torch_adamw_and_offload_builds_cpu_adam():
    a, b = _model_params(), _model_params()
    for x, y in zip(a, b):
        y.data.copy_(x.data)
    ours = build_optimizer("AdamW", {"lr": 1e-2, "weight_decay": 0.1}, a)
    ref = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(3):
        for x, y, g in zip(a, b, _grads(a, step)):
            x.grad, y.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert type(build_optimizer("Adam", {}, _model_params(), offload=True)) is DeepSpeedCPUAdam
    assert is_zero_supported(ours) and is_zero_supported(DeepSpeedCPUAdam)


def test_offload_picks_cpu_kernels_even_for_meta_params():
    meta = [torch.nn.Parameter(torch.empty(4, device="meta"))]
    assert build_optimizer("Adam", {}, meta, offload=True).defaults["fused"] is True
    assert build_optimizer("Adam", {}, meta).defaults.get("fused") in (None, False)
    explicit = build_optimizer("Adam", {"foreach": True}, _model_params())
    assert explicit.defaults["foreach"] is True and not explicit.defaults.get("fused")


# --------------------------------------------------------------------------- registry: others


def test_lamb_lion_adagrad_by_name():
    lamb = build_optimizer("Lamb", {"lr": 4e-3, "weight_decay": 0.01, "max_coeff": 0.3}, _model_params())
    assert type(lamb) is Lamb and lamb.defaults["max_coeff"] == 0.3 and lamb.defaults["min_coeff"] == 0.01
    lion = build_optimizer("lion", {"betas": [0.9, 0.99]}, _model_params())
    assert type(lion) is Lion and lion.defaults["betas"] == (0.9, 0.99) and lion.defaults["lr"] == 1e-3
    ada = build_optimizer("Adagrad", {}, _model_params())
    assert type(ada) is torch.optim.Adagrad and ada.defaults["lr"] == 1e-2 and ada.defaults["eps"] == 1e-10
    assert ada.defaults["fused"] is True  # CPU params


def test_torch_optim_fallback_is_case_sensitive():
    opt = build_optimizer("SGD", {"lr": 0.1, "momentum": 0.9}, _model_params())
    assert type(opt) is torch.optim.SGD and opt.defaults["momentum"] == 0.9
    assert type(build_optimizer("RMSprop", {"lr": 0.01}, _model_params())) is torch.optim.RMSprop
    with pytest.raises(ValueError, match='did you mean "SGD"') as err:
        build_optimizer("sgd", {"lr": 0.1}, _model_params())
    assert "case-sensitive" in str(err.value)
    with pytest.raises(ValueError, match="'adam'"):
        build_optimizer("Adamm", {}, _model_params())
    with pytest.raises(ValueError, match="not a supported optimizer"):
        build_optimizer("Optimizer", {}, _model_params())


def test_unknown_param_names_optimizer_key_choices_and_suggestion():
    with pytest.raises(ValueError) as err:
        build_optimizer("AdamW", {"lr": 1e-3, "weight_decya": 0.1}, _model_params())
    msg = str(err.value)
    assert '"AdamW"' in msg and "weight_decya" in msg and 'Did you mean "weight_decay"' in msg
    assert "Accepted keys:" in msg and "betas" in msg and "adam_w_mode" in msg
    with pytest.raises(ValueError, match="use_triton"):
        build_optimizer("Lion", {"use_triton": True}, _model_params())
    with pytest.raises(ValueError, match="nesterovv"):
        build_optimizer("SGD", {"lr": 0.1, "nesterovv": True}, _model_params())


def test_max_grad_norm_points_to_gradient_clipping():
    for name in ("Lamb", "Adam", "SGD"):
        with pytest.raises(ValueError, match="gradient_clipping"):
            build_optimizer(name, {"lr": 1e-3, "max_grad_norm": 1.0}, _model_params())


def test_auto_value_is_rejected_clearly():
    with pytest.raises(ValueError, match=re.escape('"optimizer.params.lr" is still "auto"')):
        build_optimizer("AdamW", {"lr": "auto"}, _model_params())


def test_onebit_family_builds_the_compressing_optimizers():
    # Real configs from DeepSpeedExamples (bing_bert 1-bit Adam / 0/1 Adam / 1-bit Lamb): all three
    # are real (issue 18; tests/unit/optim/test_onebit_adam.py, test_zero_one_adam.py, test_onebit_lamb.py).
    onebit_adam = {
        "lr": 4e-4,
        "weight_decay": 0.01,
        "bias_correction": False,
        "freeze_step": 23000,
        "cuda_aware": False,
        "comm_backend_name": "nccl",
    }
    # OneBitAdam is real (tests/unit/optim/test_onebit_adam.py): DeepSpeed's update, never bias-corrected
    opt = build_optimizer("OneBitAdam", onebit_adam, _model_params())
    assert type(opt) is OneBitAdam and opt.freeze_step == 23000
    assert opt.defaults["lr"] == 4e-4 and opt.defaults["weight_decay"] == 0.01
    assert type(build_optimizer("OnebitAdam", {"freeze_step": 400}, _model_params())) is OneBitAdam
    zero_one = {
        "lr": 1e-3,
        "weight_decay": 0.01,
        "bias_correction": False,
        "var_freeze_step": 1000,
        "var_update_scaler": 16,
        "local_step_scaler": 1000,
        "local_step_clipper": 16,
        "cuda_aware": False,
        "comm_backend_name": "nccl",
    }
    zero_one_adam = build_optimizer("ZeroOneAdam", zero_one, _model_params())
    assert type(zero_one_adam) is ZeroOneAdam and zero_one_adam.local_step_scaler == 1000
    assert zero_one_adam.var_freeze_step == 1000 and zero_one_adam.defaults["weight_decay"] == 0.01
    onebit_lamb = {
        "lr": 0.011,
        "weight_decay": 0.01,
        "bias_correction": False,
        "max_coeff": 0.3,
        "min_coeff": 0.01,
        "freeze_step": 1000,
        "cuda_aware": False,
        "comm_backend_name": "mpi",
        "coeff_beta": 0.9,
        "factor_max": 4.0,
        "factor_min": 0.5,
        "factor_threshold": 0.1,
    }
    lamb = build_optimizer("OneBitLamb", onebit_lamb, _model_params())
    assert type(lamb) is OneBitLamb and lamb.defaults["max_coeff"] == 0.3 and lamb.freeze_step == 1000
    assert lamb.coeff_beta == 0.9 and lamb.factor_max == 4.0 and lamb.comm_backend_name == "mpi"


def test_onebit_rejects_keys_of_other_variants():
    with pytest.raises(ValueError, match="var_freeze_step"):
        build_optimizer("OneBitAdam", {"var_freeze_step": 10}, _model_params())
    with pytest.raises(ValueError, match="adam_w_mode"):
        build_optimizer("ZeroOneAdam", {"adam_w_mode": False}, _model_params())


def test_mup_optimizers_import_lazily(monkeypatch):
    monkeypatch.setitem(sys.modules, "mup", None)  # makes `import mup` raise ImportError
    with pytest.raises(ValueError, match="pip install mup"):
        build_optimizer("MuAdam", {}, _model_params())

    class MuAdamW(torch.optim.AdamW):
        pass

    monkeypatch.setitem(sys.modules, "mup", types.SimpleNamespace(MuAdamW=MuAdamW))
    opt = build_optimizer("MuAdamW", {"lr": 0.5}, _model_params())
    assert type(opt) is MuAdamW and opt.defaults["lr"] == 0.5


def test_muon_by_name_builds_muon_with_adamw():
    opt = build_optimizer("Muon", {}, _model_params())  # Linear(3, 2): the weight Muon, the bias AdamW
    assert type(opt).__name__ == "MuonWithAdamW"
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]


def test_registry_keys_are_lower_case():
    assert all(k == k.lower() for k in OPTIMIZERS)
    assert {"adam", "adamw", "lamb", "lion", "adagrad", "onebitadam", "zerooneadam", "onebitlamb"} <= set(
        OPTIMIZERS
    )


# --------------------------------------------------------------------------- param groups / clients


def test_build_drops_empty_groups_and_rejects_shared_params():
    a, b = _model_params()
    opt = build_optimizer("SGD", {"lr": 0.1}, [{"params": [a]}, {"params": []}, {"params": [b], "lr": 0.5}])
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 0.5
    with pytest.raises(ValueError, match="param groups 0 and 1"):
        build_optimizer("Adam", {}, [{"params": [a, b]}, {"params": [b]}])


def test_client_optimizer_instance_and_callable():
    a, b = _model_params()
    inst = torch.optim.SGD([{"params": [a]}, {"params": [b]}], lr=0.1)
    inst.param_groups.append({**inst.param_groups[0], "params": []})
    assert resolve_client_optimizer(inst) is inst and len(inst.param_groups) == 2

    seen = {}

    def factory(params):
        seen["params"] = params
        return torch.optim.Adam(params, lr=0.01)

    opt = resolve_client_optimizer(factory, iter([{"params": [a]}, {"params": []}, {"params": [b]}]))
    assert type(opt) is torch.optim.Adam and len(opt.param_groups) == 2
    assert len(seen["params"]) == 2  # the empty group never reached the factory

    with pytest.raises(ValueError, match=re.escape("not a torch.optim.Optimizer")):
        resolve_client_optimizer(lambda ps: "nope", [a])
    with pytest.raises(ValueError, match="model_parameters"):
        resolve_client_optimizer(factory)
    with pytest.raises(ValueError, match="callable"):
        resolve_client_optimizer(42)  # type: ignore[arg-type]

    shared = torch.optim.SGD([{"params": [a]}, {"params": [b]}], lr=0.1)
    shared.param_groups[1]["params"].append(a)
    with pytest.raises(ValueError, match="param groups 0 and 1"):
        resolve_client_optimizer(shared)


def test_zero_supported_list():
    p = _model_params()
    assert is_zero_supported(build_optimizer("Adam", {}, p))
    assert is_zero_supported(build_optimizer("Adagrad", {}, p))
    assert is_zero_supported(build_optimizer("Lion", {}, p))
    assert is_zero_supported(build_optimizer("Adam", {"bias_correction": False}, p))
    assert not is_zero_supported(build_optimizer("SGD", {"lr": 0.1}, p))
    assert not is_zero_supported(build_optimizer("Lamb", {}, p))  # per-tensor trust ratio

    class MyAdam(torch.optim.AdamW):
        pass

    assert not is_zero_supported(MyAdam(p))  # exact type, as DeepSpeed
    assert is_zero_supported(torch.optim.Adam)
    assert {"Adam", "AdamW", "Adagrad", "Lion"} <= ZERO_SUPPORTED_OPTIMIZERS


# --------------------------------------------------------------------------- clipping


def test_clip_coefficient_spec_formula():
    # fp16: norm measured on scaled grads; clip = ((scaled/scale) + 1e-6) / max; mult = 1/(scale*max(1,clip))
    scaled_norm, scale, max_norm = 2.6435 * 1024.0, 1024.0, 1.0
    clip = (scaled_norm / scale + 1e-6) / max_norm
    assert clip_coefficient(scaled_norm, max_norm, scale) == pytest.approx(1.0 / (scale * clip), rel=1e-12)
    # under the limit: only unscale
    assert clip_coefficient(0.5 * 1024.0, 1.0, 1024.0) == pytest.approx(1.0 / 1024.0, rel=1e-12)
    # disabled: 0 means no clipping whatever the norm
    assert clip_coefficient(1e6, 0.0, 8.0) == 0.125
    assert clip_coefficient(1e6, 0.0) == 1.0
    assert clip_coefficient(torch.tensor(10.0), 1.0) == pytest.approx(1.0 / (10.0 + 1e-6), rel=1e-7)
    with pytest.raises(ValueError, match="loss_scale"):
        clip_coefficient(1.0, 1.0, 0.0)


@pytest.mark.parametrize(
    ("norm", "max_norm", "scale"), [(2.6435 * 1024.0, 1.0, 1024.0), (0.5, 1.0, 1.0), (1e6, 0.0, 8.0)]
)
def test_gradient_divisor_is_deepspeeds_combined_scale(norm, max_norm, scale):
    clip = (norm / scale + 1e-6) / max_norm if max_norm > 0 else 0.0
    assert gradient_divisor(norm, max_norm, scale) == (scale * clip if clip > 1 else scale)
    assert clip_coefficient(norm, max_norm, scale) == 1.0 / gradient_divisor(norm, max_norm, scale)
    with pytest.raises(ValueError, match="loss_scale"):
        gradient_divisor(1.0, 1.0, 0.0)


@pytest.mark.parametrize("norm", [0.0, 0.3, 0.999999, 1.0, 1.5, 42.0])
def test_clip_coefficient_equals_fp32_rule(norm):
    # fp32 stage 0: coef = min(1, max_norm / (norm + 1e-6))
    assert clip_coefficient(norm, 1.0) == pytest.approx(min(1.0, 1.0 / (norm + 1e-6)), rel=1e-12)


@pytest.mark.parametrize(
    ("norm", "max_norm", "scale"), [(3.0, 1.0, 1.0), (0.2, 1.0, 1.0), (4096.0, 2.0, 512.0), (9.0, 0.0, 4.0)]
)
def test_clip_coefficient_tensor_matches_float(norm, max_norm, scale):
    got = clip_coefficient_tensor(torch.tensor(norm), max_norm, scale)
    assert got.dtype == torch.float32
    assert float(got) == pytest.approx(clip_coefficient(norm, max_norm, scale), rel=1e-6)


def test_norm_and_scale_reproduce_torch_clip_grad_norm():
    a = _make_params()
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for x, y, g in zip(a, b, _grads(a, 0)):
        x.grad, y.grad = g.clone(), g.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(b, max_norm=1.0)
    norm = global_norm(squared_norm(p.grad for p in a))
    torch.testing.assert_close(norm, ref_norm)
    scale_([p.grad for p in a], clip_coefficient(norm, 1.0))
    for x, y in zip(a, b):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-6, atol=1e-7)


def test_squared_norm_details():
    assert float(squared_norm([torch.tensor([3.0]), None, torch.tensor([[4.0]])])) == 25.0
    empty = squared_norm([])
    assert empty.dtype == torch.float32 and float(empty) == 0.0
    # bf16 inputs accumulate in fp32: 4096 elements of 1 -> 4096 exactly (bf16 sums would stall at 256)
    assert float(squared_norm([torch.ones(4096, dtype=torch.bfloat16)])) == 4096.0
    assert math.isinf(float(squared_norm([torch.tensor([1.0, float("inf")])])))
    assert math.isnan(float(squared_norm([torch.tensor([float("nan")])])))
    src = torch.tensor(9.0)
    assert float(global_norm(src)) == 3.0 and float(src) == 9.0  # input untouched


def test_scale_in_place_with_tensor_multiplier():
    grads = [torch.ones(3), torch.ones(2, dtype=torch.bfloat16)]
    scale_(grads, torch.tensor(0.25))
    assert torch.equal(grads[0], torch.full((3,), 0.25))
    assert torch.equal(grads[1], torch.full((2,), 0.25, dtype=torch.bfloat16))
    scale_(grads, 4.0)
    assert torch.equal(grads[0], torch.ones(3))


def _global_norm_worker(rank: int, world: int, init_file: str, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        local = torch.tensor(float((rank + 1) ** 2))  # squares 1 and 4 -> norm sqrt(5)
        world_norm = float(global_norm(local))
        as_list = float(global_norm(local, [dist.group.WORLD, dist.group.WORLD]))  # summed twice: 2*5
        queue.put((rank, world_norm, as_list, float(local)))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_global_norm_sums_squares_across_two_gloo_ranks():
    ctx = multiprocessing.get_context("fork")  # CPU only, torch already imported: fork is fast
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg_init")
        procs = [ctx.Process(target=_global_norm_worker, args=(r, 2, init_file, queue)) for r in range(2)]
        for p in procs:
            p.start()
        results = sorted(queue.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    for rank, world_norm, as_list, local in results:
        assert world_norm == pytest.approx(math.sqrt(5.0), rel=1e-6)
        assert as_list == pytest.approx(math.sqrt(10.0), rel=1e-6)  # [WORLD, WORLD]: 5 -> 10
        assert local == float((rank + 1) ** 2)
