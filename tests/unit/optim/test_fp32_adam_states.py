"""``DeepSpeedCPUAdam(fp32_optimizer_states=...)`` on 16-bit parameters.

The reference is exact by construction: torch's ``AdamW`` stepping an fp32 copy of the 16-bit
parameter (refreshed from it before each step, rounded back into it after) with fp32 moments is the
computation DeepSpeed's kernel defines, and shardwise runs torch's same Adam function on the same
fp32 values, so the parameters and moments are compared bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.optim.fused_adam import DeepSpeedCPUAdam

STEPS = 6


def _grads(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=generator).to(dtype) for _ in range(STEPS)]


def _fp32_reference(start: torch.Tensor, grads: list[torch.Tensor], **kwargs: object) -> tuple[torch.Tensor, dict]:
    param = start.clone()
    holder = torch.nn.Parameter(param.float())
    optimizer = torch.optim.AdamW([holder], **kwargs)  # type: ignore[arg-type]
    for grad in grads:
        with torch.no_grad():
            holder.copy_(param.float())
        holder.grad = grad.float()
        optimizer.step()
        with torch.no_grad():
            param.copy_(holder)
    return param, optimizer.state[holder]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_fp32_states_step_16bit_parameters_in_fp32(dtype: torch.dtype, amsgrad: bool) -> None:
    start = torch.randn(33, 7, generator=torch.Generator().manual_seed(0)).to(dtype)
    grads = _grads(start.shape, dtype)
    settings = {"lr": 0.01, "weight_decay": 0.1, "amsgrad": amsgrad}
    expected, expected_state = _fp32_reference(start, grads, **settings)

    low = torch.nn.Parameter(start.clone())
    full = torch.nn.Parameter(start.float().clone())  # an fp32 parameter in the same group
    optimizer = DeepSpeedCPUAdam([low, full], **settings)  # type: ignore[arg-type]
    plain = torch.nn.Parameter(start.float().clone())
    plain_optimizer = torch.optim.AdamW([plain], **settings)  # type: ignore[arg-type]
    for grad in grads:
        low.grad, full.grad, plain.grad = grad.clone(), grad.float(), grad.float()
        optimizer.step()
        plain_optimizer.step()

    state = optimizer.state[low]
    assert low.dtype == dtype and state["exp_avg"].dtype == torch.float32
    assert torch.equal(low, expected)
    for key in ("exp_avg", "exp_avg_sq", "step") + (("max_exp_avg_sq",) if amsgrad else ()):
        assert torch.equal(state[key], expected_state[key]), key
    assert torch.equal(full, plain)  # fp32 parameters: torch's AdamW, untouched by the 16-bit path
    assert not torch.equal(low.float(), start.float())


def test_parameter_dtype_states_when_asked() -> None:
    start = torch.randn(64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    grads = _grads(start.shape, torch.bfloat16)
    ours = torch.nn.Parameter(start.clone())
    theirs = torch.nn.Parameter(start.clone())
    optimizer = DeepSpeedCPUAdam([ours], lr=0.01, fp32_optimizer_states=False)
    reference = torch.optim.AdamW([theirs], lr=0.01, weight_decay=0.0)
    for grad in grads:
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        optimizer.step()
        reference.step()
    assert optimizer.state[ours]["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(ours, theirs)


def test_fp32_states_resume_from_state_dict() -> None:
    start = torch.randn(40, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    grads = _grads(start.shape, torch.bfloat16)
    straight = torch.nn.Parameter(start.clone())
    optimizer = DeepSpeedCPUAdam([straight], lr=0.01)
    for grad in grads:
        straight.grad = grad.clone()
        optimizer.step()

    resumed = torch.nn.Parameter(start.clone())
    first = DeepSpeedCPUAdam([resumed], lr=0.01)
    for grad in grads[:3]:
        resumed.grad = grad.clone()
        first.step()
    second = DeepSpeedCPUAdam([resumed], lr=0.01)
    second.load_state_dict(first.state_dict())
    for grad in grads[3:]:
        resumed.grad = grad.clone()
        second.step()
    assert second.state[resumed]["exp_avg"].dtype == torch.float32
    assert torch.equal(resumed, straight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_hooks_run_once_per_step(dtype: torch.dtype) -> None:
    """The parent classes' steps are hooked too once any of them was built; DeepSpeedCPUAdam's step
    runs torch's step pre/post hooks once (ZeRO's sub-group stepping counts the calls)."""
    torch.optim.Adam([torch.nn.Parameter(torch.ones(1))])  # hooks torch's Adam.step
    param = torch.nn.Parameter(torch.ones(3, dtype=dtype))
    optimizer = DeepSpeedCPUAdam([param])
    seen: list[str] = []
    optimizer.register_step_pre_hook(lambda *_: seen.append("pre"))
    optimizer.register_step_post_hook(lambda *_: seen.append("post"))
    param.grad = torch.ones(3, dtype=dtype)
    optimizer.step()
    assert seen == ["pre", "post"]
