"""Batch-size resolution (spec section 2): every row of the spec's table, every branch of
``resolve_batch_sizes``, and the same rows through ``load_config``.

Where DeepSpeed 0.19.8 fails with an assertion or a ``ZeroDivisionError`` we expect a
``ConfigError`` that names the key, shows the numbers and carries a ``fix:`` line.
"""

from __future__ import annotations

import pytest

from shardwise.config import BatchSizes, ConfigError, load_config, resolve_batch_sizes

TBS, MBS, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


def _inputs(tbs: object, mbs: object, gas: object) -> dict[str, object]:
    return {k: v for k, v in ((TBS, tbs), (MBS, mbs), (GAS, gas)) if v is not None}


def _assert_explained(err: ConfigError, key: str, *fragments: str) -> None:
    text = str(err)
    assert err.key == key
    assert f"'{key}'" in text
    assert "fix:" in text and err.fix
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in {text!r}"


# spec section 2 table: (W, TBS, MBS, GAS) -> (TBS, MBS, GAS)
SPEC_OK = [
    pytest.param(4, 32, None, None, (32, 8, 1), id="W4-TBS32"),
    pytest.param(4, None, 4, None, (16, 4, 1), id="W4-MBS4"),
    pytest.param(4, 32, 4, None, (32, 4, 2), id="W4-TBS32-MBS4"),
    pytest.param(4, 32, None, 2, (32, 4, 2), id="W4-TBS32-GAS2"),
    pytest.param(4, None, 4, 3, (48, 4, 3), id="W4-MBS4-GAS3"),
    pytest.param(4, 32, 4, 2, (32, 4, 2), id="W4-all-consistent"),
    pytest.param(2, 8.0, None, None, (8, 4, 1), id="W2-TBS8.0-float"),
]

# spec section 2 table: (W, TBS, MBS, GAS) -> key named by the error, fragments of the message
SPEC_ERRORS = [
    pytest.param(4, 30, None, None, TBS, ("30 != 7 x 1 x 4", "= 28"), id="W4-TBS30"),
    pytest.param(4, None, None, 4, TBS, (f"neither {TBS} nor {MBS}", f"{GAS}=4 alone"), id="W4-GAS4-only"),
    pytest.param(4, 32, 3, None, TBS, ("32 != 3 x 2 x 4", "= 24"), id="W4-TBS32-MBS3"),
    pytest.param(4, 32, 16, None, TBS, ("(16)", "(4)", "= 64", f"{GAS} would be 0"), id="W4-TBS32-MBS16"),
    pytest.param(4, 32, None, 3, TBS, ("32 != 2 x 3 x 4", "= 24"), id="W4-TBS32-GAS3"),
    pytest.param(
        4, 32, None, 16, TBS, ("(16)", "= 64", "micro batch per rank would be 0"), id="W4-TBS32-GAS16"
    ),
    pytest.param(4, 32, 4, 3, TBS, ("32 != 4 x 3 x 4", "= 48"), id="W4-all-inconsistent"),
    pytest.param(4, 2, None, None, TBS, ("= 2", "world size (4)", "0 samples"), id="W4-TBS2"),
    pytest.param(1, 0, None, None, TBS, ("= 0", "greater than 0"), id="W1-TBS0"),
    pytest.param(1, None, 0, None, MBS, ("= 0", "greater than 0"), id="W1-MBS0"),
    pytest.param(1, 8, None, 0, GAS, ("= 0", "greater than 0"), id="W1-TBS8-GAS0"),
    pytest.param(1, -8, None, None, TBS, ("= -8", "greater than 0"), id="W1-TBS-8"),
    pytest.param(3, 32, 4, None, TBS, ("32 != 4 x 2 x 3", "= 24"), id="W3-TBS32-MBS4"),
]


@pytest.mark.parametrize(("world", "tbs", "mbs", "gas", "expected"), SPEC_OK)
def test_spec_table_ok_rows(
    world: int, tbs: object, mbs: object, gas: object, expected: tuple[int, int, int]
) -> None:
    b = resolve_batch_sizes(tbs, mbs, gas, world_size=world)
    got = (b.train_batch_size, b.micro_batch_per_gpu, b.gradient_accumulation_steps)
    assert got == expected
    assert all(type(v) is int for v in got)  # 8.0 becomes 8: the engine needs ints
    assert b.world_size == world
    assert b.derived == frozenset({TBS, MBS, GAS} - set(_inputs(tbs, mbs, gas)))


@pytest.mark.parametrize(("world", "tbs", "mbs", "gas", "expected"), SPEC_OK)
def test_spec_table_ok_rows_through_load_config(
    world: int, tbs: object, mbs: object, gas: object, expected: tuple[int, int, int]
) -> None:
    cfg = load_config(_inputs(tbs, mbs, gas), world_size=world)
    got = (
        cfg.config.train_batch_size,
        cfg.config.train_micro_batch_size_per_gpu,
        cfg.config.gradient_accumulation_steps,
    )
    assert got == expected
    assert all(type(v) is int for v in got)


@pytest.mark.parametrize(("world", "tbs", "mbs", "gas", "key", "fragments"), SPEC_ERRORS)
def test_spec_table_error_rows(
    world: int, tbs: object, mbs: object, gas: object, key: str, fragments: tuple[str, ...]
) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(tbs, mbs, gas, world_size=world)
    _assert_explained(info.value, key, *fragments)


@pytest.mark.parametrize(("world", "tbs", "mbs", "gas", "key", "fragments"), SPEC_ERRORS)
def test_spec_table_error_rows_through_load_config(
    world: int, tbs: object, mbs: object, gas: object, key: str, fragments: tuple[str, ...]
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_inputs(tbs, mbs, gas), world_size=world)
    _assert_explained(info.value, key, *fragments)


def test_gas_zero_is_a_config_error_not_zero_division() -> None:
    # DeepSpeed 0.19.8 divides by GAS before checking it (spec: ZeroDivisionError)
    for world in (1, 4):
        with pytest.raises(ConfigError) as info:
            resolve_batch_sizes(8, None, 0, world_size=world)
        assert not isinstance(info.value, ZeroDivisionError)
        _assert_explained(info.value, GAS, "= 0", "use 1 for no accumulation")


@pytest.mark.parametrize(
    ("tbs", "mbs", "gas", "key", "value"),
    [
        (None, None, -2, GAS, "-2"),
        (16, 4, -1, GAS, "-1"),
        (-16, 4, None, TBS, "-16"),
        (None, -4, None, MBS, "-4"),
        (None, -4, 2, MBS, "-4"),
        (0, 0, 0, GAS, "= 0"),  # GAS is checked first, so the message is about the divisor
    ],
)
def test_zero_and_negative_values(tbs: object, mbs: object, gas: object, key: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(tbs, mbs, gas, world_size=2)
    _assert_explained(info.value, key, value, "greater than 0")


# ------------------------------------------------------------------ each fill rule


def test_fill_gas_from_tbs_and_mbs() -> None:
    b = resolve_batch_sizes(64, 4, None, world_size=4)
    assert (b.train_batch_size, b.micro_batch_per_gpu, b.gradient_accumulation_steps) == (64, 4, 4)
    assert b.derived == frozenset({GAS})


def test_fill_mbs_from_tbs_and_gas() -> None:
    b = resolve_batch_sizes(48, None, 3, world_size=2)
    assert (b.micro_batch_per_gpu, b.gradient_accumulation_steps) == (8, 3)
    assert b.derived == frozenset({MBS})


def test_fill_tbs_from_mbs_and_gas() -> None:
    b = resolve_batch_sizes(None, 2, 5, world_size=3)
    assert b.train_batch_size == 30
    assert b.derived == frozenset({TBS})


def test_fill_from_tbs_only() -> None:
    b = resolve_batch_sizes(24, None, None, world_size=3)
    assert (b.micro_batch_per_gpu, b.gradient_accumulation_steps) == (8, 1)
    assert b.derived == frozenset({MBS, GAS})


def test_fill_from_mbs_only() -> None:
    b = resolve_batch_sizes(None, 5, None, world_size=3)
    assert (b.train_batch_size, b.gradient_accumulation_steps) == (15, 1)
    assert b.derived == frozenset({TBS, GAS})


def test_all_three_consistent_derives_nothing() -> None:
    b = resolve_batch_sizes(24, 3, 4, world_size=2)
    assert b == BatchSizes(24, 3, 4, 2, frozenset())


def test_nothing_given() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(None, None, None, world_size=1)
    _assert_explained(info.value, TBS, f"neither {TBS} nor {MBS}")
    assert "alone is not enough" not in str(info.value)
    assert f'"{MBS}"' in info.value.fix


def test_world_size_below_one() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(8, None, None, world_size=0)
    _assert_explained(info.value, "world_size", "= 0", "at least 1")


# ------------------------------------------------------------------ mismatch messages and fixes


def test_mismatch_all_three_given_suggests_the_product() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(32, 4, 3, world_size=4)
    err = info.value
    _assert_explained(err, TBS, "32 != 4 x 3 x 4 = 48")
    assert f"set {TBS} to 48" in err.fix
    assert "remove one of the three keys" in err.fix


def test_mismatch_tbs_and_mbs_lists_micro_batches_that_fit() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(32, 3, None, world_size=4)
    err = info.value
    _assert_explained(err, TBS, "32 != 3 x 2 x 4")
    assert f"multiple of {MBS} x world size = 12" in err.fix
    assert "8 samples per step" in err.fix and "[1, 2, 4, 8]" in err.fix


def test_mismatch_tbs_and_gas_names_the_multiple() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(32, None, 3, world_size=4)
    _assert_explained(info.value, TBS, "32 != 2 x 3 x 4")
    assert f"multiple of {GAS} x world size = 12" in info.value.fix


def test_mismatch_not_a_multiple_of_world_size() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(32, 4, None, world_size=3)
    _assert_explained(info.value, TBS, "32 != 4 x 2 x 3")
    assert "multiple of the world size 3" in info.value.fix


def test_derived_gas_zero_fix_names_minimum() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(4, 8, None, world_size=1)
    _assert_explained(info.value, TBS, f"{MBS} (8)", f"{GAS} would be 0")
    assert f"raise {TBS} to at least 8" in info.value.fix


def test_derived_mbs_zero_fix_names_multiple() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(8, None, 4, world_size=4)
    _assert_explained(info.value, TBS, f"{GAS} (4)", "= 16")
    assert "multiple of 16" in info.value.fix


def test_derived_mbs_zero_from_tbs_only() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(3, None, None, world_size=8)
    _assert_explained(info.value, TBS, "world size (8)")
    assert "at least 8" in info.value.fix


# ------------------------------------------------------------------ value types


@pytest.mark.parametrize(
    ("key", "args"), [(TBS, (16.0, 2, None)), (MBS, (None, 2.0, 4.0)), (GAS, (16, None, 2.0))]
)
def test_integral_floats_are_accepted(key: str, args: tuple[object, object, object]) -> None:
    b = resolve_batch_sizes(*args, world_size=2)
    assert all(
        type(v) is int for v in (b.train_batch_size, b.micro_batch_per_gpu, b.gradient_accumulation_steps)
    )


@pytest.mark.parametrize(
    ("key", "args", "fix"),
    [
        (TBS, (16.5, None, None), "use 16 or 17"),
        (MBS, (None, 1.5, None), "use 1 or 2"),
        (GAS, (8, None, 2.25), "use 2 or 3"),
    ],
)
def test_non_integral_float_rejected(key: str, args: tuple[object, object, object], fix: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(*args, world_size=1)
    _assert_explained(info.value, key, "whole number")
    assert fix in info.value.fix


@pytest.mark.parametrize("value", [True, False])
@pytest.mark.parametrize("position", [0, 1, 2])
def test_bool_rejected(value: bool, position: int) -> None:
    args: list[object] = [None, 4, None]
    args[position] = value
    key = (TBS, MBS, GAS)[position]
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(*args, world_size=1)
    _assert_explained(info.value, key, repr(value), "positive integer")


@pytest.mark.parametrize(
    "text", ["CONFIG_BATCH_SIZE", "${BATCH}", "$BS", "{{ batch_size }}", "<micro batch>"]
)
def test_placeholder_string_rejected(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(None, text, None, world_size=2)
    _assert_explained(info.value, MBS, repr(text), "placeholder")


def test_placeholder_through_load_config() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({TBS: "CONFIG_BATCH_SIZE"}, world_size=2)
    _assert_explained(info.value, TBS, "'CONFIG_BATCH_SIZE'", "placeholder")


@pytest.mark.parametrize("value", ["8", [8], {"n": 8}])
def test_non_number_rejected(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(value, None, None, world_size=1)
    _assert_explained(info.value, TBS, "positive integer")
    assert f'"{TBS}": 8' in info.value.fix


# ------------------------------------------------------------------ sequence parallel (spec 1.3)


def test_sequence_parallel_divides_the_world_for_batch_arithmetic() -> None:
    cfg = load_config({TBS: 8, "sequence_parallel_size": 2}, world_size=4)
    assert cfg.batch.world_size == 2
    assert (
        cfg.config.train_batch_size,
        cfg.config.train_micro_batch_size_per_gpu,
        cfg.config.gradient_accumulation_steps,
    ) == (
        8,
        4,
        1,
    )
    assert cfg.world_size == 4  # the launch world is still recorded


def test_sequence_parallel_with_micro_batch() -> None:
    cfg = load_config({MBS: 3, GAS: 2, "sequence_parallel_size": 4}, world_size=8)
    assert cfg.config.train_batch_size == 3 * 2 * 2


def test_sequence_parallel_one_keeps_world() -> None:
    cfg = load_config({TBS: 8, "sequence_parallel_size": 1}, world_size=4)
    assert cfg.batch.world_size == 4 and cfg.config.train_micro_batch_size_per_gpu == 2


def test_sequence_parallel_must_divide_world() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({TBS: 8, "sequence_parallel_size": 3}, world_size=4)
    _assert_explained(info.value, "sequence_parallel_size", "= 3", "world size 4")


def test_unknown_near_batch_key_is_mentioned_in_the_batch_error() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({TBS: 30, "gradient_accumulation": 2}, world_size=4)
    _assert_explained(info.value, TBS, "30 != 7 x 1 x 4")
    assert f"did you mean '{GAS}'" in info.value.fix


def test_tbs_only_mismatch_fix_asks_for_a_multiple_of_the_world_size() -> None:
    # With only train_batch_size given, the micro batch is derived (30 // 4 = 7), so the
    # requirement is "a multiple of the world size"; 32 works although it is no multiple of 7 x 4.
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(30, None, None, world_size=4)
    fix = info.value.fix
    assert "multiple of the world size 4" in fix
    assert "= 28" not in fix
