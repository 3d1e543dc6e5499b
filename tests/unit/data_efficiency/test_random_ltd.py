"""Random-LTD layers: the scheduled number of tokens per layer, order kept, full length = the plain
model, masks gathered; the conversion and the hook's config checks."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from shardwise.config import load_config
from shardwise.config.errors import ConfigError
from shardwise.data_efficiency.random_ltd import (
    RandomLTDLayer,
    convert_to_random_ltd,
    gather_mask,
    random_ltd_layers,
)
from shardwise.data_efficiency.random_ltd_hook import build_random_ltd_hook
from shardwise.runtime.step_hooks import ForwardContext
from shardwise.testing.models import Block, GPTConfig, TinyGPT


class Recorder(nn.Module):
    """Records its input and adds 1000 to it."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[torch.Tensor] = []
        self.masks: list[Any] = []

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        self.inputs.append(x.detach().clone())
        self.masks.append(mask)
        return x + 1000


@pytest.mark.parametrize("order", ["batch_seq_dim", "seq_batch_dim"])
def test_the_layer_sees_exactly_kept_tokens_in_order_and_the_rest_pass_through(order: str) -> None:
    torch.manual_seed(0)
    inner = Recorder()
    layer = RandomLTDLayer(inner, hidden_state_order=order)
    layer.kept_tokens = 5
    positions = torch.arange(12.0).view(1, 12, 1).expand(3, 12, 2).contiguous()  # value = position
    hidden = positions if order == "batch_seq_dim" else positions.transpose(0, 1).contiguous()
    out = layer(hidden)
    seen = inner.inputs[0] if order == "batch_seq_dim" else inner.inputs[0].transpose(0, 1)
    assert seen.shape == (3, 5, 2)
    kept = seen[..., 0]
    assert bool((kept[:, 1:] > kept[:, :-1]).all())  # original order
    result = out if order == "batch_seq_dim" else out.transpose(0, 1)
    changed = result[..., 0] >= 1000
    assert changed.sum(dim=1).tolist() == [5, 5, 5]  # exactly the kept tokens went through the layer
    assert torch.equal(result[..., 0][~changed], positions[..., 0][~changed])  # dropped ones unchanged


def test_full_length_and_eval_run_the_plain_layer() -> None:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=32, block_size=8, n_layer=3, n_head=2, n_embd=16))
    plain = copy.deepcopy(model)
    convert_to_random_ltd(model, Block, [0, 2])
    idx = torch.randint(0, 32, (2, 8))
    for layer in random_ltd_layers(model):
        layer.kept_tokens = 8
    assert torch.equal(model(idx, idx), plain(idx, idx))
    for layer in random_ltd_layers(model):
        layer.kept_tokens = 3
    model.eval()
    plain.eval()
    assert torch.equal(model(idx, idx), plain(idx, idx))
    model.train()
    assert not torch.equal(model(idx, idx), plain(idx, idx))


def test_decoder_mask_is_gathered_on_rows_and_columns_encoder_on_columns() -> None:
    mask = torch.arange(16.0).view(1, 1, 4, 4)
    idx = torch.tensor([[1, 3]])
    assert gather_mask(mask, idx, "decoder").tolist() == [[[[5.0, 7.0], [13.0, 15.0]]]]
    key_mask = torch.arange(4.0).view(1, 1, 1, 4)
    assert gather_mask(key_mask, idx, "encoder").tolist() == [[[[1.0, 3.0]]]]
    inner = Recorder()
    layer = RandomLTDLayer(inner, mask_name="mask")
    layer.kept_tokens = 2
    layer(torch.zeros(1, 4, 1), mask=mask)
    assert inner.masks[0].shape == (1, 1, 2, 2)


def test_convert_rejects_bad_ids() -> None:
    model = TinyGPT(GPTConfig(n_layer=2, n_embd=16, n_head=2))
    with pytest.raises(ValueError, match=r"in \[0, 2\)"):
        convert_to_random_ltd(model, Block, [2])


def _ltd_config(**section: Any) -> Any:
    ltd = {
        "enabled": True,
        "total_layer_num": 3,
        "random_ltd_layer_num": 2,
        "random_ltd_layer_id": [0, 2],
        "model_type": "decoder",
        "hidden_state_order": "batch_seq_dim",
        "random_ltd_schedule": {
            "min_value": 2,
            "max_value": 8,
            "schedule_type": "fixed_linear",
            "schedule_config": {"require_steps": 6, "seq_per_step": 2},
        },
    }
    ltd.update(section)
    cfg = {
        "train_batch_size": 4,
        "data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": ltd}},
    }
    return load_config(cfg).config


def _hook(cfg: Any, model: Any) -> Any:
    return build_random_ltd_hook(cfg.data_efficiency, model, global_batch_size=cfg.train_batch_size)


def _converted(ids: list[int]) -> TinyGPT:
    return convert_to_random_ltd(TinyGPT(GPTConfig(n_layer=3, n_embd=16, n_head=2)), Block, ids)


def test_the_hook_sets_the_scheduled_count_on_training_forwards() -> None:
    model = _converted([0, 2])
    cfg = _ltd_config()
    hook = build_random_ltd_hook(cfg.data_efficiency, model, global_batch_size=cfg.train_batch_size)
    assert hook is not None
    counts = []
    for step in range(8):
        hook.adjust_forward((), {}, ForwardContext(step, True))
        counts.append([layer.kept_tokens for layer in random_ltd_layers(model)])
    # floor(step/6 * 6 + 2) rounded down to even, capped at 8
    assert counts == [[2, 2], [2, 2], [4, 4], [4, 4], [6, 6], [6, 6], [8, 8], [8, 8]]
    assert hook.state_dict()["consumed_layer_tokens"] == 4 * sum(2 * c[0] + 8 for c in counts)


@pytest.mark.parametrize(
    ("section", "ids", "key"),
    [
        ({"random_ltd_layer_num": 3}, [0, 2], "random_ltd_layer_num"),
        ({"random_ltd_layer_id": [0, 3]}, [0, 2], "random_ltd_layer_id"),
        ({"random_ltd_layer_id": [1, 1]}, [0, 2], "random_ltd_layer_id"),
        ({}, [0], "random_ltd_layer_id"),  # the model has one wrapper, the config lists two
        ({"model_type": "seq2seq"}, [0, 2], "model_type"),
        ({"layer_token_lr_schedule": {"enabled": True}}, [0, 2], "layer_token_lr_schedule.enabled"),
    ],
)
def test_inconsistent_sections_name_the_key(section: dict, ids: list[int], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        cfg = _ltd_config(**section)
        build_random_ltd_hook(cfg.data_efficiency, _converted(ids), global_batch_size=cfg.train_batch_size)
    assert info.value.key == f"data_efficiency.data_routing.random_ltd.{key}" and info.value.fix


def _hooked(ids: list[int] | None, config_ids: list[int]) -> tuple[TinyGPT, Any]:
    model = convert_to_random_ltd(TinyGPT(GPTConfig(n_layer=3, n_embd=16, n_head=2)), Block, ids)
    section = {"random_ltd_layer_id": config_ids, "random_ltd_layer_num": len(config_ids)}
    return model, _hook(_ltd_config(**section), model)


def test_random_ltd_layer_id_picks_the_layers_that_drop_tokens_when_every_layer_is_wrapped() -> None:
    """DeepSpeed's form: convert_to_random_ltd(model, LayerClass) wraps every layer and the config's
    random_ltd_layer_id decides which drop tokens; the others run on every token."""
    model, hook = _hooked(None, [1])
    assert [layer.layer_id for layer in random_ltd_layers(model)] == [0, 1, 2]
    assert [layer.layer_id for layer in hook.layers] == [1]
    hook.adjust_forward((), {}, ForwardContext(0, True))
    assert [layer.kept_tokens for layer in random_ltd_layers(model)] == [None, 2, None]
    hook.load_state_dict(hook.state_dict())
    assert [layer.kept_tokens for layer in random_ltd_layers(model)] == [None, 2, None]


def test_only_the_listed_layer_changes_its_output() -> None:
    torch.manual_seed(0)
    model, hook = _hooked(None, [2])
    hook.adjust_forward((), {}, ForwardContext(0, True))
    seen: dict[int, torch.Tensor] = {}
    for layer in random_ltd_layers(model):
        layer.random_ltd_layer.register_forward_hook(
            lambda module, args, out, i=layer.layer_id: seen.__setitem__(i, args[0])
        )
    idx = torch.randint(0, 64, (2, 8))
    model(idx, idx)
    assert seen[0].shape[1] == seen[1].shape[1] == 8  # every token
    assert seen[2].shape[1] == 2  # the scheduled kept count


@pytest.mark.parametrize(
    ("ids", "config_ids", "rule"),
    [
        (
            [0, 2],
            [1, 2],
            "layers [1] are listed but not wrapped (the model's RandomLTDLayer wrappers are layers [0, 2])",
        ),
        ([0, 2], [2], "convert_to_random_ltd was given layer_ids [0, 2], but the config does not list [0]"),
    ],
)
def test_a_config_listing_other_layers_than_the_wrapped_ones_is_refused(
    ids: list[int], config_ids: list[int], rule: str
) -> None:
    with pytest.raises(ConfigError) as info:
        _hooked(ids, config_ids)
    assert info.value.key == "data_efficiency.data_routing.random_ltd.random_ltd_layer_id"
    assert info.value.rule == rule and info.value.value == config_ids and "layer_ids" in info.value.fix


def test_wrappers_without_a_layer_id_or_no_wrapper_at_all_are_refused() -> None:
    model = TinyGPT(GPTConfig(n_layer=3, n_embd=16, n_head=2))
    with pytest.raises(ConfigError, match="no RandomLTDLayer wrapper") as info:
        _hook(_ltd_config(), model)
    assert "convert_to_random_ltd" in info.value.fix
    model.blocks[0] = RandomLTDLayer(model.blocks[0])
    model.blocks[2] = RandomLTDLayer(model.blocks[2])
    with pytest.raises(ConfigError, match="carry no layer_id"):
        _hook(_ltd_config(), model)
    model.blocks[0].layer_id, model.blocks[2].layer_id = 0, 2
    assert _hook(_ltd_config(), model) is not None
