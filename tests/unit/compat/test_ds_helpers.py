"""The DeepSpeed-shaped helpers clients import: ops optimizer classes, clone_tensors_for_torch_save, the accelerator."""

from __future__ import annotations

import pytest
import torch

from shardwise.compat.accelerator import get_accelerator
from shardwise.compat.ds_utils import clone_tensors_for_torch_save
from shardwise.compat.ops import DeepSpeedCPUAdam, FusedAdam


def test_cpu_adam_is_adamw_by_default() -> None:
    w1 = torch.nn.Parameter(torch.ones(3))
    w2 = torch.nn.Parameter(torch.ones(3))
    ours = DeepSpeedCPUAdam([w1], lr=0.1, weight_decay=0.1)
    torch_adamw = torch.optim.AdamW([w2], lr=0.1, weight_decay=0.1)
    for w, opt in ((w1, ours), (w2, torch_adamw)):
        w.grad = torch.tensor([1.0, -2.0, 0.5])
        opt.step()
    assert torch.equal(w1, w2)
    with pytest.raises(ValueError, match="bias_correction=False"):
        FusedAdam([w1], bias_correction=False)


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
