"""ZeRO: flat buffers, partition maths, bucketed gradient reduction, the sharded optimizer
(stages 0-2), stage 3 on FSDP2 (both behind the engine's one interface, ``ZeroStrategy``),
offload, ``Init``/``GatheredParameters`` and the memory plan.

``import shardwise.zero`` stays light: the torch-heavy names load on first use.

Example:
    >>> import shardwise
    >>> plan = shardwise.zero.estimate_model_states_memory(10_000_000, stage=3, world_size=8)
    >>> plan.bytes_per_param()
    2.0
"""

from __future__ import annotations

import importlib
from typing import Any

from shardwise.zero.partition import BucketPlan, FlatLayout, Slot, plan_layout

_LAZY: dict[str, tuple[str, str]] = {
    "Init": ("shardwise.zero.init_context", "Init"),
    "GatheredParameters": ("shardwise.zero.init_context", "GatheredParameters"),
    "register_external_parameter": ("shardwise.zero.external_params", "register_external_parameter"),
    "unregister_external_parameter": ("shardwise.zero.external_params", "unregister_external_parameter"),
    "ZeroParamStatus": ("shardwise.zero.init_context", "ZeroParamStatus"),
    "estimate_model_states_memory": ("shardwise.zero.memory_plan", "estimate_model_states_memory"),
    "ModelStatesMemory": ("shardwise.zero.memory_plan", "ModelStatesMemory"),
    "Stage3Optimizer": ("shardwise.zero.stage3", "Stage3Optimizer"),
    "ZeroStrategy": ("shardwise.zero.strategy", "ZeroStrategy"),
    "StepResult": ("shardwise.zero.strategy", "StepResult"),
    "safe_get_full_fp32_param": ("shardwise.zero.param_access", "safe_get_full_fp32_param"),
    "safe_get_full_grad": ("shardwise.zero.param_access", "safe_get_full_grad"),
    "safe_get_full_optimizer_state": ("shardwise.zero.param_access", "safe_get_full_optimizer_state"),
    "safe_get_local_fp32_param": ("shardwise.zero.param_access", "safe_get_local_fp32_param"),
    "safe_get_local_grad": ("shardwise.zero.param_access", "safe_get_local_grad"),
    "safe_get_local_optimizer_state": ("shardwise.zero.param_access", "safe_get_local_optimizer_state"),
    "safe_set_full_fp32_param": ("shardwise.zero.param_access", "safe_set_full_fp32_param"),
    "safe_set_full_grad": ("shardwise.zero.param_access", "safe_set_full_grad"),
    "safe_set_full_optimizer_state": ("shardwise.zero.param_access", "safe_set_full_optimizer_state"),
    "safe_set_local_fp32_param": ("shardwise.zero.param_access", "safe_set_local_fp32_param"),
    "safe_set_local_grad": ("shardwise.zero.param_access", "safe_set_local_grad"),
    "safe_set_local_optimizer_state": ("shardwise.zero.param_access", "safe_set_local_optimizer_state"),
}

__all__ = ["BucketPlan", "FlatLayout", "Slot", "plan_layout", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shardwise.zero' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
