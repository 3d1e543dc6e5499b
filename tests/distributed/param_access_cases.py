"""Per-rank scenario for test_param_access.py: ``deepspeed.utils.safe_get/set_*`` at every ZeRO stage."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from zero_reference import BETAS, EPS, LR, WD, batch, config, make_model

import shardwise
from shardwise.zero import param_access as pa


def _full_module_value(param: torch.Tensor) -> torch.Tensor:
    """The module's own parameter, whole (a DTensor's gathered value at stage 3)."""
    return (param.full_tensor() if hasattr(param, "full_tensor") else param.detach()).float()


def _raises(fn: Any, *args: Any) -> str:
    try:
        fn(*args)
    except ValueError as error:
        return str(error)
    return ""


def access(rank: int, world: int, case: tuple[int, str]) -> dict[str, Any]:
    """Two steps of AdamW. Step 1: the getters against the module and a reference; step 2 after the
    setters wrote the fp32 value, exp_avg and the gradient: a torch AdamW fed the same values agrees."""
    stage, precision = case
    torch.set_num_threads(1)
    engine, _, _, _ = shardwise.initialize(model=make_model(), config=config(stage, precision, 1, 2, world))
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    out: dict[str, Any] = {"before_backward": _raises(pa.safe_get_full_grad, named[0][1])}
    out["masters_match_module"] = all(
        torch.equal(pa.safe_get_full_fp32_param(p).to(p.dtype), _full_module_value(p).to(p.dtype))  # type: ignore[union-attr]
        for _, p in named
    )

    x, y = batch(0, 0, rank, 2)
    engine.backward(engine(x, y))
    reference = make_model()  # fp32 reference gradient: the mean over ranks of each rank's own
    reference(x, y).backward()
    ref_grads = {}
    for name, param in reference.named_parameters():
        dist.all_reduce(param.grad)
        ref_grads[name] = param.grad / world
    grads = {n: pa.safe_get_full_grad(p) for n, p in named}
    out["grad_error"] = max(
        float((grads[n] - ref_grads[n]).abs().max() / ref_grads[n].abs().max()) for n, _ in named
    )
    masters = {n: pa.safe_get_full_fp32_param(p) for n, p in named}
    out["local_fp32"] = _raises(pa.safe_get_local_fp32_param, named[0][1]) if stage < 3 else None
    if stage == 3:
        out["local_pieces"] = {n: pa.safe_get_local_fp32_param(p) for n, p in named}
        out["local_grads"] = {n: pa.safe_get_local_grad(p) for n, p in named}
        out["full_masters"] = masters
        out["full_grads"] = grads
    engine.step()
    out["after_step"] = _raises(pa.safe_get_full_grad, named[0][1])
    out["no_state_key"] = _raises(pa.safe_get_full_optimizer_state, named[0][1], "momentum_buffer")

    # single-process reference AdamW on the fp32 masters, fed the gradients the getters returned
    ref_params = [masters[n].clone() for n, _ in named]
    ref_opt = torch.optim.AdamW(ref_params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    for tensor, (n, _) in zip(ref_params, named):
        tensor.grad = grads[n].clone()
    ref_opt.step()
    errors = []
    for tensor, (_, param) in zip(ref_params, named):
        state = ref_opt.state[tensor]
        errors.append(_close(pa.safe_get_full_optimizer_state(param, "exp_avg"), state["exp_avg"]))
        errors.append(_close(pa.safe_get_full_optimizer_state(param, "exp_avg_sq"), state["exp_avg_sq"]))
        errors.append(_close(pa.safe_get_full_fp32_param(param), tensor))
    out["step1_error"] = max(errors)

    # step 2: write the fp32 value, exp_avg and the gradient, then the step must use them
    x, y = batch(1, 0, rank, 2)
    engine.backward(engine(x, y))
    written_ok = []
    for tensor, (name, param) in zip(ref_params, named):
        gen = torch.Generator().manual_seed(sum(map(ord, name)))  # the same on every rank
        value = tensor + 0.01 * torch.randn(tensor.shape, generator=gen)
        pa.safe_set_full_fp32_param(param, value)
        tensor.data.copy_(value)
        written_ok.append(torch.equal(_full_module_value(param).to(param.dtype), value.to(param.dtype)))
        written_ok.append(torch.equal(pa.safe_get_full_fp32_param(param), value))
        avg = 0.5 * ref_opt.state[tensor]["exp_avg"]
        pa.safe_set_full_optimizer_state(param, avg, "exp_avg")
        ref_opt.state[tensor]["exp_avg"].copy_(avg)
        grad = 2.0 * pa.safe_get_full_grad(param)  # type: ignore[operator]
        pa.safe_set_full_grad(param, grad)
        tensor.grad = grad.clone()
        written_ok.append(torch.equal(pa.safe_get_full_grad(param), grad))
    out["written"] = all(written_ok)
    engine.step()
    ref_opt.step()
    errors = []
    for tensor, (_, param) in zip(ref_params, named):
        errors.append(
            _close(pa.safe_get_full_optimizer_state(param, "exp_avg"), ref_opt.state[tensor]["exp_avg"])
        )
        errors.append(_close(pa.safe_get_full_fp32_param(param), tensor))
    out["step2_error"] = max(errors)
    engine.destroy()
    return out


def _close(got: torch.Tensor | None, want: torch.Tensor) -> float:
    """Largest error relative to the largest magnitude (inf when missing)."""
    if got is None:
        return float("inf")
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
