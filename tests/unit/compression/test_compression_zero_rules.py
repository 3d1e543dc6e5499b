"""initialize's compression checks: pruning refused at ZeRO stage 3 naming the key; learnable
scores that the given parameters/optimizer would miss are reported."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.compression.zero_rules import prepare_for_engine
from shardwise.config import load_config
from shardwise.config.errors import ConfigError

ROWS = {
    "row_pruning": {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "topk"},
        "different_groups": {"rp": {"params": {"dense_ratio": 0.5}, "modules": ["^0$"]}},
    }
}


def _loaded(stage: int):
    return load_config(
        {"train_batch_size": 2, "zero_optimization": {"stage": stage}, "compression_training": ROWS}
    )


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def test_pruning_at_stage_3_is_refused_with_the_key():
    with pytest.raises(ConfigError, match=r"compression_training\.row_pruning\.shared_parameters\.enabled"):
        prepare_for_engine(_model(), _loaded(3), None)


def test_scores_missing_from_a_parameter_list_or_a_client_optimizer_are_reported():
    model = _model()
    with pytest.raises(ConfigError, match="learnable scores"):
        prepare_for_engine(model, _loaded(1), None, list(model.parameters()))
    model = _model()
    with pytest.raises(ConfigError, match="learnable scores"):
        prepare_for_engine(model, _loaded(2), torch.optim.SGD(model.parameters(), lr=0.1))


def test_an_iterator_of_parameters_is_not_consumed_and_sees_the_scores():
    model = _model()
    params = model.parameters()
    prepare_for_engine(model, _loaded(2), None, params)
    names = [n for n, _ in model.named_parameters()]
    assert "0.row_pruning_scores" in names
    assert len(list(params)) == len(names)  # the generator runs after init_compression
