"""deepspeed.runtime.utils' script helpers (shardwise.runtime.script_helpers); numbers recorded from
DeepSpeed 0.19.8 on the same inputs."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import numpy
import torch

from shardwise.runtime import script_helpers as sh


def test_set_random_seed_seeds_the_generators_as_deepspeed_does() -> None:
    sh.set_random_seed(123)
    assert (random.random(), float(numpy.random.rand()), torch.rand(1).item()) == (
        0.052363598850944326, 0.6964691855978616, 0.29611194133758545)
    sh.set_random_seed(2**70 + 5)  # reduced modulo each generator's range
    assert (random.random(), float(numpy.random.rand()), torch.rand(1).item()) == (
        0.46679953776226335, 0.22199317108973948, 0.8302518725395203)


def test_parameter_filters() -> None:
    empty, full = torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.zeros(2))
    groups = sh.filter_empty_parameters([{"params": [empty], "lr": 1}, {"params": [empty, full], "lr": 2}])
    assert groups == [{"lr": 2, "params": [full]}]
    assert sh.filter_empty_parameters([empty, full]) == [full] and sh.filter_empty_parameters([]) == []
    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    assert [sh.is_optimized_parameter(p) for p in (full, empty, frozen)] == [True, False, False]
    assert sh.DummyOptim([full]).param_groups == [{"params": [full]}]


def test_structures_and_devices(tmp_path: Path) -> None:
    assert sh.compare_tensors_in_structures([torch.ones(2), 1], [torch.ones(2), 1])
    assert not sh.compare_tensors_in_structures({"a": torch.ones(2)}, {"a": torch.zeros(2)})
    assert not sh.compare_tensors_in_structures([1], (1,)) and not sh.compare_tensors_in_structures({"a": 1}, {"b": 1})
    copied = sh.copy_to_device({"a": [torch.ones(1)], "b": (2,)}, "meta", torch.is_tensor)
    assert copied["a"][0].device.type == "meta" and copied["b"] == (2,)
    target = tmp_path / "x" / "y" / "file.pt"
    sh.ensure_directory_exists(str(target))
    assert target.parent.is_dir()
    loss = (torch.ones(1, requires_grad=True) * 2).sum()
    assert sh.maybe_loss_for_backward(loss) and not sh.maybe_loss_for_backward(torch.ones(1))
    assert sh.noop_decorator(len) is len


def test_adam_moments_offload_and_reload() -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    # the state a torch Adam holds after one step (built by hand: a first Adam costs a second of imports)
    state = {"step": torch.tensor(1.0), "exp_avg": torch.tensor([0.1, -0.2, 0.3]),
             "exp_avg_sq": torch.tensor([1e-3, 4e-3, 9e-3])}
    optimizer = SimpleNamespace(state={weight: state})
    moments = {k: state[k].clone() for k in ("exp_avg", "exp_avg_sq")}
    sh.offload_adam_states(optimizer, "cpu")  # type: ignore[arg-type]
    for key, value in moments.items():
        assert state[key].data_ptr() == state[f"{key}_offload_buffer"].data_ptr()
        assert torch.equal(state[key], value)
    state["exp_avg"].data = torch.zeros(3)  # as if it had been released on the device
    sh.reload_adam_states(optimizer, "cpu")  # type: ignore[arg-type]
    assert all(torch.equal(state[k], v) for k, v in moments.items())
