"""The expert_parallel (AutoEP) section: parsing, the checks with their messages, HF defaults,
the preset registry."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from shardwise.autoep.config import (
    AutoEPConfig,
    fill_autoep_config_from_hf,
    parse_autoep_config,
    resolve_route_scale,
    validate_autoep_config,
    validate_autoep_post_detection,
)
from shardwise.autoep.presets import (
    PRESET_MODELS,
    get_preset_adapter,
    preset_name_for_hf_model_type,
    unsupported_preset_for_hf_model_type,
)


def _validate(config: AutoEPConfig, world: int = 4, pp: int = 1) -> None:
    validate_autoep_config(config, world_size=world, pp_size=pp, tp_size=1, sp_size=1)


def test_every_key_is_read_and_defaults_hold() -> None:
    assert parse_autoep_config(None) == AutoEPConfig()
    config = parse_autoep_config({"enabled": True, "autoep_size": 2, "preset_model": "qwen3_moe", "top_k": 1,
                                  "score_apply": "pre", "load_balance_coeff": None, "expert_w3": None})
    assert (config.enabled, config.autoep_size, config.preset_model, config.top_k) == (True, 2, "qwen3_moe", 1)
    assert config.score_apply == "pre" and config.expert_w3 is None
    assert config.load_balance_coeff is None and config._load_balance_coeff_explicit
    assert not parse_autoep_config({"enabled": True})._load_balance_coeff_explicit
    _validate(config)


@pytest.mark.parametrize("value", [0.01, 0, True, "1e-3", [1e-3]])
def test_load_balance_coeff_is_refused_with_the_fix(value: object) -> None:
    with pytest.raises(ValueError, match=r"load_balance_coeff = .*not supported.*set load_balance_coeff to null"):
        parse_autoep_config({"enabled": False, "load_balance_coeff": value})
    with pytest.raises(ValueError, match=r"expert_bias"):
        _validate(AutoEPConfig(load_balance_coeff=value))


@pytest.mark.parametrize(
    ("config", "world", "match"),
    [
        (AutoEPConfig(enabled=True, autoep_size=3), 8, r"autoep_size \* expert_parallel.expert_tensor_parallel_size = 3 \* 1 = 3 must divide the stage size 8.*Valid expert-width values: \[1, 2, 4, 8\]"),
        (AutoEPConfig(enabled=True, autoep_size=0), 8, r"autoep_size = 0: an int >= 1"),
        (AutoEPConfig(enabled=True, expert_tensor_parallel_size=2), 4, r"expert_tensor_parallel_size=2 is reserved.*fix: set expert_tensor_parallel_size=1"),
        (AutoEPConfig(enabled=True, preset_model="llama"), 4, r"preset_model = 'llama'"),
        (AutoEPConfig(enabled=True, score_apply="later"), 4, r"score_apply = 'later'"),
        (AutoEPConfig(enabled=True, comm_backend="deepep"), 4, r"comm_backend = 'deepep'"),
        (AutoEPConfig(enabled=True, expert_w1="a.b"), 4, r"expert_w1 = 'a.b': a direct attribute name"),
        (AutoEPConfig(enabled=True, top_k=True), 4, r"top_k = True"),
        (AutoEPConfig(validate_folding_routing="true"), 4, r"validate_folding_routing = 'true': a boolean"),
    ],
)
def test_bad_values_are_refused_by_name(config: AutoEPConfig, world: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _validate(config, world)


def test_the_stage_not_the_world_bounds_autoep_size() -> None:
    _validate(AutoEPConfig(enabled=True, autoep_size=2), world=8, pp=2)
    with pytest.raises(ValueError, match="stage size 2"):
        _validate(AutoEPConfig(enabled=True, autoep_size=4), world=8, pp=4)


def test_post_detection_checks_each_layer() -> None:
    spec = SimpleNamespace(moe_module_name="m.0", num_experts=8, num_expert_groups=None, num_limited_groups=None)
    validate_autoep_post_detection(AutoEPConfig(enabled=True, autoep_size=4), [spec])
    with pytest.raises(ValueError, match=r"exceeds num_experts.*\[1, 2, 4, 8\]"):
        validate_autoep_post_detection(AutoEPConfig(enabled=True, autoep_size=16), [spec])
    with pytest.raises(ValueError, match="must divide num_experts"):
        validate_autoep_post_detection(AutoEPConfig(enabled=True, autoep_size=3), [spec])
    with pytest.raises(ValueError, match="needs num_expert_groups"):
        validate_autoep_post_detection(AutoEPConfig(enabled=True, num_limited_groups=1), [spec])


def test_hf_defaults_fill_only_what_is_left_out() -> None:
    hf = SimpleNamespace(n_group=4, topk_group=2, routed_scaling_factor=2.5)
    config = AutoEPConfig(enabled=True)
    fill_autoep_config_from_hf(config, hf)
    assert (config.num_expert_groups, config.num_limited_groups, config.route_scale) == (4, 2, 2.5)
    explicit = AutoEPConfig(enabled=True, num_expert_groups=8, num_limited_groups=1, routed_scaling_factor=3.0,
                            route_scale=3.0)
    fill_autoep_config_from_hf(explicit, hf)
    assert (explicit.num_expert_groups, explicit.num_limited_groups, explicit.route_scale) == (8, 1, 3.0)


def test_route_scale_resolution() -> None:
    assert resolve_route_scale(AutoEPConfig(route_scale=1.5), None) == 1.5
    assert resolve_route_scale(AutoEPConfig(), SimpleNamespace(routed_scaling_factor=2.5)) == 2.5
    assert resolve_route_scale(AutoEPConfig(routed_scaling_factor=3), SimpleNamespace(routed_scaling_factor=2)) == 3
    for bad in ("2.5", True, math.nan, math.inf):
        with pytest.raises(ValueError, match="routed_scaling_factor"):
            resolve_route_scale(AutoEPConfig(routed_scaling_factor=bad), None)


def test_preset_registry() -> None:
    assert set(PRESET_MODELS) == {"mixtral", "qwen3_moe", "qwen3_5_moe", "deepseek_v2", "deepseek_v3"}
    assert preset_name_for_hf_model_type("qwen2_moe") == "qwen3_moe"
    assert preset_name_for_hf_model_type("llama") is None
    name, preset = unsupported_preset_for_hf_model_type("qwen3_5_moe")  # type: ignore[misc]
    assert name == "qwen3_5_moe" and "qwen3_5_moe_text" in preset.unsupported_hf_model_type_notes["qwen3_5_moe"]
    assert get_preset_adapter("mixtral") is get_preset_adapter("mixtral")
