"""Reading a config (spec 1.1): dicts, hjson files, JSON strings, base64, and the errors."""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path

import pytest

from shardwise.config import ConfigError, load_config
from shardwise.config.loading import read_config_source

HJSON_TEXT = """
{
  // a line comment
  train_micro_batch_size_per_gpu: 4      # a hash comment
  "gradient_accumulation_steps": 2,
  zero_optimization: {
    stage: 2,
    offload_optimizer: {"device": "cpu",},    // trailing comma inside an object
  },
  "bf16": {"enabled": true,},
}
"""


def _write(tmp_path: Path, text: str, name: str = "ds_config.json") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_dict_input_is_not_mutated() -> None:
    user = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "bfloat16": {"enabled": True, "loss_scale": 0},
        "zero_optimization": {
            "stage": 2,
            "cpu_offload": True,
            "reduce_bucket_size": "auto",
            "prefetch_bucket_size": 10,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.95]}},
        "fp32_allreduce": True,
        "unknown_thing": 1,
    }
    before = copy.deepcopy(user)
    cfg = load_config(user, world_size=2, overrides={"train_micro_batch_size_per_gpu": 2})
    assert user == before
    assert cfg.config.train_batch_size == 4 and cfg.config.zero_optimization.offload_optimizer_device == "cpu"
    # and the resolved config does not alias the caller's nested objects
    assert cfg.config.optimizer.params["betas"] is not user["optimizer"]["params"]["betas"]


def test_read_config_source_copies_dict() -> None:
    user = {"zero_optimization": {"stage": 1}}
    data, origin = read_config_source(user)
    data["zero_optimization"]["stage"] = 3
    assert user["zero_optimization"]["stage"] == 1
    assert origin == "<dict>"


def test_hjson_file_with_comments_unquoted_keys_and_trailing_commas(tmp_path: Path) -> None:
    path = _write(tmp_path, HJSON_TEXT)
    cfg = load_config(str(path), world_size=2)
    assert (
        cfg.config.train_batch_size,
        cfg.config.train_micro_batch_size_per_gpu,
        cfg.config.gradient_accumulation_steps,
    ) == (
        16,
        4,
        2,
    )
    assert cfg.config.zero_stage == 2
    assert cfg.config.zero_optimization.offload_optimizer_device == "cpu"
    assert cfg.config.bf16.enabled is True
    assert cfg.origin == str(path)


def test_pathlike_is_accepted(tmp_path: Path) -> None:
    path = _write(tmp_path, json.dumps({"train_batch_size": 6}))
    cfg = load_config(path, world_size=3)
    assert cfg.config.train_micro_batch_size_per_gpu == 2


def test_duplicate_key_in_file_names_the_key(tmp_path: Path) -> None:
    path = _write(tmp_path, '{"train_batch_size": 8, "steps_per_print": 10, "train_batch_size": 16}')
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert info.value.key == "train_batch_size"
    assert "'train_batch_size'" in str(info.value)
    assert "more than once" in str(info.value) and "fix:" in str(info.value)


def test_duplicate_nested_key_names_the_key(tmp_path: Path) -> None:
    path = _write(tmp_path, '{"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 3}}')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == "stage"


def test_json_string() -> None:
    cfg = load_config('  {"train_batch_size": 8, "fp16": {"enabled": true}}  ', world_size=2)
    assert cfg.config.train_micro_batch_size_per_gpu == 4 and cfg.config.precision == "fp16"
    assert cfg.origin == "<json string>"


def test_json_string_duplicate_keys_rejected() -> None:
    with pytest.raises(ConfigError) as info:
        load_config('{"gradient_clipping": 1.0, "gradient_clipping": 0.5, "train_batch_size": 1}')
    assert info.value.key == "gradient_clipping"


def test_urlsafe_base64_string() -> None:
    # "??>>" encodes to bytes that need the URL-safe alphabet ('-' and '_')
    payload = {"train_batch_size": 8, "wandb": {"enabled": False, "project": "??>>~~"}}
    encoded = base64.urlsafe_b64encode(json.dumps(payload).encode()).decode()
    assert "-" in encoded or "_" in encoded
    cfg = load_config(encoded, world_size=4)
    assert cfg.config.train_micro_batch_size_per_gpu == 2
    assert cfg.config.wandb.project == "??>>~~"
    assert cfg.origin == "<base64 string>"


def test_base64_without_padding() -> None:
    encoded = base64.urlsafe_b64encode(b'{"train_batch_size": 2}').decode().rstrip("=")
    assert load_config(encoded, world_size=2).config.train_micro_batch_size_per_gpu == 1


@pytest.mark.parametrize("missing", ["does/not/exist.json", "no_such_config.json"])
def test_missing_file(missing: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    text = str(info.value)
    assert missing in text and "does not exist" in text and "fix:" in text


def test_missing_absolute_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "absent.json"))


def test_string_that_is_nothing() -> None:
    with pytest.raises(ConfigError) as info:
        load_config("not a config at all")
    text = str(info.value)
    assert "neither an existing file, JSON text, nor base64" in text and "fix:" in text


def test_wrong_type() -> None:
    with pytest.raises(ConfigError, match="got int"):
        load_config(42)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["[1, 2, 3]", '"just a string"', "8"])
def test_top_level_non_object_in_file(text: str, tmp_path: Path) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert "must hold a JSON object at the top level" in str(info.value)
    assert "fix:" in str(info.value)


def test_invalid_syntax_file_names_file_and_position(tmp_path: Path) -> None:
    path = _write(tmp_path, '{\n  "train_batch_size": 8,\n  "fp16": {"enabled": }\n}\n')
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    text = str(info.value)
    assert str(path) in text
    assert "not valid JSON or hjson" in text
    assert "line 3" in text
    assert "fix:" in text


def test_invalid_syntax_string() -> None:
    with pytest.raises(ConfigError, match="the config string is not valid JSON or hjson"):
        load_config('{"train_batch_size": 8,, }')
