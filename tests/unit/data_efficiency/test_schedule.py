"""Curriculum and random-LTD schedules against the spec's verified values and the hand formulas."""

from __future__ import annotations

import math

import pytest

from shardwise.config.errors import ConfigError
from shardwise.data_efficiency.schedule import CurriculumSchedule, RandomLTDSchedule

STEPS = (0, 1, 10, 50, 99, 100, 200)


def _values(schedule_type: str, **config: float) -> list[int]:
    s = CurriculumSchedule(
        8, 1024, schedule_type, {"total_curriculum_step": 100, "difficulty_step": 8, **config}
    )
    return [s.update(step) for step in STEPS]


def test_fixed_linear_matches_deepspeed_measured_values() -> None:
    assert _values("fixed_linear") == [8, 16, 104, 512, 1008, 1024, 1024]


def test_fixed_root_matches_deepspeed_measured_values() -> None:
    assert _values("fixed_root", root_degree=2) == [8, 104, 328, 720, 1016, 1024, 1024]


@pytest.mark.parametrize("step", [0, 3, 17, 64, 99])
def test_fixed_root_equals_the_hand_formula(step: int) -> None:
    lo, hi, total, k, r = 16, 512, 100, 16, 3
    s = CurriculumSchedule(
        lo, hi, "fixed_root", {"total_curriculum_step": total, "difficulty_step": k, "root_degree": r}
    )
    d = math.floor((step / total) ** (1 / r) * (hi - lo) + lo)
    d -= d % k
    assert s.difficulty_at(step) == min(max(d, math.ceil(lo / k) * k), hi)


def test_min_not_a_multiple_of_the_step_starts_rounded_up() -> None:
    s = CurriculumSchedule(8, 1024, "fixed_linear", {"total_curriculum_step": 100, "difficulty_step": 16})
    assert s.update(0) == 16


def test_fixed_discrete_edges() -> None:
    s = CurriculumSchedule(1, 3, "fixed_discrete", {"difficulty": [1, 2, 3], "max_step": [5, 10]})
    assert [s.update(step) for step in (0, 5, 6, 10, 11, 100)] == [1, 1, 2, 2, 3, 3]


def test_the_difficulty_stops_updating_at_the_maximum() -> None:
    s = CurriculumSchedule(1, 3, "custom", {})
    values = iter([2, 3, 1])
    s.set_custom(lambda step: next(values))
    assert [s.update(step) for step in (1, 2, 3)] == [2, 3, 3]  # the 1 is never asked for


def test_custom_without_a_function_says_how_to_give_one() -> None:
    with pytest.raises(RuntimeError, match="set_custom_curriculum_learning_schedule"):
        CurriculumSchedule(1, 3, "custom", {}).update(1)


def test_state_round_trip() -> None:
    a = CurriculumSchedule(8, 64, "fixed_linear", {"total_curriculum_step": 10, "difficulty_step": 8})
    a.update(5)
    b = CurriculumSchedule(8, 64, "fixed_linear", {"total_curriculum_step": 10, "difficulty_step": 8})
    b.load_state_dict(a.state_dict())
    assert b.current == a.current == 32


@pytest.mark.parametrize(
    ("schedule_type", "config", "key"),
    [
        ("fixed_linear", {"difficulty_step": 8}, "x.schedule_config.total_curriculum_step"),
        ("fixed_root", {"total_curriculum_step": 8, "difficulty_step": 8}, "x.schedule_config.root_degree"),
        ("fixed_discrete", {"difficulty": [1, 2], "max_step": [1, 2]}, "x.schedule_config.difficulty"),
        ("linear", {}, "x.schedule_type"),
    ],
)
def test_inconsistent_schedules_name_the_key(schedule_type: str, config: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        CurriculumSchedule(1, 8, schedule_type, config, where="x")
    assert info.value.key == key and info.value.fix


def test_random_ltd_matches_deepspeed_measured_values() -> None:
    s = RandomLTDSchedule(128, 2048, 200, 16, total_layers=24, ltd_layers=22, global_batch_size=8)
    current, consumed = [], []
    for step in (0, 1, 50, 100, 199, 200, 300):
        current.append(s.update(step))
        consumed.append(s.consumed_layer_tokens)
    assert current == [128, 128, 608, 1088, 2032, 2048, 2048]
    assert consumed == [55296, 110592, 250368, 474624, 865024, 1258240, 1651456]


def test_random_ltd_counts_each_step_once_and_round_trips() -> None:
    s = RandomLTDSchedule(4, 16, 10, 4, total_layers=2, ltd_layers=1, global_batch_size=2)
    s.update(3)
    s.update(3)  # a second forward of the same step (gradient accumulation)
    assert s.consumed_layer_tokens == 2 * (s.current_value + 16)
    t = RandomLTDSchedule(4, 16, 10, 4, total_layers=2, ltd_layers=1, global_batch_size=2)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
