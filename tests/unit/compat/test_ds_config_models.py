"""DeepSpeed's config classes over shardwise's validation: DeepSpeedConfig, DeepSpeedZeroConfig,
DeepSpeedConfigModel, get_bfloat16_config, DeepSpeedFP16Config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import Field, ValidationError

from shardwise.compat.config_model import DeepSpeedConfigModel
from shardwise.compat.ds_config import (
    DeepSpeedConfig,
    DeepSpeedFP16Config,
    get_bfloat16_config,
    get_float16_config,
)
from shardwise.compat.zero_config import (
    DeepSpeedZeroConfig,
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
)
from shardwise.config.errors import ConfigError


def test_zero_config_reads_legacy_and_short_names() -> None:
    assert isinstance(DeepSpeedZeroConfig(cpu_offload_param=True).offload_param, DeepSpeedZeroOffloadParamConfig)
    assert DeepSpeedZeroConfig(cpu_offload=True).offload_optimizer.device == "cpu"
    assert DeepSpeedZeroConfig(stage3_gather_fp16_weights_on_model_save=True).gather_16bit_weights_on_model_save
    assert DeepSpeedZeroConfig(prefetch_bucket_size=7).stage3_prefetch_bucket_size == 7
    assert DeepSpeedZeroConfig(stage3_max_reuse_distance=9).max_reuse_distance == 9
    assert DeepSpeedZeroConfig(stage=3).overlap_comm and not DeepSpeedZeroConfig(stage=2).overlap_comm
    assert DeepSpeedZeroConfig().offload_param is None
    assert DeepSpeedZeroOffloadOptimizerConfig(pipeline_write=True).pipeline


def test_zero_config_names_elastic_checkpoint_at_stage_3(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.compat import zero_config

    said: list[str] = []
    monkeypatch.setattr(zero_config.logger, "warning", lambda message, *args: said.append(message))
    DeepSpeedZeroConfig(stage=2, elastic_checkpoint=True)
    assert said == []
    DeepSpeedZeroConfig(stage=3, elastic_checkpoint=True)
    assert len(said) == 1 and "elastic checkpointing is deprecated" in said[0]


def test_zero_config_validates_as_shardwise() -> None:
    with pytest.raises(ValidationError, match="stage"):
        DeepSpeedZeroConfig(stage=4)
    with pytest.raises(ValidationError, match="no_such_key"):
        DeepSpeedZeroConfig(no_such_key=1)


class Conf(DeepSpeedConfigModel):
    param_1: int = 0
    param_2_old: str | None = Field(
        None, json_schema_extra={"deprecated": True, "new_param": "param_2", "new_param_fn": lambda x: [x]}
    )
    param_2: list[str] | None = None
    param_3: int = Field(0, alias="param_3_alias")


def test_config_model_deprecated_and_alias_fields() -> None:
    assert Conf(param_2_old="DS").param_2 == ["DS"]
    assert Conf(param_3_alias=10).param_3 == Conf(param_3=10).param_3 == 10
    with pytest.raises(AssertionError, match="param_2_old is deprecated"):
        Conf(param_2=["DS"], param_2_old="DS")
    for bad in ({"param_1": "DS"}, {"param_1_typo": 0}, {"param_1": True}):
        with pytest.raises(ValidationError):
            Conf(**bad)


def test_deepspeed_config_from_path_and_dict(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 64}))
    cfg = DeepSpeedConfig(path)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (64, 64, 1)
    cfg = DeepSpeedConfig({"train_batch_size": 2, "tensorboard": {"enabled": True, "job_name": "j"},
                           "zero_optimization": {"stage": 3}, "optimizer": {"type": "Adam", "params": {}}})
    assert cfg.monitor_config.tensorboard.job_name == "j" and cfg.monitor_config.enabled
    assert cfg.zero_optimization_stage == 3 and cfg.zero_config.overlap_comm and cfg.zero_enabled
    assert cfg.optimizer_name == "adam" and cfg.gradient_allreduce_op == "mean"
    assert cfg.eigenvalue_enabled is False and cfg._param_dict["train_batch_size"] == 2
    with pytest.raises(AttributeError, match="no_such_setting"):
        cfg.no_such_setting  # noqa: B018


def test_deepspeed_config_refuses_what_shardwise_refuses(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 24, "train_batch_size": 24}')
    with pytest.raises(ValueError):
        DeepSpeedConfig(path)
    with pytest.raises(ConfigError, match="gradient_allreduce_op"):
        DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": "max"})


def test_get_bfloat16_config() -> None:
    assert get_bfloat16_config({"bf16": {"enabled": True}}).enabled
    assert get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled
    assert not get_bfloat16_config({}).enabled


@pytest.mark.parametrize("field", ["loss_scale_window", "min_loss_scale"])
def test_fp16_section_checks_dynamic_scaling_fields_when_built(field: str) -> None:
    for bad in (0, -1, True, None, "abc", float("inf"), float("nan")):
        with pytest.raises(ValidationError, match=field):
            DeepSpeedFP16Config(enabled=True, loss_scale=0, **{field: bad})
    assert getattr(DeepSpeedFP16Config(enabled=True, loss_scale=0, **{field: 7}), field) == 7
    # unused (static scale, or fp16 off): kept as written
    assert getattr(DeepSpeedFP16Config(enabled=True, loss_scale=128, **{field: 0}), field) == 0
    assert getattr(DeepSpeedFP16Config(enabled=False, loss_scale=0, **{field: -1}), field) == -1


def test_fp16_section_loss_scale_must_be_a_number() -> None:
    for bad in ([], {}):
        with pytest.raises(ValidationError, match="must be a number"):
            DeepSpeedFP16Config(loss_scale=bad)
    for bad in (-1, float("inf"), float("nan"), True):
        with pytest.raises(ValidationError):
            DeepSpeedFP16Config(loss_scale=bad)
    assert DeepSpeedFP16Config(loss_scale="3").loss_scale == 3.0
    assert get_float16_config({"fp16": {"enabled": True}}).dynamic and not get_float16_config({}).enabled


def test_top_level_readers_and_constants() -> None:
    from shardwise.compat import runtime_constants as constants
    from shardwise.compat.ds_config import get_gradient_clipping, get_log_level

    assert constants.GRADIENT_CLIPPING == "gradient_clipping" and constants.GRADIENT_CLIPPING_DEFAULT == 1.0
    assert constants.LOG_LEVEL == "log_level" and constants.LOG_LEVEL_DEFAULT is None
    assert constants.TRAIN_BATCH_SIZE_DEFAULT is None and constants.PRESCALE_GRADIENTS_DEFAULT is False
    assert not hasattr(constants, "ZERO_OPTIMIZATION_DEFAULT")  # sections are not plain values
    assert get_gradient_clipping({}) == 1.0 and get_gradient_clipping({"gradient_clipping": 0.0}) == 0.0
    assert get_log_level({}) is None and get_log_level({"log_level": "ERROR"}) == "ERROR"
    with pytest.raises(KeyError, match="zero_optimization"):
        constants.get_top_level_setting({}, "zero_optimization")


def test_engine_log_level_accessor() -> None:
    from shardwise.config import load_config
    from shardwise.runtime.ds_accessors import DeepSpeedAccessors

    engine = DeepSpeedAccessors()
    engine._config = load_config({"train_batch_size": 1, "log_level": "Error"}, world_size=1)
    assert engine.log_level() == "ERROR"
    engine._config = load_config({"train_batch_size": 1}, world_size=1)
    assert engine.log_level() is None and engine.gradient_clipping() == 1.0
