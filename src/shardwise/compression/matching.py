"""Module-name matching as DeepSpeed's compression library does it.

A pattern matches a module when ``re.search(pattern, name)`` finds it anywhere in the module's
dotted name (so ``"attention.output"`` matches ``bert.encoder.layer.0.attention.output.dense``
and ``"layer.\\w+.output.dense"`` is a regular expression); ``"*"`` matches every module. Only
compressible modules (``Linear``, ``Conv2d``, ``Embedding``, or their compression-aware
replacements) are returned by :func:`match_modules`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

from shardwise.config.errors import ConfigError

__all__ = ["COMPRESSIBLE", "match_any_modules", "match_modules", "name_matches"]

COMPRESSIBLE: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv2d, nn.Embedding)


def name_matches(pattern: str, name: str, key: str = "modules") -> bool:
    """True when ``pattern`` (a regular expression, or ``"*"``) is found in ``name``.

    Example:
        >>> name_matches(r"layer.\\w+.output.dense", "bert.layer.3.output.dense")
        True
    """
    if pattern == "*":
        return True
    try:
        return re.search(pattern, name) is not None
    except re.error as err:
        raise ConfigError(
            key, f"is not a valid regular expression ({err})", "escape special characters", pattern
        ) from None


def _compressible(module: nn.Module) -> bool:
    from shardwise.compression.layers import CompressedModule

    return isinstance(module, (COMPRESSIBLE, CompressedModule))


def match_modules(
    model: nn.Module, patterns: Iterable[str], *, excluded: Iterable[str] = (), key: str = "modules"
) -> list[str]:
    """Names of the compressible modules of ``model`` some pattern matches, in model order.

    Args:
        model: the model to search.
        patterns: module-name patterns.
        excluded: patterns whose matches are left out (``excluded_modules``).
        key: the config key the patterns come from (named in errors).
    """
    patterns, excluded = list(patterns), list(excluded)
    return [
        name
        for name, module in model.named_modules()
        if name
        and _compressible(module)
        and any(name_matches(p, name, key) for p in patterns)
        and not any(name_matches(p, name, key) for p in excluded)
    ]


def match_any_modules(model: nn.Module, patterns: Iterable[str], key: str) -> list[str]:
    """Names of all modules (any type) some pattern matches: for related modules (batch norms)."""
    patterns = list(patterns)
    return [
        name
        for name, _ in model.named_modules()
        if name and any(name_matches(p, name, key) for p in patterns)
    ]
