"""DeepSpeed's ``deepspeed.checkpointing`` module globals: live views of configure(), assignable,
and the same through the forwarding ``deepspeed`` package."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardwise import checkpointing
from shardwise.compat import forwarding, installer


class _Mpu:
    def get_model_parallel_group(self) -> None:
        return None

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 3


@pytest.fixture(autouse=True)
def _defaults() -> Iterator[None]:
    checkpointing.configure(None)
    yield
    checkpointing.configure(None)
    checkpointing.mpu = None


def test_globals_follow_configure() -> None:
    checkpointing.configure(
        None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=3,
        checkpoint_in_cpu=True, synchronize=True, profile=True,
    )
    got = (
        checkpointing.PARTITION_ACTIVATIONS, checkpointing.CONTIGUOUS_CHECKPOINTING, checkpointing.num_layers,
        checkpointing.CPU_CHECKPOINT, checkpointing.SYNCHRONIZE, checkpointing.PROFILE_TIME,
    )
    assert got == (True, True, 3, True, True, True)
    assert checkpointing.deepspeed_checkpointing_enabled
    checkpointing.configure(None)
    assert (checkpointing.PARTITION_ACTIVATIONS, checkpointing.num_layers) == (False, None)


def test_assigning_a_global_changes_the_settings() -> None:
    checkpointing.PARTITION_ACTIVATIONS = True
    checkpointing.num_layers = 5
    settings = checkpointing.current_settings()
    assert settings.partition_activations and settings.number_checkpoints == 5
    checkpointing.mpu = _Mpu()
    assert (checkpointing.mp_size, checkpointing.current_settings().mp_size) == (3, 3)


def test_contiguous_without_layers_is_deepspeeds_assertion() -> None:
    with pytest.raises(AssertionError, match="number of layers"):
        checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True)
    assert not checkpointing.CONTIGUOUS_CHECKPOINTING, "a refused configure changes nothing"


@pytest.fixture
def deepspeed_checkpointing(tmp_path: Path) -> Iterator[object]:
    installer.install(tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module("deepspeed").checkpointing
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
            del sys.modules[name]
        if forwarding._FINDER in sys.meta_path:
            sys.meta_path.remove(forwarding._FINDER)


def test_forwarded_globals_are_never_stale(deepspeed_checkpointing: object) -> None:
    cp = deepspeed_checkpointing
    assert cp.PARTITION_ACTIVATIONS is False  # read once: must not be cached
    cp.configure(None, partition_activations=True)
    assert cp.PARTITION_ACTIVATIONS is True
    cp.PARTITION_ACTIVATIONS = False  # assigned through the forwarding module: reaches shardwise
    assert checkpointing.current_settings().partition_activations is False
    assert cp.PARTITION_ACTIVATIONS is False
    assert cp.checkpoint is checkpointing.checkpoint  # functions still resolve (and are cached)
    import shardwise

    assert shardwise.checkpointing is checkpointing, "binding deepspeed.checkpointing must not touch shardwise"
