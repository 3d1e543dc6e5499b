"""The DeepSpeed-shaped helpers clients import: ops optimizer classes, clone_tensors_for_torch_save, the accelerator."""

from __future__ import annotations

import pytest
import torch

from shardwise.compat.accelerator import get_accelerator
from shardwise.compat.ds_utils import clone_tensors_for_torch_save
from shardwise.compat.ops import DeepSpeedCPUAdam, FusedAdam
from shardwise.optim.adam import AdamNoBiasCorrection


def test_cpu_adam_is_adamw_by_default() -> None:
    w1 = torch.nn.Parameter(torch.ones(3))
    w2 = torch.nn.Parameter(torch.ones(3))
    ours = DeepSpeedCPUAdam([w1], lr=0.1, weight_decay=0.1)
    torch_adamw = torch.optim.AdamW([w2], lr=0.1, weight_decay=0.1)
    for w, opt in ((w1, ours), (w2, torch_adamw)):
        w.grad = torch.tensor([1.0, -2.0, 0.5])
        opt.step()
    assert torch.equal(w1, w2)


@pytest.mark.parametrize("cls", [FusedAdam, DeepSpeedCPUAdam])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_bias_correction_false_builds_the_uncorrected_update(cls: type, adam_w_mode: bool) -> None:
    """As DeepSpeed's kernels: bias_correction=False is Adam without the 1 - beta^t corrections."""
    w1 = torch.nn.Parameter(torch.ones(3))
    w2 = torch.nn.Parameter(torch.ones(3))
    mode = {"adam_w_mode" if cls is FusedAdam else "adamw_mode": adam_w_mode}
    ours = cls([w1], lr=0.1, bias_correction=False, weight_decay=0.1, **mode)
    reference = AdamNoBiasCorrection([w2], lr=0.1, weight_decay=0.1, adam_w_mode=adam_w_mode)
    assert isinstance(ours, AdamNoBiasCorrection)
    for _ in range(2):
        for w, opt in ((w1, ours), (w2, reference)):
            w.grad = torch.tensor([1.0, -2.0, 0.5])
            opt.step()
    assert torch.equal(w1, w2)
    # step 1 of the uncorrected update: m = 0.1 g, v = 0.001 g^2, so |step| = lr * 0.1 / sqrt(0.001) ~ 0.316 lr
    w3 = torch.nn.Parameter(torch.zeros(1))
    opt = cls([w3], lr=1.0, bias_correction=False, betas=(0.9, 0.999), eps=0.0)
    w3.grad = torch.ones(1)
    opt.step()
    assert torch.allclose(w3, torch.tensor([-0.1 / 0.001**0.5]))
    with pytest.raises(ValueError, match="amsgrad=False"):
        cls([w1], bias_correction=False, amsgrad=True)


def test_clone_for_save_drops_the_flat_buffer() -> None:
    flat = torch.arange(8.0)
    cloned = clone_tensors_for_torch_save({"a": [flat[:2]], "b": 3})
    assert cloned["b"] == 3 and cloned["a"][0].untyped_storage().nbytes() == 8
    assert torch.equal(cloned["a"][0], flat[:2])


def test_accelerator_on_cpu() -> None:
    accelerator = get_accelerator()
    if torch.cuda.is_available():
        assert accelerator.device_name(0) == "cuda:0"
    else:
        assert (accelerator.device_name(0), accelerator.communication_backend_name()) == ("cpu", "gloo")


def test_deepspeed_only_arguments_that_change_nothing_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adagrad's amsgrad and CPU Lion's fp32_optimizer_states=False are accepted, with a warning naming
    them (DeepSpeedCPUAdam's fp32_optimizer_states acts: tests/unit/optim/test_fp32_adam_states.py)."""
    from shardwise.compat import ops
    from shardwise.optim import fused_adam

    said: list[str] = []
    monkeypatch.setattr(fused_adam.logger, "warning", lambda fmt, *args: said.append(fmt % args))
    w = [torch.nn.Parameter(torch.ones(2))]
    ops.DeepSpeedCPUAdam(w)
    ops.DeepSpeedCPUAdagrad(w)
    assert said == []
    ops.DeepSpeedCPUAdam(w, fp32_optimizer_states=False)
    ops.DeepSpeedCPUAdagrad(w, amsgrad=True)
    ops.DeepSpeedCPULion(w, fp32_optimizer_states=False)
    assert len(said) == 2
    assert "DeepSpeedCPUAdagrad(amsgrad=True)" in said[0]
    assert "DeepSpeedCPULion(fp32_optimizer_states=False)" in said[1] and "dtype" in said[1]


def test_unused_parameters_error_is_deepspeeds_assertion_error() -> None:
    from shardwise.zero.unused_parameters import unused_parameters_error

    error = unused_parameters_error(["head.bias"])
    assert isinstance(error, AssertionError) and isinstance(error, RuntimeError)
    assert "ignore_unused_parameters" in error.args[0] and "head.bias" in error.args[0]


def test_set_log_level_from_string_sets_logger_and_handlers() -> None:
    import logging

    from shardwise.utils.logging import set_log_level_from_string

    custom = logging.getLogger("shardwise-test-custom-level")
    handler = logging.StreamHandler()
    custom.addHandler(handler)
    try:
        set_log_level_from_string("Error", custom_logger=custom)
        assert custom.level == logging.ERROR and handler.level == logging.ERROR
        with pytest.raises(ValueError, match="must be one of debug"):
            set_log_level_from_string("loud", custom_logger=custom)
    finally:
        custom.removeHandler(handler)
