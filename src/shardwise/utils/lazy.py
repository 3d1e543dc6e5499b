"""Lazy package exports: names resolve (and their modules import) on first access.

Packages that must import instantly (``shardwise``, ``shardwise.comm``, ...) declare a
table ``name -> (module, attribute)`` and get their ``__getattr__`` / ``__dir__`` here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, table: Mapping[str, tuple[str, str | None]], namespace: dict[str, object]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``; resolved names are cached in ``namespace``.

    An attribute of ``None`` exports the module itself.

    Example:
        >>> ns: dict = {}
        >>> getattr_, dir_ = lazy_exports("pkg", {"sqrt": ("math", "sqrt")}, ns)
        >>> getattr_("sqrt")(4.0), dir_()
        (2.0, ['sqrt'])
    """

    def __getattr__(name: str) -> Any:
        if name in table:
            module_name, attr = table[name]
            module = importlib.import_module(module_name)
            value = module if attr is None else getattr(module, attr)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(table)

    return __getattr__, __dir__
