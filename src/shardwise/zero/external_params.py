"""``register_external_parameter``: a module uses a parameter another module registers.

FSDP2 needs no hooks for such a parameter, as long as it is gathered when the using module
runs. Registering it before ``initialize`` keeps it in the root shard unit, which stays
gathered through forward and backward. After ``initialize`` it is a no-op when that already
holds, and an error otherwise. Registrations live in a weak registry keyed by the parameter
object (no attribute is set on the parameter).
"""

from __future__ import annotations

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from shardwise.utils.logging import logger
from shardwise.zero.sharded_model import record_of

# parameter -> True, for the parameters registered as external (weakly held)
_EXTERNAL: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that ``module`` uses ``parameter`` though another module registers it.

    Before ``initialize`` the parameter is kept in the root shard unit (gathered through
    the whole forward and backward); afterwards this is a no-op if it already is, and an
    error otherwise (FSDP2 needs no per-module hooks, only the right unit).

    Example:
        >>> import torch
        >>> head = torch.nn.Linear(4, 4)
        >>> register_external_parameter(head, head.weight)
        >>> is_external(head.weight)
        True
    """
    record = record_of(parameter)
    if record is not None and not record.in_root_unit(parameter):
        raise ValueError(
            "register_external_parameter after initialize: the parameter is sharded in a unit of its own "
            "and would not be gathered when the using module runs; call it before shardwise.initialize"
        )
    _EXTERNAL[parameter] = True
    logger.debug("external parameter registered on %s", type(module).__name__)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo :func:`register_external_parameter` (before ``initialize``)."""
    _EXTERNAL.pop(parameter, None)


def is_external(parameter: nn.Parameter) -> bool:
    """Whether the parameter was registered as external."""
    return parameter in _EXTERNAL
