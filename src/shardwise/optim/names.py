"""The error for an ``optimizer.type`` that names no optimizer, with a did-you-mean."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

import torch

from shardwise.config.errors import KeyedValueError


def torch_optimizer_names() -> list[str]:
    """The ``torch.optim`` optimizer classes, by their exact (case-sensitive) names."""
    return sorted(
        name
        for name in dir(torch.optim)
        if isinstance(getattr(torch.optim, name), type)
        and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)
        and name != "Optimizer"
    )


def unknown_type_error(type_name: str, ours: Iterable[str]) -> KeyedValueError:
    """The error for ``type_name``, which is neither one of ``ours`` (any case) nor a torch.optim class.

    Example:
        >>> "'adam'" in unknown_type_error("Adma", ["adam", "adamw"]).as_config_error().fix
        True
    """
    ours = sorted(ours)
    torch_names = torch_optimizer_names()
    same_case = [n for n in torch_names if n.lower() == type_name.lower()]
    if same_case:
        hint = f' torch.optim names are case-sensitive: did you mean "{same_case[0]}"?'
    else:
        # our case-insensitive names win over torch's spelling of the same word
        lowered = {c.lower(): c for c in [*torch_names, *ours]}
        close = difflib.get_close_matches(type_name.lower(), list(lowered), n=3, cutoff=0.6)
        hint = f" Did you mean {', '.join(repr(lowered[c]) for c in close)}?" if close else ""
    return KeyedValueError(
        f'optimizer.type "{type_name}" is not a supported optimizer.{hint} Choices: '
        f"{', '.join(ours)} (any case), or a torch.optim class by its exact name: "
        f"{', '.join(torch_names)}.",
        "optimizer.type",
        type_name,
    )
