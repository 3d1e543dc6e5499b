"""The engine's counters: one Stateful object, DeepSpeed's names as engine attributes."""

from __future__ import annotations

import pytest

from shardwise.engine import ShardwiseEngine
from shardwise.runtime.counters import COUNTER_NAMES, CounterAttribute, EngineCounters


def test_state_dict_is_the_checkpoint_format_of_the_first_version():
    counters = EngineCounters(global_steps=4, global_samples=16, skipped_steps=1, micro_steps=8)
    # the exact dict (names, order, ints) checkpoints have always held under common/counters
    assert counters.state_dict() == {
        "global_steps": 4,
        "global_samples": 16,
        "skipped_steps": 1,
        "micro_steps": 8,
    }
    assert list(counters.state_dict()) == ["global_steps", "global_samples", "skipped_steps", "micro_steps"]


def test_load_state_dict_restores_known_names_and_keeps_the_rest():
    counters = EngineCounters(global_samples=5)
    counters.load_state_dict({"global_steps": 3.0, "micro_steps": 6, "something_else": 9})
    assert counters == EngineCounters(global_steps=3, global_samples=5, skipped_steps=0, micro_steps=6)
    assert isinstance(counters.global_steps, int)


def test_the_engine_exposes_each_counter_under_deepspeeds_name():
    for name in COUNTER_NAMES:
        assert isinstance(ShardwiseEngine.__dict__[name], CounterAttribute)

    class Owner:
        global_steps = CounterAttribute()
        skipped_steps = CounterAttribute()

        def __init__(self) -> None:
            self.counters = EngineCounters()

    owner = Owner()
    owner.global_steps = 7  # scripts that assign the attribute keep working
    owner.counters.skipped_steps = 2
    assert owner.counters.global_steps == 7 and owner.skipped_steps == 2


def test_a_counter_attribute_needs_a_counter_name():
    with pytest.raises(AttributeError, match="'global_step' is not an engine counter"):
        CounterAttribute().__set_name__(ShardwiseEngine, "global_step")
