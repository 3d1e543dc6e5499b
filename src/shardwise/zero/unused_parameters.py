"""``ignore_unused_parameters: false``: the error naming the parameters that got no gradient (pure).

DeepSpeed raises when a trainable parameter received no gradient in an accumulation
window and ``zero_optimization.ignore_unused_parameters`` is false; shardwise checks at the
optimizer step (every stage) and raises :class:`UnusedParametersError` with their names.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any

_SHOWN = 20


class UnusedParametersError(RuntimeError, AssertionError):
    """Trainable parameters got no gradient while ``ignore_unused_parameters`` is false.

    Also an ``AssertionError``: DeepSpeed raises that type for this mistake, and its callers catch it.
    """


def unused_parameters_error(names: Sequence[str]) -> UnusedParametersError:
    """The error for ``names`` (the parameters without a gradient), with the key, the rule and the fixes.

    Example:
        >>> print(unused_parameters_error(["head.bias"]))  # doctest: +ELLIPSIS
        zero_optimization.ignore_unused_parameters = false: 1 trainable parameter got no gradient ...
    """
    listed = ", ".join(names[:_SHOWN]) + (
        f", ... ({len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
    )
    plural = "parameter" if len(names) == 1 else "parameters"
    return UnusedParametersError(
        f"zero_optimization.ignore_unused_parameters = false: {len(names)} trainable {plural} got no gradient "
        f"in this accumulation window: {listed}. Rule: with false, every trainable parameter must take part in "
        "the loss. Fix: use them in forward, freeze them (requires_grad=False), or set "
        "zero_optimization.ignore_unused_parameters to true (their gradient is then zero)"
    )


def raise_if_unused(params: Iterable[Any], used: Container[int], names: Mapping[int, str] | None) -> None:
    """Raise :func:`unused_parameters_error` for the ``params`` whose ``id`` is not in ``used``, named
    by ``names`` (``id(parameter) -> name``; the shape where a name is unknown)."""
    known = names or {}
    missing = [known.get(id(p), f"<unnamed, shape {tuple(p.shape)}>") for p in params if id(p) not in used]
    if missing:
        raise unused_parameters_error(missing)
