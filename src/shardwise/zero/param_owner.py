"""Which ZeRO strategy trains a parameter: a weak registry filled by the strategies themselves.

Every strategy (``ZeroOptimizer`` for stages 0-2, ``Stage3Optimizer``) calls :func:`register_owner`
for the parameters it trains when it is built. Code that starts from a bare parameter
(``deepspeed.utils.safe_get_full_fp32_param`` and its siblings, :mod:`shardwise.zero.param_access`)
asks :func:`owner_of`. The registry holds the parameters and the strategies weakly: it never keeps
a model or an engine alive, and a parameter of an engine that is gone has no owner.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from shardwise.zero.sharded_model import record_of

if TYPE_CHECKING:
    from shardwise.zero.strategy import ZeroStrategy

_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> weakref(strategy)


def register_owner(strategy: ZeroStrategy, params: Iterable[torch.Tensor]) -> None:
    """Record ``strategy`` as the one that trains each of ``params`` (replacing an earlier owner)."""
    ref = weakref.ref(strategy)
    for param in params:
        _OWNERS[param] = ref


def owner_of(param: torch.Tensor) -> ZeroStrategy | None:
    """The live strategy that trains ``param``; None when none does (frozen, or not given to one).

    At stage 3 the user's original parameter objects, which sharding replaced, are found too.

    Example:
        >>> owner_of(torch.nn.Linear(2, 2).weight) is None
        True
    """
    ref = _OWNERS.get(param)
    if ref is None:
        record = record_of(param)
        if record is not None:
            ref = _OWNERS.get(record.resolve(cast(nn.Parameter, param)))
    return None if ref is None else ref()
