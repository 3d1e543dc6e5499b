"""The Ulysses mpu: ``deepspeed.runtime.sequence_parallel.parallel_state_sp``.

DeepSpeed's ALST builds its sequence-parallel groups here and hands this module to
``deepspeed.initialize(mpu=...)``. In shardwise the groups come from the one process layout:
:func:`initialize_sequence_parallel` declares ``sp`` with :func:`shardwise.comm.mesh.ensure_layout`
(consecutive ranks form a sequence-parallel group, DeepSpeed's order), and every getter reads the
registered layout. This module has no ``get_data_parallel_world_size``, so ``initialize`` reads it as
a Ulysses mpu (:func:`shardwise.comm.topology.build_topology`): the data-parallel degree is
``world / sp`` and ZeRO shards and averages over the sequence-data-parallel group (``sdp``).

Example (no process group: nothing is declared, the sizes are 1):
    >>> from shardwise.sequence import parallel_state as mpu
    >>> mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank()
    (1, 0)
"""

from __future__ import annotations

from shardwise.comm import groups
from shardwise.comm.group_type import Group

reads_process_layout = True
"""This mpu answers from the process layout (:mod:`shardwise.comm.mesh`): ``initialize`` reads the
layout directly instead of reading this module as a Ulysses mpu (so the model-parallel aliases below
do not make the sequence-parallel ranks model-parallel ones: ``engine.mp_world_size`` stays 1, as
in DeepSpeed)."""

__all__ = [
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_sequence_data_parallel_group",
    "get_sequence_data_parallel_rank",
    "get_sequence_data_parallel_world_size",
    "get_sequence_parallel_group",
    "get_sequence_parallel_rank",
    "get_sequence_parallel_world_size",
    "initialize_sequence_parallel",
]


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Declare a sequence-parallel degree of ``sequence_parallel_size`` in the process layout.

    Collective: every rank calls it. Declaring the degree the layout already has is a no-op.

    Raises:
        ValueError: the size is below 2, does not divide the world, or another part of the
            program declared a different ``sp`` degree (the error names both).
    """
    from shardwise.comm import mesh
    from shardwise.comm.init import get_world_size, is_initialized

    if not is_initialized():
        raise RuntimeError(
            f"initialize_sequence_parallel({sequence_parallel_size!r}): no process group yet; call "
            "deepspeed.init_distributed() (shardwise.init_distributed()) first, under a launcher"
        )
    world = get_world_size()
    if (
        isinstance(sequence_parallel_size, bool)
        or not isinstance(sequence_parallel_size, int)
        or sequence_parallel_size < 2
    ):
        raise ValueError(
            f"initialize_sequence_parallel(sequence_parallel_size={sequence_parallel_size!r}): it must be an int >= 2 "
            "(1 means no sequence parallelism: do not call it)"
        )
    if world % sequence_parallel_size:
        raise ValueError(
            f"initialize_sequence_parallel: the world size {world} is not divisible by sequence_parallel_size="
            f"{sequence_parallel_size}; launch a multiple of {sequence_parallel_size} ranks"
        )
    mesh.ensure_layout(
        sp=sequence_parallel_size, source=f"initialize_sequence_parallel({sequence_parallel_size})"
    )


def get_sequence_parallel_group() -> Group:
    """This rank's sequence-parallel group (None when the degree is 1)."""
    return groups.get_sequence_parallel_group()


def get_sequence_parallel_world_size() -> int:
    """The sequence-parallel degree."""
    return groups.get_sequence_parallel_world_size()


def get_sequence_parallel_rank() -> int:
    """This rank's place in its sequence-parallel group."""
    return groups.get_sequence_parallel_rank()


def get_sequence_data_parallel_group() -> Group:
    """The group ZeRO shards and averages over: data parallel x sequence parallel."""
    return groups.get_sequence_data_parallel_group()


def get_sequence_data_parallel_world_size() -> int:
    """The size of the sequence-data-parallel group."""
    return groups.get_sequence_data_parallel_world_size()


def get_sequence_data_parallel_rank() -> int:
    """This rank's place in the sequence-data-parallel group."""
    return groups.get_sequence_data_parallel_rank()


# DeepSpeed aliases the model-parallel questions to the sequence-parallel ones (one extra dimension).
get_model_parallel_group = get_sequence_parallel_group
get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
