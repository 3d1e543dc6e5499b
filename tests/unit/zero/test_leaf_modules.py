"""set_z3_leaf_modules and friends: flags on modules, matched by class, name or suffix."""

from __future__ import annotations

import pytest
from torch import nn

from shardwise.zero.leaf_modules import (
    get_z3_leaf_modules,
    leaf_module_names,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)


def _model() -> nn.Sequential:
    return nn.Sequential(Block(), nn.Linear(2, 2), Block())


def test_by_class_object_and_names() -> None:
    model = _model()
    assert set_z3_leaf_modules(model, [Block]) == [model[0], model[2]]
    assert get_z3_leaf_modules(model) == [model[0], model[2]] and leaf_module_names(model) == ("0", "2")
    assert unset_z3_leaf_modules(model, ["Block"]) == [model[0], model[2]]
    assert get_z3_leaf_modules(model) == []
    qualified = f"{Block.__module__}.{Block.__qualname__}"
    assert set_z3_leaf_modules(model, [qualified]) == [model[0], model[2]]


def test_missing_classes_and_bad_entries_are_refused() -> None:
    model = _model()
    with pytest.raises(ValueError, match="no module of"):
        set_z3_leaf_modules(model, [nn.Conv1d])
    assert set_z3_leaf_modules(model, [nn.Conv1d], raise_if_not_found=False) == []
    with pytest.raises(TypeError, match="classes or class names"):
        set_z3_leaf_modules(model, [3])  # type: ignore[list-item]


def test_by_name_and_suffix() -> None:
    model = _model()
    found, missing = set_z3_leaf_modules_by_name(model, ["0", "9"], raise_if_not_found=False)
    assert found == [model[0]] and missing == ["9"] and z3_leaf_module(model[0])
    found, missing = set_z3_leaf_modules_by_suffix(model, ["inner"])
    assert found == [model[0].inner, model[2].inner] and missing == []
    with pytest.raises(ValueError, match="no module named"):
        set_z3_leaf_modules_by_name(model, ["nope"])
