"""The backend and keyword arguments ``engine.compile()`` hands to ``torch.compile``, checked first.

``torch.compile`` only looks at its backend when the first call compiles, deep inside a training
step; these checks fail at ``engine.compile()`` instead, naming the argument, the value, the rule
and the fix. ``torch._dynamo`` is imported here only when a check runs (``import shardwise`` stays
instant).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from shardwise.utils.logging import logger


def known_backends() -> list[str]:
    """Every registered ``torch.compile`` backend name (debug backends such as ``eager`` and
    ``aot_eager`` included)."""
    import torch._dynamo

    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def checked_backend(backend: str | Callable[..., Any], source: str = "backend") -> str | Callable[..., Any]:
    """``backend`` when it is a callable or a registered name.

    Raises:
        ValueError: an unknown name or a value of another type, naming the registered ones.
    """
    if callable(backend):
        return backend
    known = known_backends()
    if not isinstance(backend, str) or backend not in known:
        raise ValueError(
            f"{source} = {backend!r}: not a torch.compile backend (registered: {', '.join(known)}); "
            "fix: pass one of those names or a callable backend, e.g. backend='inductor'"
        )
    return backend


def torch_compile_kwargs(kwargs: Mapping[str, Any] | None, source: str = "compile_kwargs") -> dict[str, Any]:
    """The keyword arguments for ``torch.compile``, ``backend`` taken out (the ``backend`` argument
    wins, with a warning, as in DeepSpeed).

    Example:
        >>> torch_compile_kwargs({"fullgraph": True})
        {'fullgraph': True}

    Raises:
        ValueError: a key ``torch.compile`` does not take, naming the ones it does.
    """
    import torch

    given = dict(kwargs or {})
    if "backend" in given:
        logger.warning(
            "%s['backend'] = %r is overridden by the backend argument of engine.compile() (as in DeepSpeed)",
            source,
            given.pop("backend"),
        )
    accepted = [
        name
        for name, p in inspect.signature(torch.compile).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "backend"
    ]
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        raise ValueError(
            f"{source}[{unknown[0]!r}] = {given[unknown[0]]!r}: not a torch.compile argument "
            f"(it takes {', '.join(accepted)}); fix: remove it or use one of those names"
        )
    return given
