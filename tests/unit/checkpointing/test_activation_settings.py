"""shardwise.checkpointing.configure: the section from a file, dict or loaded config, argument
overrides, the mpu's model-parallel group, DeepSpeed's combination rules as ConfigErrors, and
what initialize does (configure_for_engine)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shardwise import checkpointing
from shardwise.checkpointing import settings as settings_module
from shardwise.config import ConfigError, load_config
from shardwise.config.sections.features import ActivationCheckpointingConfig

SECTION = {
    "partition_activations": True,
    "cpu_checkpointing": True,
    "contiguous_memory_optimization": True,
    "number_checkpoints": 4,
    "synchronize_checkpoint_boundary": True,
    "profile": True,
}


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    settings_module._current = settings_module.CheckpointingSettings()
    settings_module._configured = False
    yield
    settings_module._current = settings_module.CheckpointingSettings()
    settings_module._configured = False


class _Mpu:
    def __init__(self, rank: int = 1, size: int = 2, tensor: bool = False) -> None:
        prefix = "get_tensor_model_parallel_" if tensor else "get_model_parallel_"
        setattr(self, prefix + "group", lambda: "group")
        setattr(self, prefix + "rank", lambda: rank)
        setattr(self, prefix + "world_size", lambda: size)


def _keys(s: checkpointing.CheckpointingSettings) -> dict[str, Any]:
    return {k: getattr(s, k) for k in SECTION}


def test_unconfigured_means_defaults() -> None:
    assert not checkpointing.is_configured()
    assert not checkpointing.current_settings().transforms_storage


@pytest.mark.parametrize("form", ["dict", "path", "loaded", "section"])
def test_configure_reads_every_key_of_the_section(form: str, tmp_path: Path) -> None:
    raw = {"train_batch_size": 2, "activation_checkpointing": SECTION}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    source = {
        "dict": raw,
        "path": str(path),
        "loaded": load_config(raw),
        "section": ActivationCheckpointingConfig(**SECTION),
    }[form]
    got = checkpointing.configure(_Mpu(), deepspeed_config=source)
    assert _keys(got) == SECTION and checkpointing.is_configured()
    assert (got.mp_group, got.mp_rank, got.mp_size) == ("group", 1, 2)


def test_the_legacy_spelling_partitioned_activations_is_read() -> None:
    got = checkpointing.configure(
        None, deepspeed_config={"activation_checkpointing": {"partitioned_activations": True}}
    )
    assert got.partition_activations


def test_arguments_override_the_config_and_the_tensor_parallel_mpu_is_used() -> None:
    got = checkpointing.configure(
        _Mpu(rank=0, size=4, tensor=True),
        deepspeed_config={"activation_checkpointing": SECTION},
        contiguous_checkpointing=False,
        checkpoint_in_cpu=False,
        synchronize=False,
        profile=False,
        num_checkpoints=7,
    )
    assert (got.contiguous_memory_optimization, got.cpu_checkpointing, got.profile) == (False, False, False)
    assert got.number_checkpoints == 7 and (got.mp_rank, got.mp_size) == (0, 4)


def test_the_mpu_is_kept_by_a_later_configure_without_one() -> None:
    mpu = _Mpu()
    checkpointing.configure(mpu)
    assert checkpointing.configure(None).mpu is mpu


def test_contiguous_without_partition_names_the_key_and_the_fix() -> None:
    with pytest.raises(ConfigError) as info:
        checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=2)
    assert info.value.key == "activation_checkpointing.contiguous_memory_optimization"
    assert "partition_activations" in info.value.fix


def test_contiguous_without_number_checkpoints_names_the_key_and_the_fix() -> None:
    with pytest.raises(ConfigError) as info:
        checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True)
    assert info.value.key == "activation_checkpointing.number_checkpoints" and info.value.value is None
    assert "num_checkpoints=N to deepspeed.checkpointing.configure()" in info.value.fix
    assert "set activation_checkpointing.number_checkpoints" in info.value.fix


def test_configure_takes_the_slot_count_from_num_checkpoints_when_the_config_has_none() -> None:
    section = {"partition_activations": True, "contiguous_memory_optimization": True}
    got = checkpointing.configure(
        None, deepspeed_config={"activation_checkpointing": section}, num_checkpoints=5
    )
    assert got.contiguous_memory_optimization and got.number_checkpoints == 5


def test_a_bad_value_in_the_section_names_its_key() -> None:
    with pytest.raises(ConfigError) as info:
        checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"profile": "often"}})
    assert info.value.key == "activation_checkpointing.profile"


def test_deepspeed_setters() -> None:
    checkpointing.configure(None)
    checkpointing.partition_activations_in_checkpoint(True)
    checkpointing.set_num_layers(6)
    got = checkpointing.current_settings()
    assert got.partition_activations and got.number_checkpoints == 6


def test_initialize_applies_a_section_that_sets_something_and_keeps_an_earlier_configure_otherwise() -> None:
    from shardwise.checkpointing.settings import configure_for_engine

    assert configure_for_engine(ActivationCheckpointingConfig(), None) is None
    assert checkpointing.is_configured() and not checkpointing.current_settings().transforms_storage
    checkpointing.configure(None, checkpoint_in_cpu=True)  # a script configured it itself
    mpu = _Mpu()
    assert configure_for_engine(ActivationCheckpointingConfig(), mpu) is None
    kept = checkpointing.current_settings()
    assert kept.cpu_checkpointing and kept.mpu is mpu and kept.mp_size == 2
    applied = configure_for_engine(ActivationCheckpointingConfig(profile=True), mpu)
    assert applied is not None and applied.profile and not applied.cpu_checkpointing


def test_describe_names_what_is_active() -> None:
    text = checkpointing.describe(checkpointing.CheckpointingSettings(**SECTION, mp_size=2))
    for part in ("split over 2 model-parallel ranks", "host memory", "4 slots", "synchronized", "profiled"):
        assert part in text
    alone = checkpointing.describe(checkpointing.CheckpointingSettings(partition_activations=True))
    assert "1 rank: nothing is split" in alone


def test_config_check_accepts_a_slot_count_left_to_configure_and_says_so() -> None:
    from shardwise.preflight import SLOT_COUNT_NOTE, load_checked_config

    section = {"partition_activations": True, "contiguous_memory_optimization": True}
    resolved = load_checked_config({"train_batch_size": 2, "activation_checkpointing": section})
    assert resolved.config.activation_checkpointing.number_checkpoints is None
    assert SLOT_COUNT_NOTE in resolved.warnings and "num_checkpoints=N" in SLOT_COUNT_NOTE
    ok = {**section, "number_checkpoints": 8}
    resolved = load_checked_config({"train_batch_size": 2, "activation_checkpointing": ok})
    assert resolved.config.activation_checkpointing.number_checkpoints == 8
    assert SLOT_COUNT_NOTE not in resolved.warnings


def test_config_check_still_refuses_a_slot_count_below_one_and_contiguous_without_partitioning() -> None:
    from shardwise.preflight import load_checked_config

    with pytest.raises(ConfigError) as info:
        load_checked_config(
            {
                "train_batch_size": 2,
                "activation_checkpointing": {
                    "partition_activations": True,
                    "contiguous_memory_optimization": True,
                    "number_checkpoints": 0,
                },
            }
        )
    assert info.value.key == "activation_checkpointing.number_checkpoints" and info.value.value == 0
    with pytest.raises(ConfigError) as info:
        load_checked_config(
            {"train_batch_size": 2, "activation_checkpointing": {"contiguous_memory_optimization": True}}
        )
    assert info.value.key == "activation_checkpointing.contiguous_memory_optimization"


def test_megatron_offload_config_passes_config_check() -> None:
    """DeepSpeedExamples' Megatron-LM ds_zero-offload_config.json: the slot count comes from the
    script's checkpointing.configure(..., num_checkpoints=num_layers)."""
    from shardwise.preflight import SLOT_COUNT_NOTE, load_checked_config

    config = {
        "train_batch_size": 8,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "activation_checkpointing": {
            "partition_activations": True,
            "contiguous_memory_optimization": True,
            "cpu_checkpointing": True,
        },
    }
    assert SLOT_COUNT_NOTE in load_checked_config(config).warnings


INITIALIZE_SECTION = ActivationCheckpointingConfig(
    partition_activations=True, contiguous_memory_optimization=True
)


def test_initialize_keeps_the_slot_count_of_an_earlier_configure() -> None:
    from shardwise.checkpointing.settings import configure_for_engine

    checkpointing.configure(None, num_checkpoints=6)  # Megatron's configure, before initialize
    applied = configure_for_engine(INITIALIZE_SECTION, None)
    assert applied is not None and applied.contiguous_memory_optimization
    assert applied.number_checkpoints == 6 and checkpointing.current_settings() is applied
    assert "6 slots" in checkpointing.describe(applied)


def test_initialize_without_a_slot_count_defers_the_refusal_to_checkpoint_or_a_later_configure() -> None:
    import torch

    from shardwise.checkpointing.settings import configure_for_engine
    from shardwise.checkpointing.storage import active_storage, reset

    reset()
    applied = configure_for_engine(INITIALIZE_SECTION, None)
    assert applied is not None and applied.number_checkpoints is None
    assert "must still come from checkpointing.configure" in checkpointing.describe(applied)
    layer = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError) as info:
        checkpointing.checkpoint(layer, torch.ones(1, 2, requires_grad=True))
    assert info.value.key == "activation_checkpointing.number_checkpoints"
    assert "num_checkpoints=N" in info.value.fix
    settings = checkpointing.configure(None, deepspeed_config=INITIALIZE_SECTION, num_checkpoints=2)
    assert settings.number_checkpoints == 2
    storage = active_storage()
    assert storage is not None and storage.pool is not None
    out = checkpointing.checkpoint(layer, torch.ones(1, 2, requires_grad=True))
    out.sum().backward()
    reset()
