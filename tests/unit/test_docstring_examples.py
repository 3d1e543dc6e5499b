"""Every ``>>>`` example in the library's docstrings runs and prints what it says.

Examples that need several processes or an external service are written as comments
(``>>> # call(...)`` and ``>>> # -> output``), so nothing here is skipped.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import shardwise

_FOUND = list(pkgutil.walk_packages(shardwise.__path__, prefix="shardwise."))
MODULES = ["shardwise", *sorted(info.name for info in _FOUND)]


def test_every_module_is_covered():
    assert "shardwise.zero.partition" in MODULES and "shardwise.optim.group_state" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, verbose=False, report=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples in {name} failed"
