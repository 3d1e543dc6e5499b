"""Checkpoints: DeepSpeed's save/load API on a topology-free, atomic, resumable format.

A checkpoint saved on N ranks at ZeRO stage k loads on M ranks at stage j, optimizer
state included, with no conversion step (:mod:`~shardwise.checkpoint.dcp_io`); saves are
atomic (:mod:`~shardwise.checkpoint.layout`); resume restores everything a step depends
on, RNG and data position included; exports stream tensor by tensor
(:mod:`~shardwise.checkpoint.export`); every file is checksummed and verified before a load
(:mod:`~shardwise.checkpoint.integrity`); DeepSpeed checkpoints import directly
(:mod:`~shardwise.checkpoint.deepspeed_import`). Names load lazily, so importing this
package does not import ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

from shardwise.utils.lazy import lazy_exports

_LAZY: dict[str, tuple[str, str]] = {
    "save_checkpoint": ("shardwise.checkpoint.engine_io", "save_checkpoint"),
    "load_checkpoint": ("shardwise.checkpoint.engine_io", "load_checkpoint"),
    "save_16bit_model": ("shardwise.checkpoint.engine_io", "save_16bit_model"),
    "wait_for_checkpoint": ("shardwise.checkpoint.engine_io", "wait_for_checkpoint"),
    "TrainingState": ("shardwise.checkpoint.training_state", "TrainingState"),
    "Checkpointer": ("shardwise.checkpoint.checkpointer", "Checkpointer"),
    "ParamOptimizerState": ("shardwise.checkpoint.param_state", "ParamOptimizerState"),
    "OptimizerState": ("shardwise.checkpoint.optimizer_state", "OptimizerState"),
    "export_checkpoint": ("shardwise.checkpoint.export", "export_checkpoint"),
    "checkpoint_info": ("shardwise.checkpoint.export", "checkpoint_info"),
    "load_full_state_dict": ("shardwise.checkpoint.export", "load_full_state_dict"),
    "read_deepspeed_checkpoint": ("shardwise.checkpoint.deepspeed_import", "read_deepspeed_checkpoint"),
    "verify_tag": ("shardwise.checkpoint.integrity", "verify_tag"),
    "CheckpointIntegrityError": ("shardwise.checkpoint.integrity", "CheckpointIntegrityError"),
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports("shardwise.checkpoint", _LAZY, globals())
