"""Each compression_training technique: nothing before schedule_offset, the documented effect after."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardwise.compression.compress import compression_scheduler, init_compression, redundancy_clean
from shardwise.compression.weight_quant import bits_at
from shardwise.config.errors import ConfigError


def _cfg(technique: str, shared: dict, groups: dict) -> dict:
    return {
        "compression_training": {
            technique: {"shared_parameters": {"enabled": True, **shared}, "different_groups": groups}
        }
    }


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _step(model: nn.Module, n: int) -> None:
    scheduler = compression_scheduler(model)
    assert scheduler is not None
    scheduler.step(n)


def test_weight_quantization_waits_for_its_offset_then_keeps_at_most_two_to_the_bits_values_per_group():
    model = _mlp()
    x = torch.randn(5, 8)
    ref = model(x)
    cfg = _cfg(
        "weight_quantization",
        {"schedule_offset": 3, "quantize_groups": 4},
        {
            "wq": {
                "params": {"start_bits": 8, "target_bits": 4, "quantization_period": 2},
                "modules": ["0", "2"],
            }
        },
    )
    init_compression(model, cfg)
    assert torch.equal(model(x), ref)  # step 0 < schedule_offset
    _step(model, 2)
    assert torch.equal(model(x), ref)
    for step, bits in ((3, 8), (5, 7), (7, 6), (11, 5), (19, 4), (100, 4)):
        _step(model, step)
        tech = model[0].compression["weight_quantization"]
        assert tech.bits == bits == bits_at(step - 3, 8, 4, 2)[0]
        weight, _ = model[0].compressed_weight()
        for group in weight.detach().reshape(4, -1):
            assert len(group.unique()) <= 2**bits
    assert not torch.equal(model(x), ref)


def test_quantize_weight_in_forward_uses_the_target_bits_and_embeddings_are_quantized_per_row():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 12), nn.Linear(12, 4))
    cfg = _cfg(
        "weight_quantization",
        {"schedule_offset": 1, "quantize_weight_in_forward": True},
        {"wq": {"params": {"start_bits": 8, "target_bits": 3, "quantization_period": 50}, "modules": ["*"]}},
    )
    init_compression(model, cfg)
    _step(model, 1)
    for module in model:
        assert module.compression["weight_quantization"].bits == 3
    table, _ = model[0].compressed_weight()
    assert all(len(row.unique()) <= 8 for row in table)  # one scale per token
    assert len(table.unique()) > 8


@pytest.mark.parametrize("qtype", ["symmetric", "asymmetric"])
def test_quantization_gradients_pass_straight_through(qtype):
    model = _mlp()
    cfg = _cfg(
        "weight_quantization",
        {"schedule_offset": 0, "quantization_type": qtype},
        {"wq": {"params": {"start_bits": 4, "target_bits": 4}, "modules": ["0"]}},
    )
    init_compression(model, cfg)
    model(torch.randn(3, 8)).sum().backward()
    assert model[0].weight.grad is not None and model[0].weight.grad.abs().sum() > 0


def test_fp16_mixed_quantize_blends_towards_the_quantized_weight():
    model = _mlp()
    cfg = _cfg(
        "weight_quantization",
        {"schedule_offset": 0, "fp16_mixed_quantize": {"enabled": True, "quantize_change_ratio": 0.25}},
        {"wq": {"params": {"start_bits": 3, "target_bits": 3}, "modules": ["0"]}},
    )
    init_compression(model, cfg)
    tech = model[0].compression["weight_quantization"]
    _step(model, 2)
    assert tech.real_ratio == pytest.approx(0.5)
    _step(model, 10)
    assert tech.real_ratio == 0.0
    weight, _ = model[0].compressed_weight()
    assert len(weight.unique()) <= 8


@pytest.mark.parametrize("calibration", ["dynamic", "static"])
def test_activation_quantization_quantizes_the_input(calibration):
    model = _mlp()
    cfg = _cfg(
        "activation_quantization",
        {"schedule_offset": 2, "range_calibration": calibration},
        {"aq": {"params": {"bits": 4}, "modules": ["^0$"]}},
    )
    x = torch.randn(6, 8)
    ref = model(x)
    init_compression(model, cfg)
    assert torch.equal(model(x), ref)
    _step(model, 2)
    seen = {}
    model[0].register_forward_hook(lambda m, inp, out: seen.update(x=inp[0]))
    model[0].compressed_input(x).detach()
    quantized = model[0].compressed_input(x).detach()
    rows = quantized if calibration == "dynamic" else quantized.reshape(1, -1)
    assert all(len(r.unique()) <= 16 for r in rows)
    assert not torch.equal(model(x), ref)


@pytest.mark.parametrize("method", ["l1", "topk"])
def test_sparse_pruning_keeps_exactly_the_dense_ratio_of_the_largest(method):
    model = _mlp()
    ref_weight = model[0].weight.detach().clone()
    cfg = _cfg(
        "sparse_pruning",
        {"schedule_offset": 1, "method": method},
        {"sp": {"params": {"dense_ratio": 0.25}, "modules": ["0"]}},
    )
    init_compression(model, cfg)
    weight, _ = model[0].compressed_weight()
    assert torch.equal(weight, ref_weight)
    _step(model, 1)
    weight, _ = model[0].compressed_weight()
    kept = weight != 0
    assert int(kept.sum()) == 32  # 25 % of 128
    assert ref_weight.abs()[kept].min() >= ref_weight.abs()[~kept].max()


def test_snip_momentum_prunes_blocks_down_to_the_dense_ratio_by_the_end_step():
    model = _mlp()
    cfg = _cfg(
        "sparse_pruning",
        {
            "schedule_offset": 1,
            "schedule_offset_end": 4,
            "schedule_offset_stride": 1,
            "method": "snip_momentum",
            "block_pattern": "4x1",
            "dense_ratio": 0.5,
            "excluded_modules": ["^2$"],
        },
        {},
    )
    init_compression(model, cfg)
    assert "sparse_pruning" not in getattr(model[2], "compression", {})
    x = torch.randn(16, 8)
    for step in range(1, 6):
        model(x).pow(2).sum().backward()
        _step(model, step)
    mask = model[0].sparse_pruning_mask
    assert mask.mean().item() == pytest.approx(0.5)
    assert torch.equal(mask.reshape(4, 4, 8).amin(1), mask.reshape(4, 4, 8).amax(1))  # whole 4x1 blocks


@pytest.mark.parametrize("method", ["l1", "topk"])
def test_row_pruning_removes_the_lowest_rows_and_clean_preserves_outputs(method):
    model = _mlp()
    cfg = _cfg(
        "row_pruning",
        {"schedule_offset": 2, "method": method},
        {"rp": {"params": {"dense_ratio": 0.5}, "modules": ["^0$"], "related_modules": [["^2$"]]}},
    )
    norms = model[0].weight.detach().abs().sum(1)
    init_compression(model, cfg)
    _step(model, 1)
    assert int((model[0].compressed_weight()[0].abs().sum(1) == 0).sum()) == 0
    _step(model, 2)
    weight, bias = model[0].compressed_weight()
    kept = weight.abs().sum(1) != 0
    assert int(kept.sum()) == 8 and torch.all(bias[~kept] == 0)
    assert norms[kept].min() >= norms[~kept].max()
    x = torch.randn(7, 8)
    masked = model(x).detach()
    redundancy_clean(model, cfg)
    assert type(model[0]) is nn.Linear and model[0].weight.shape == (8, 8) and model[2].weight.shape == (4, 8)
    torch.testing.assert_close(model(x), masked)


class _Attention(nn.Module):
    def __init__(self, width: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.query, self.key, self.value = (
            nn.Linear(width, width),
            nn.Linear(width, width),
            nn.Linear(width, width),
        )
        self.output = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        heads = self.query.out_features // self.head_dim  # derived from the shapes: survives cleaning
        q, k, v = (
            p(x).view(b, t, heads, self.head_dim).transpose(1, 2) for p in (self.query, self.key, self.value)
        )
        y = torch.softmax(q @ k.transpose(-1, -2) / self.head_dim**0.5, -1) @ v
        return self.output(y.transpose(1, 2).reshape(b, t, -1))


def test_head_pruning_cuts_the_lowest_scoring_heads_and_their_qkv_rows():
    torch.manual_seed(0)
    model = nn.Sequential(_Attention())
    cfg = _cfg(
        "head_pruning",
        {"schedule_offset": 0, "num_heads": 4},
        {
            "hp": {
                "params": {"dense_ratio": 0.5},
                "modules": ["output"],
                "related_modules": [["query", "key", "value"]],
            }
        },
    )
    init_compression(model, cfg)
    with torch.no_grad():
        model[0].output.head_pruning_scores.copy_(torch.tensor([3.0, 0.0, 2.0, 1.0]))
    x = torch.randn(2, 5, 16)
    masked = model(x).detach()
    redundancy_clean(model, cfg)
    attn = model[0]
    assert (
        attn.output.weight.shape == (16, 8)
        and attn.query.weight.shape == (8, 16)
        and attn.value.bias.shape == (8,)
    )
    torch.testing.assert_close(model(x), masked)


def test_channel_pruning_cuts_channels_and_the_related_conv_and_batch_norm():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    cfg = _cfg(
        "channel_pruning",
        {"schedule_offset": 0, "method": "l1"},
        {"cp": {"params": {"dense_ratio": 0.5}, "modules": ["^0$"], "related_modules": [["^2$"]]}},
    )
    init_compression(model, cfg)
    x = torch.randn(2, 3, 9, 9)
    masked = model(x).detach()
    redundancy_clean(model, cfg)
    assert model[0].weight.shape == (4, 3, 3, 3) and model[2].weight.shape == (4, 4, 3, 3)
    torch.testing.assert_close(model(x), masked)
    bn_model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    cfg_bn = _cfg(
        "channel_pruning",
        {"schedule_offset": 0},
        {"cp": {"params": {"dense_ratio": 0.25}, "modules": ["^0$"], "related_modules": [["^1$"]]}},
    )
    redundancy_clean(init_compression(bn_model, cfg_bn), cfg_bn)
    assert bn_model[1].num_features == 2 and bn_model[1].running_mean.shape == (2,)


def test_layer_reduction_copies_the_listed_teacher_layers():
    torch.manual_seed(0)
    teacher = nn.Sequential()
    teacher.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
    teacher.head = nn.Linear(4, 2)
    student = nn.Sequential()
    student.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    student.head = nn.Linear(4, 2)
    cfg = {
        "compression_training": {
            "layer_reduction": {
                "enabled": True,
                "keep_number_layer": 2,
                "module_name_prefix": "layers",
                "teacher_layer": [1, 3],
                "other_module_name": ["head"],
            }
        }
    }
    init_compression(student, cfg, teacher_model=teacher)
    assert torch.equal(student.layers[0].weight, teacher.layers[1].weight)
    assert torch.equal(student.layers[1].bias, teacher.layers[3].bias)
    assert torch.equal(student.head.weight, teacher.head.weight)
    alone = copy.deepcopy(teacher)
    init_compression(alone, cfg)  # no teacher: the model keeps its own listed layers
    assert len(alone.layers) == 2 and torch.equal(alone.layers[1].weight, teacher.layers[3].weight)


def test_init_compression_is_idempotent_and_config_mistakes_name_the_key():
    model = _mlp()
    cfg = _cfg(
        "row_pruning", {"schedule_offset": 0}, {"rp": {"params": {"dense_ratio": 0.5}, "modules": ["^0$"]}}
    )
    init_compression(model, cfg)
    tech = model[0].compression["row_pruning"]
    init_compression(model, cfg)
    assert model[0].compression["row_pruning"] is tech
    with pytest.raises(
        ConfigError, match=r"compression_training\.row_pruning\.different_groups\.rp\.modules"
    ):
        init_compression(
            _mlp(), _cfg("row_pruning", {}, {"rp": {"params": {"dense_ratio": 0.5}, "modules": ["nothing"]}})
        )
    with pytest.raises(ConfigError, match=r"shared_parameters\.shedule_offset"):
        init_compression(
            _mlp(), _cfg("row_pruning", {"shedule_offset": 1}, {"rp": {"params": {"dense_ratio": 0.5}}})
        )
    with pytest.raises(ConfigError, match="target_bits"):
        init_compression(
            _mlp(), _cfg("weight_quantization", {}, {"w": {"params": {"start_bits": 4, "target_bits": 8}}})
        )


def test_the_schedule_state_round_trips():
    model = _mlp()
    cfg = _cfg(
        "sparse_pruning", {"schedule_offset": 2}, {"sp": {"params": {"dense_ratio": 0.5}, "modules": ["0"]}}
    )
    init_compression(model, cfg)
    _step(model, 3)
    state = compression_scheduler(model).state_dict()
    mask = model[0].sparse_pruning_mask.clone()
    other = _mlp()
    init_compression(other, cfg)
    with torch.no_grad():
        other[0].weight.mul_(-3.0).add_(1.0)  # a different model: an l1 mask recomputed would differ
        other[0].sparse_pruning_mask.copy_(mask)  # what the checkpoint's buffers restore
    compression_scheduler(other).load_state_dict(state)
    assert compression_scheduler(other).training_steps == 3
    assert torch.equal(other[0].sparse_pruning_mask, mask) and other[0].compression["sparse_pruning"].active
