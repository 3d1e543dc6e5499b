"""What ``initialize`` does with ``compression_training``: check the ZeRO stage, prepare the model.

The stage rule itself is model-free and lives in :mod:`shardwise.config.compression_settings`
(``config check`` runs it too).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.compression.compress import init_compression
from shardwise.config.compression_settings import check_zero_stage as check_stage
from shardwise.config.errors import ConfigError

__all__ = ["check_zero_stage", "prepare_for_engine"]


def check_zero_stage(loaded: Any) -> None:
    """Raise ConfigError when an enabled technique cannot run at the configured ZeRO stage
    (:func:`shardwise.config.compression_settings.check_zero_stage`)."""
    from shardwise.compression.compress import compression_settings

    check_stage(compression_settings(loaded), loaded.config.zero_stage)


def _listed(model_parameters: object) -> set[int] | None:
    """The ids of the parameters in a list/tuple ``model_parameters`` (None for an iterator: not
    inspected, so it is not consumed)."""
    if not isinstance(model_parameters, (list, tuple)):
        return None
    out: set[int] = set()
    for item in model_parameters:
        if isinstance(item, dict):
            if not isinstance(item.get("params"), (list, tuple)):
                return None
            out.update(id(p) for p in item["params"])
        else:
            out.add(id(item))
    return out


def prepare_for_engine(
    model: nn.Module, loaded: object, client_optimizer: object, model_parameters: object = None
) -> None:
    """Check the stage and run ``init_compression`` (a no-op on a model already prepared).

    Raises:
        ConfigError: see :func:`check_zero_stage`; or the learnable scores ``init_compression``
            adds (method ``topk``) would not train: a client optimizer, or a parameter list,
            built before they existed.
    """
    check_zero_stage(loaded)
    before = {id(p) for p in model.parameters()}
    init_compression(model, loaded)
    added = [n for n, p in model.named_parameters() if id(p) not in before]
    if not added:
        return
    listed = _listed(model_parameters)
    if isinstance(client_optimizer, torch.optim.Optimizer) or (
        listed is not None and not listed >= {id(p) for n, p in model.named_parameters() if n in added}
    ):
        raise ConfigError(
            "compression_training",
            f"method 'topk' adds learnable scores ({', '.join(added[:3])}{', ...' if len(added) > 3 else ''}) "
            "that the optimizer or model_parameters passed to initialize were built without",
            "call shardwise.compression.compress.init_compression(model, config) before collecting the "
            "parameters and building the optimizer, or pass model_parameters=model.parameters()",
        )
