"""``deepspeed.runtime.data_pipeline.data_routing.helper``: random-LTD's conversion and state-dict helpers.

``remove_random_ltd_state_dict`` and ``save_without_random_ltd`` are
:mod:`shardwise.data_efficiency.random_ltd`'s. ``convert_to_random_ltd(model, convert_type)`` wraps every
layer of ``convert_type`` as DeepSpeed's does, but on the model **before** ``initialize``: DeepSpeed's is
called on the engine after it (and starts the engine's random-LTD schedule there), while shardwise's
``initialize`` builds that schedule from the wrapped layers. Given an engine it raises saying so,
rather than wrapping layers no schedule would ever drive.
"""

from __future__ import annotations

from torch import nn

from shardwise.data_efficiency import random_ltd
from shardwise.data_efficiency.random_ltd import remove_random_ltd_state_dict, save_without_random_ltd
from shardwise.engine import ShardwiseEngine

__all__ = ["convert_to_random_ltd", "remove_random_ltd_state_dict", "save_without_random_ltd"]


def convert_to_random_ltd(model: nn.Module, convert_type: type[nn.Module]) -> nn.Module:
    """Wrap every ``convert_type`` layer of ``model`` in a random-LTD layer (DeepSpeed's signature).

    Raises:
        TypeError: ``model`` is an engine (convert the model before ``initialize``).
    """
    if isinstance(model, ShardwiseEngine):
        raise TypeError(
            "convert_to_random_ltd(engine, ...): shardwise builds the random-LTD schedule in initialize from the "
            "wrapped layers, so convert the model before initialize: "
            "model = convert_to_random_ltd(model, LayerClass); engine, *_ = deepspeed.initialize(model=model, ...)"
        )
    return random_ltd.convert_to_random_ltd(model, convert_type)
