"""Reading and replacing an attribute by its dotted path (``"blocks.1.attn"``) on a module tree.

DeepSpeed's ``recursive_getattr`` / ``recursive_setattr`` (``deepspeed.utils.module_utils``, also
``deepspeed.compression.helper``): clients swap a submodule found by ``named_modules()`` for a
wrapped or converted one.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU()))
    >>> recursive_setattr(model, "1.0", nn.Tanh())
    >>> recursive_getattr(model, "1.0")
    Tanh()
"""

from __future__ import annotations

from typing import Any

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: Any, module_name: str) -> Any:
    """The attribute ``module_name`` (dotted) of ``model``: ``getattr`` applied part by part.

    Raises:
        AttributeError: a part does not exist (as ``getattr`` raises it).
    """
    output = model
    for name in module_name.split("."):
        output = getattr(output, name)
    return output


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Set the attribute ``module_name`` (dotted) of ``model`` to ``module``: the parent is found
    with :func:`recursive_getattr`, then its last part is assigned (``nn.Module`` registers it)."""
    parent_path, _, leaf = module_name.rpartition(".")
    parent = recursive_getattr(model, parent_path) if parent_path else model
    parent.__setattr__(leaf, module)
