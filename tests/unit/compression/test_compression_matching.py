"""Module-name matching on a model with Hugging Face BERT's names, with a config from
DeepSpeedExamples (ZeroQuant W4/8A8, reduced): re.search semantics, one technique per module."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.compression.compress import init_compression
from shardwise.compression.matching import name_matches
from shardwise.config.errors import ConfigError


def _bert(layers: int = 2, width: int = 48) -> nn.Module:
    def layer() -> nn.Module:
        attention = nn.Module()
        attention.self = nn.Module()
        attention.self.query, attention.self.key, attention.self.value = (
            nn.Linear(width, width) for _ in range(3)
        )
        attention.output = nn.Module()
        attention.output.dense = nn.Linear(width, width)
        block = nn.Module()
        block.attention = attention
        block.intermediate = nn.Module()
        block.intermediate.dense = nn.Linear(width, 4 * width)
        block.output = nn.Module()
        block.output.dense = nn.Linear(4 * width, width)
        return block

    model = nn.Module()
    model.bert = nn.Module()
    model.bert.embeddings = nn.Module()
    model.bert.embeddings.word_embeddings = nn.Embedding(30, width)
    model.bert.encoder = nn.Module()
    model.bert.encoder.layer = nn.ModuleList(layer() for _ in range(layers))
    return model


ZEROQUANT = {
    "compression_training": {
        "weight_quantization": {
            "shared_parameters": {
                "enabled": True,
                "schedule_offset": 0,
                "quantize_groups": 48,
                "quantize_weight_in_forward": True,
            },
            "different_groups": {
                "wq1": {
                    "params": {"start_bits": 8, "target_bits": 8, "quantization_period": 0},
                    "modules": ["attention.self", "attention.output.dense"],
                },
                "wq2": {
                    "params": {"start_bits": 4, "target_bits": 4, "quantization_period": 0},
                    "modules": ["intermediate", "layer.\\w+.output.dense"],
                },
            },
        },
        "activation_quantization": {
            "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": "dynamic"},
            "different_groups": {
                "aq1": {"params": {"bits": 8}, "modules": ["attention.self", "attention.output.dense"]}
            },
        },
    }
}


def test_patterns_are_searched_as_regular_expressions():
    assert name_matches("attention.self", "bert.encoder.layer.0.attention.self.query")
    assert name_matches(r"layer.\w+.output.dense", "bert.encoder.layer.11.output.dense")
    assert not name_matches(r"layer.\w+.output.dense", "bert.encoder.layer.0.attention.output.dense")
    assert name_matches("*", "anything")


def test_a_zeroquant_config_reaches_the_modules_deepspeed_would():
    model = _bert()
    init_compression(model, ZEROQUANT)
    bits = {
        name: module.compression["weight_quantization"].bits
        for name, module in model.named_modules()
        if "weight_quantization" in getattr(module, "compression", {})
    }
    assert bits == {
        **{
            f"bert.encoder.layer.{i}.attention.self.{p}": 8
            for i in range(2)
            for p in ("query", "key", "value")
        },
        **{f"bert.encoder.layer.{i}.attention.output.dense": 8 for i in range(2)},
        **{f"bert.encoder.layer.{i}.intermediate.dense": 4 for i in range(2)},
        **{f"bert.encoder.layer.{i}.output.dense": 4 for i in range(2)},
    }
    quantized_inputs = [
        n for n, m in model.named_modules() if "activation_quantization" in getattr(m, "compression", {})
    ]
    assert len(quantized_inputs) == 8
    dense = model.bert.encoder.layer[0].output.dense
    weight, _ = dense.compressed_weight()
    assert all(len(group.unique()) <= 16 for group in weight.detach().reshape(48, -1))
    x = torch.randn(3, 4 * 48)
    assert dense(x).shape == (3, 48)


def test_a_pattern_that_matches_nothing_is_named():
    cfg = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True},
                "different_groups": {
                    "wq1": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["attention", " mlp"]}
                },
            }
        }
    }
    with pytest.raises(ConfigError, match="' mlp' matches no"):
        init_compression(_bert(), cfg)
