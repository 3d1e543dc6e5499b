"""``config check`` runs initialize's model-free validation: optimizer and scheduler names, their
parameters and value ranges fail with the key path; the builders' warnings are shown too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shardwise.cli.main import main
from shardwise.config import ConfigError, load_config
from shardwise.config.errors import KeyedValueError
from shardwise.preflight import component_problems, load_checked_config
from shardwise.utils.logging import get_logger

BASE: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2}
ADAM: dict[str, Any] = {"type": "AdamW", "params": {"lr": 1e-3}}


@pytest.fixture(autouse=True)
def _keep_log_level() -> Iterator[None]:
    logger = get_logger()
    level = logger.level
    yield
    logger.setLevel(level)


def _check(tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, Any]) -> tuple[int, str]:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    code = main(["config", "check", str(path), "--world-size", "2"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


# (config sections, the key path the failure names, a word of the rule or fix)
CASES = [
    ({"optimizer": {"type": "AdamW", "params": {"lrr": 1e-3}}}, "optimizer.params.lrr", 'did you mean "lr"'),
    ({"optimizer": {"type": "AdamW", "params": {"beta": [0.9, 0.99]}}}, "optimizer.params.beta", '"betas"'),
    ({"optimizer": {"type": "Adma", "params": {}}}, "optimizer.type", "'adam'"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}}, "optimizer.params.lr", "finite number >= 0"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": float("nan")}}}, "optimizer.params.lr", "finite"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": -1e-3}}}, "optimizer.params.lr", ">= 0"),
    ({"optimizer": {"type": "SGD", "params": {"lr": -0.1}}}, "optimizer.params.lr", ">= 0"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.5]}}}, "optimizer.params.betas", "[0, 1)"),
    (
        {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}},
        "optimizer.params.max_grad_norm",
        "gradient_clipping",
    ),
    (
        {"optimizer": {"type": "Lamb", "params": {}}, "zero_optimization": {"stage": 1}},
        "zero_allow_untested_optimizer",
        "Lamb",
    ),
    ({"optimizer": ADAM, "scheduler": {"type": "WarmupLRR", "params": {}}}, "scheduler.type", "'WarmupLR'"),
    (
        {"optimizer": ADAM, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}},
        "scheduler.params.warmup_num_step",
        "'warmup_num_steps'",
    ),
    (
        {"optimizer": ADAM, "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}},
        "scheduler.params.total_num_steps",
        "missing",
    ),
    (
        {"optimizer": ADAM, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -5}}},
        "scheduler.params.warmup_num_steps",
        ">= 1",
    ),
    (
        {"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": float("nan")}}},
        "scheduler.params.cycle_max_lr",
        "finite",
    ),
]


@pytest.mark.parametrize(("sections", "key", "words"), CASES, ids=[c[1] for c in CASES])
def test_config_check_fails_with_the_key_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sections: dict[str, Any], key: str, words: str
) -> None:
    if "nan" not in json.dumps(sections).lower():  # NaN cannot be written in a JSON/hjson file; dicts only
        code, text = _check(tmp_path, capsys, {**BASE, **sections})
        assert code == 1
        assert text.startswith("FAIL") and f"'{key}'" in text and words in text and "fix:" in text
    with pytest.raises(ConfigError) as info:  # the same path initialize takes
        load_checked_config({**BASE, **sections}, world_size=2)
    assert info.value.key == key and words in str(info.value) and "fix:" in str(info.value)


def test_builders_warnings_are_shown_by_config_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scheduler = {"type": "WarmupDecayLR", "params": {"total_num_steps": 5, "warmup_num_steps": 10}}
    code, text = _check(tmp_path, capsys, {**BASE, "optimizer": ADAM, "scheduler": scheduler})
    assert code == 0
    assert "warning: total_num_steps 5 is less than warmup_num_steps 10" in text


def test_a_valid_optimizer_and_scheduler_pass_without_warnings() -> None:
    scheduler = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
    cfg = load_checked_config({**BASE, "optimizer": ADAM, "scheduler": scheduler}, world_size=2)
    assert cfg.warnings == [] and cfg.ignored == []


def test_nothing_is_built_without_the_sections() -> None:
    # (tests/unit/test_package.py checks that such a config loads without importing torch)
    assert component_problems(load_config(BASE).config) == ([], [])


def test_keyed_value_error_becomes_a_config_error_with_rule_and_fix() -> None:
    err = KeyedValueError(
        "scheduler parameter x=-1 is invalid: it must be >= 0. Fix: use 0.", "scheduler.params.x", -1
    )
    converted = err.as_config_error()
    assert (converted.key, converted.value, converted.rule) == (
        "scheduler.params.x",
        -1,
        "scheduler parameter x=-1 is invalid: it must be >= 0.",
    )
    assert converted.fix == "use 0."
    plain = KeyedValueError("something is wrong", "optimizer.type").as_config_error()
    assert plain.key == "optimizer.type" and not plain.has_value and plain.fix


def test_compression_mistakes_are_found_without_a_model() -> None:
    """config check and initialize share the compression_training checks (keys, and the stage-3 pruning rule)."""
    pruning = {
        "shared_parameters": {"enabled": True, "schedule_offset": 5},
        "different_groups": {"rp1": {"params": {"dense_ratio": 0.5}, "modules": ["fc1"]}},
    }
    base: dict[str, Any] = {"train_batch_size": 2, "compression_training": {"row_pruning": pruning}}
    load_checked_config(base)  # valid at stage 0
    with pytest.raises(ConfigError) as stage3:
        load_checked_config({**base, "zero_optimization": {"stage": 3}})
    assert stage3.value.key == "compression_training.row_pruning.shared_parameters.enabled"
    assert "stage 0, 1 or 2" in str(stage3.value)
    typo = {"row_pruning": {**pruning, "shared_parameters": {"enabled": True, "schedule_ofset": 5}}}
    with pytest.raises(ConfigError) as misspelt:
        load_checked_config({"train_batch_size": 2, "compression_training": typo})
    assert "schedule_ofset" in str(misspelt.value) and "schedule_offset" in str(misspelt.value)
