"""``shardwise.checkpointing``: DeepSpeed's ``deepspeed.checkpointing`` (activation checkpointing).

A checkpointed block keeps only its inputs during the forward and is recomputed in backward,
trading compute for activation memory. The ``activation_checkpointing`` config section (which
``initialize`` applies, or :func:`configure` reads) decides how those inputs are kept:

* ``partition_activations``: split across the model-parallel group of the ``mpu``, all-gathered
  for the recompute (each of N ranks holds 1/N);
* ``cpu_checkpointing``: in host memory (pinned when a GPU exists), brought back for backward;
* ``contiguous_memory_optimization`` + ``number_checkpoints``: in one preallocated buffer;
* ``synchronize_checkpoint_boundary``: the device is synchronized at each boundary;
* ``profile``: forward and recompute times go to the wall-clock breakdown.

DeepSpeed's module globals (``PARTITION_ACTIVATIONS``, ``CONTIGUOUS_CHECKPOINTING``, ``CPU_CHECKPOINT``,
``SYNCHRONIZE``, ``PROFILE_TIME``, ``num_layers``, ``mpu``, ``mp_rank``/``mp_size``/``mp_group``,
``deepspeed_checkpointing_enabled``) read the active settings and, assigned, change them
(:mod:`shardwise.checkpointing.globals`).

Dropout and every other random draw repeat exactly in the recompute: the CPU and CUDA
generators and the Megatron-style RNG tracker's streams are saved and restored.

Example:
    >>> import torch
    >>> from shardwise import checkpointing
    >>> _ = checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"profile": True}})
    >>> layer = torch.nn.Linear(4, 4)
    >>> out = checkpointing.checkpoint(layer, torch.randn(2, 4, requires_grad=True))
    >>> out.sum().backward()
    >>> checkpointing.profile_times().recompute_calls >= 1
    True
    >>> _ = checkpointing.configure(None)
"""

from __future__ import annotations

from shardwise.checkpointing import globals as _globals
from shardwise.checkpointing.meter import SavedActivationMeter
from shardwise.checkpointing.profile import TIMES, CheckpointTimes
from shardwise.checkpointing.recompute import checkpoint, non_reentrant_checkpoint
from shardwise.checkpointing.rng import (
    MODEL_PARALLEL_RNG,
    RngStatesTracker,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_reconfigure_tp_seed,
)
from shardwise.checkpointing.settings import (
    CheckpointingSettings,
    configure,
    current_settings,
    describe,
    is_configured,
    partition_activations_in_checkpoint,
    set_num_layers,
)
from shardwise.checkpointing.storage import reset

CudaRNGStatesTracker = RngStatesTracker  # Megatron's name

__all__ = [
    "MODEL_PARALLEL_RNG",
    "CheckpointTimes",
    "CheckpointingSettings",
    "CudaRNGStatesTracker",
    "RngStatesTracker",
    "SavedActivationMeter",
    "checkpoint",
    "configure",
    "current_settings",
    "describe",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "profile_times",
    "reset",
    "set_num_layers",
]


def profile_times() -> CheckpointTimes:
    """Forward and recompute times recorded while ``profile`` is on."""
    return TIMES


_globals.install(__name__)  # DeepSpeed's module globals, live (see the module docstring)
