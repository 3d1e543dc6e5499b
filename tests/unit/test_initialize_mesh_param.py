"""DeepSpeed's ``initialize(mesh_param=(data_parallel_size, sequence_parallel_size))``: the sp it declares."""

from __future__ import annotations

import pytest

from shardwise.initialization import _sequence_degree_of_mesh_param


def test_mesh_param_declares_its_sequence_degree() -> None:
    assert _sequence_degree_of_mesh_param((2, 2), 4) == 2
    assert _sequence_degree_of_mesh_param([1, 4], 4) == 4
    assert _sequence_degree_of_mesh_param((4, 1), 4) is None  # no sequence parallelism


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ((2, 2), "must equal the world size 8"),
        ((2,), "two ints >= 1"),
        ((2, 0), "two ints >= 1"),
        ("2x2", "two ints >= 1"),
    ],
)
def test_mesh_param_errors_name_the_rule(value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _sequence_degree_of_mesh_param(value, 8)
