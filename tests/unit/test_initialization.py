"""``initialize`` without a model: DeepSpeed's AssertionError, with shardwise's explanation."""

from __future__ import annotations

import pytest
import torch

import shardwise
from shardwise.config.errors import AssertedValueError

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
