"""Smaller config mistakes that used to pass or crash: unreadable files, absurd batch sizes,
booleans as numbers, old and new offload spellings together, and fp16 scaler settings that are
checked only where they are used (dynamic loss scaling)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shardwise.cli.main import main
from shardwise.config import ConfigError, load_config
from shardwise.config.batch import MAX_BATCH_SIZE
from shardwise.utils.logging import get_logger

BASE: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2}


@pytest.fixture(autouse=True)
def _keep_log_level() -> Iterator[None]:
    level = get_logger().level
    yield
    get_logger().setLevel(level)


def _error(config: dict[str, Any], world_size: int = 1) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(config, world_size=world_size)
    return info.value


# ------------------------------------------------------------------ files


def test_non_utf8_file_names_the_file_in_check_and_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "latin1.json"
    path.write_bytes(b'{\n  "train_batch_size": 8,\n  "name": "caf\xe9"\n}')
    assert main(["config", "check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"FAIL {path}") and "Traceback" not in err
    assert (
        "is not UTF-8 text: byte 0xe9" in err and "(line 3)" in err and "fix: save the file as UTF-8" in err
    )
    error = _error_from(str(path))
    assert str(path) in error.rule and error.fix


def test_unreadable_file_names_the_file_and_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(BASE), encoding="utf-8")

    def denied(self: Path) -> bytes:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)  # root ignores chmod, so the refusal is simulated
    assert main(["config", "check", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"config file '{path}' cannot be read: Permission denied" in err
    assert "fix:" in err
    assert "Permission denied" in _error_from(str(path)).rule


def _error_from(path: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return info.value


# ------------------------------------------------------------------ batch sizes


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"train_micro_batch_size_per_gpu": 10**30}, "train_micro_batch_size_per_gpu"),
        ({"train_batch_size": 1e30}, "train_batch_size"),
        (
            {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2**40},
            "gradient_accumulation_steps",
        ),
        ({"train_micro_batch_size_per_gpu": 2**30, "gradient_accumulation_steps": 4}, "train_batch_size"),
    ],
)
def test_absurd_batch_sizes_are_rejected(config: dict[str, Any], key: str) -> None:
    error = _error(config, world_size=2)
    assert error.key == key and str(MAX_BATCH_SIZE) in error.rule and error.fix


def test_the_largest_batch_is_accepted() -> None:
    assert load_config({"train_batch_size": MAX_BATCH_SIZE}).batch.train_batch_size == MAX_BATCH_SIZE


# ------------------------------------------------------------------ booleans are not numbers


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"fp16": {"enabled": True, "min_loss_scale": True}}, "fp16.min_loss_scale"),
        ({"fp16": {"enabled": True, "hysteresis": True}}, "fp16.hysteresis"),
        ({"fp16": {"loss_scale_window": False}}, "fp16.loss_scale_window"),
        ({"fp16": {"initial_scale_power": True}}, "fp16.initial_scale_power"),
        ({"zero_optimization": {"reduce_bucket_size": True}}, "zero_optimization.reduce_bucket_size"),
        ({"zero_optimization": {"stage": True}}, "zero_optimization.stage"),
        ({"gradient_clipping": True}, "gradient_clipping"),
    ],
)
def test_a_boolean_is_not_a_number(config: dict[str, Any], key: str) -> None:
    error = _error({**BASE, **config})
    assert error.key == key and "not a boolean" in error.rule and error.fix


# ------------------------------------------------------------------ offload spellings


@pytest.mark.parametrize(
    ("old", "new"), [("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")]
)
@pytest.mark.parametrize("flag", [True, False])
def test_old_and_new_offload_spellings_together_are_an_error(old: str, new: str, flag: bool) -> None:
    zero = {"stage": 3, old: flag, new: {"device": "cpu"}}
    error = _error({**BASE, "zero_optimization": zero})
    assert error.key == f"zero_optimization.{old}" and error.value is flag
    assert f"zero_optimization.{new}" in error.rule and f"keep only {new}" in error.fix


def test_old_offload_spelling_alone_still_works() -> None:
    cfg = load_config({**BASE, "zero_optimization": {"stage": 2, "cpu_offload": False}})
    assert cfg.config.zero_optimization.offload_optimizer_device == "none"


# ------------------------------------------------------------------ fp16 scaler settings


@pytest.mark.parametrize(
    "fp16",
    [
        {"enabled": False, "loss_scale_window": 0, "hysteresis": 0, "min_loss_scale": 0},
        {"enabled": True, "loss_scale": 128, "loss_scale_window": 0, "hysteresis": 0, "min_loss_scale": 0},
    ],
    ids=["fp16-off", "static-scale"],
)
def test_scaler_settings_are_not_checked_when_unused(fp16: dict[str, Any]) -> None:
    assert load_config({**BASE, "fp16": fp16}).config.fp16.loss_scale_window == 0


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "fp16.loss_scale_window"),
        ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis"),
        ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "fp16.min_loss_scale"),
        ({"fp16": {"enabled": True, "min_loss_scale": 1e6}}, "fp16.initial_scale_power"),
        # legacy amp and fp16 autocast scale dynamically with the fp16 section's settings
        ({"amp": {"enabled": True}, "fp16": {"hysteresis": 0}}, "fp16.hysteresis"),
        (
            {"torch_autocast": {"enabled": True, "dtype": "fp16"}, "fp16": {"hysteresis": 0}},
            "fp16.hysteresis",
        ),
    ],
)
def test_scaler_settings_are_checked_under_dynamic_scaling(section: dict[str, Any], key: str) -> None:
    error = _error({**BASE, **section})
    assert error.key == key and error.fix


def test_bf16_autocast_does_not_check_fp16_settings() -> None:
    config = {**BASE, "torch_autocast": {"enabled": True, "dtype": "bf16"}, "fp16": {"hysteresis": 0}}
    assert load_config(config).config.fp16.hysteresis == 0
