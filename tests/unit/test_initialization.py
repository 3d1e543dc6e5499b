"""``initialize`` without a model (DeepSpeed's AssertionError, with shardwise's explanation), and the sequence
parallelism DeepSpeed's ``mesh_param=(data_parallel_size, sequence_parallel_size)`` declares."""

from __future__ import annotations

import pytest
import torch

import shardwise
from shardwise.config.errors import AssertedValueError
from shardwise.startup.process_layout import sequence_degree_of_mesh_param

CONFIG = {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


@pytest.mark.parametrize("caught", [AssertionError, ValueError])
def test_model_none_raises_deepspeeds_type_and_ours(caught: type[Exception]) -> None:
    with pytest.raises(caught, match=r"needs model=\.\.\. \(got None\)"):
        shardwise.initialize(model=None, config=CONFIG)


def test_a_module_passed_positionally_is_named_as_args() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(AssertedValueError) as info:
        shardwise.initialize(model, config=CONFIG)  # the first positional parameter is args
    assert "Linear was passed as the first positional argument" in str(info.value)
    assert "initialize(model=model" in str(info.value)


def test_mesh_param_declares_its_sequence_degree() -> None:
    assert sequence_degree_of_mesh_param((2, 2), 4) == 2
    assert sequence_degree_of_mesh_param([1, 4], 4) == 4
    assert sequence_degree_of_mesh_param((4, 1), 4) is None  # no sequence parallelism


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ((2, 2), "must equal the world size 8"),
        ((2,), "two ints >= 1"),
        ((2, 0), "two ints >= 1"),
        ("2x2", "two ints >= 1"),
    ],
)
def test_mesh_param_errors_name_the_rule(value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sequence_degree_of_mesh_param(value, 8)
