"""Adam's moments in fp32 for 16-bit parameters: ``DeepSpeedCPUAdam(fp32_optimizer_states=True)``,
DeepSpeed's default.

torch's Adam keeps ``exp_avg``/``exp_avg_sq`` in each parameter's dtype, so a bf16 parameter stepped
by it rounds its moments to 8 mantissa bits at every step. DeepSpeed's CPU Adam kernel instead reads
the 16-bit parameter and gradient as fp32, keeps fp32 moments, computes the update in fp32 and rounds
only the new parameter back. :func:`fp32_state_adam_step` does that with torch's own Adam function
(``torch.optim.adam.adam``), so the arithmetic is torch's, bit for bit what ``torch.optim.Adam``
computes on an fp32 copy of the parameter carrying the same moments. The state stays under the
parameter itself in ``optimizer.state[param]``, so checkpoints and ``state_dict()`` see one state
per parameter as usual.

Inside the engine the optimizer steps fp32 masters and this path never runs; it serves scripts that
hand ``DeepSpeedCPUAdam`` 16-bit parameters directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.adam import adam

__all__ = ["fp32_state_adam_step", "is_low_precision", "restore_fp32_states"]


def is_low_precision(param: torch.Tensor) -> bool:
    """A floating parameter narrower than fp32 (bf16, fp16)."""
    return param.is_floating_point() and param.element_size() < 4


def _init_state(state: dict[str, Any], param: torch.Tensor, amsgrad: bool) -> None:
    # torch's Adam initialises the same keys: a float32 scalar step and zero moments
    state["step"] = torch.tensor(0.0, dtype=torch.float32)
    state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32, memory_format=torch.preserve_format)
    if amsgrad:
        state["max_exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32, memory_format=torch.preserve_format)


@torch.no_grad()
def fp32_state_adam_step(optimizer: torch.optim.Adam, group: dict[str, Any], params: Sequence[torch.Tensor]) -> None:
    """One Adam step of ``params`` (16-bit, with gradients, all in ``group``) with fp32 moments,
    computed in fp32 and rounded into the parameters."""
    if not params:
        return
    amsgrad = bool(group["amsgrad"])
    masters, grads, exp_avgs, exp_avg_sqs, max_sqs, steps = [], [], [], [], [], []
    for param in params:
        if param.grad is None or param.grad.is_sparse:
            raise RuntimeError("fp32-state Adam steps dense gradients only")
        state = optimizer.state[param]
        if not state:
            _init_state(state, param, amsgrad)
        masters.append(param.detach().float())
        grads.append(param.grad.detach().float())
        exp_avgs.append(state["exp_avg"])
        exp_avg_sqs.append(state["exp_avg_sq"])
        if amsgrad:
            max_sqs.append(state["max_exp_avg_sq"])
        steps.append(state["step"])
    beta1, beta2 = group["betas"]
    adam(
        masters,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_sqs,
        steps,
        foreach=group["foreach"],
        fused=group["fused"],
        decoupled_weight_decay=group["decoupled_weight_decay"],
        amsgrad=amsgrad,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group["maximize"],
    )
    for param, master in zip(params, masters, strict=True):
        param.copy_(master)


def restore_fp32_states(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """After ``Optimizer.load_state_dict`` (which casts states to the parameters' dtype): put the
    saved fp32 moments of 16-bit parameters back, from ``state_dict``."""
    saved = state_dict["state"]
    for group, saved_group in zip(optimizer.param_groups, state_dict["param_groups"], strict=True):
        for param, index in zip(group["params"], saved_group["params"], strict=True):
            if not is_low_precision(param) or index not in saved:
                continue
            for key, value in saved[index].items():
                if key != "step" and torch.is_tensor(value) and value.is_floating_point():
                    optimizer.state[param][key] = value.to(device=param.device, dtype=torch.float32, copy=True)
