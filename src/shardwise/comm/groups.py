"""``utils.groups``-style accessors, all read from the one :class:`~shardwise.comm.topology.Topology`.

DeepSpeed code asks module-level functions for its groups (``deepspeed.utils.groups``:
``_get_data_parallel_group()``, ``_get_expert_parallel_world_size(name)``, ...). Here those
questions have one answer: the topology that :func:`shardwise.initialize` built and
registered with :func:`set_topology`. Before any engine is built (or after
:func:`clear_topology`) the layout is the world's pure data parallelism, which is what
DeepSpeed answers without an mpu.

A dimension of degree 1 has no group of its own: its accessors return ``None`` for the
group (torch's spelling of "the world" — so do not pass it to a collective; ask the size
first), 1 for the size and 0 for the rank. The pipeline and expert dimensions have groups when
a feature declared them through :func:`shardwise.comm.mesh.ensure_layout`.

Example:
    >>> from shardwise.comm import groups
    >>> groups.get_data_parallel_world_size(), groups.get_tensor_model_parallel_world_size()
    (1, 1)
"""

from __future__ import annotations

from shardwise.comm.group_type import Group
from shardwise.comm.topology import Topology, build_topology

__all__ = [
    "clear_topology",
    "current_topology",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_expert_data_parallel_group",
    "get_expert_data_parallel_rank",
    "get_expert_data_parallel_world_size",
    "get_expert_parallel_group",
    "get_expert_parallel_rank",
    "get_expert_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_pipeline_parallel_group",
    "get_pipeline_parallel_rank",
    "get_pipeline_parallel_world_size",
    "get_sequence_data_parallel_group",
    "get_sequence_data_parallel_rank",
    "get_sequence_data_parallel_world_size",
    "get_sequence_parallel_group",
    "get_sequence_parallel_rank",
    "get_sequence_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "set_topology",
]

_CURRENT: list[Topology] = []  # at most one: the layout of the engine built last


def set_topology(topology: Topology) -> None:
    """Make ``topology`` the layout every accessor here reads (``initialize`` calls this)."""
    _CURRENT[:] = [topology]


def clear_topology() -> None:
    """Forget the registered layout; accessors answer for the world's pure data parallelism again."""
    _CURRENT.clear()


def current_topology() -> Topology:
    """The registered layout, or the world's pure data parallelism when none is registered."""
    return _CURRENT[0] if _CURRENT else build_topology()


# ------------------------------------------------------------------------------ data parallel
def get_data_parallel_group() -> Group:
    """The data-parallel group (None: the world)."""
    return current_topology().dp_group


def get_data_parallel_world_size() -> int:
    """The data-parallel degree (the ``world_size`` of the batch arithmetic)."""
    return current_topology().dp_size


def get_data_parallel_rank() -> int:
    """This rank's place in the data-parallel group."""
    return current_topology().dp_rank


# ----------------------------------------------------------------------- model / tensor parallel
def get_model_parallel_group() -> Group:
    """The model-parallel group (None without model parallelism)."""
    return current_topology().mp_group


def get_model_parallel_world_size() -> int:
    """The model-parallel degree (1 without an mpu)."""
    return current_topology().mp_size


def get_model_parallel_rank() -> int:
    """This rank's place in the model-parallel group."""
    return current_topology().mp_rank


get_tensor_model_parallel_group = get_model_parallel_group
get_tensor_model_parallel_world_size = get_model_parallel_world_size
get_tensor_model_parallel_rank = get_model_parallel_rank


# ---------------------------------------------------------------------------- pipeline parallel
def get_pipeline_parallel_group() -> Group:
    """The pipeline-parallel group (None with one stage, or when it spans the world)."""
    return current_topology().group_of("pp")


def get_pipeline_parallel_world_size() -> int:
    """The number of pipeline stages (``dims.pp``)."""
    return current_topology().size_of("pp")


def get_pipeline_parallel_rank() -> int:
    """This rank's pipeline stage."""
    return current_topology().rank_in("pp")


# ---------------------------------------------------------------------------- sequence parallel
def get_sequence_parallel_group() -> Group:
    """The sequence-parallel group (None without Ulysses)."""
    return current_topology().sp_group


def get_sequence_parallel_world_size() -> int:
    """The sequence-parallel degree (1 without Ulysses)."""
    return current_topology().sp_size


def get_sequence_parallel_rank() -> int:
    """This rank's place in the sequence-parallel group."""
    return current_topology().sp_rank


def get_sequence_data_parallel_group() -> Group:
    """The group ZeRO shards over: data parallel, times sequence parallel under Ulysses."""
    return current_topology().shard_group


def get_sequence_data_parallel_world_size() -> int:
    """The size of the sequence-data-parallel group."""
    return current_topology().shard_size


def get_sequence_data_parallel_rank() -> int:
    """This rank's place in the sequence-data-parallel group."""
    return current_topology().shard_rank


# ------------------------------------------------------------------------------ expert parallel
def get_expert_parallel_group() -> Group:
    """The expert-parallel group (None while the expert dimension is 1)."""
    return current_topology().group_of("ep")


def get_expert_parallel_world_size() -> int:
    """The expert-parallel degree (``dims.ep``)."""
    return current_topology().size_of("ep")


def get_expert_parallel_rank() -> int:
    """This rank's place in the expert-parallel group."""
    return current_topology().rank_in("ep")


def _expert_data(topology: Topology) -> str:
    # A layout from the mesh names the expert-data-parallel group; one read from an mpu has no
    # expert dimension, so expert parameters average like any other, over the data-parallel group.
    if topology.groups:
        return "edp"
    if topology.dims.ep > 1:
        raise ValueError(
            f"expert-parallel degree {topology.dims.ep}: a layout read from an mpu has no expert groups; "
            "declare the layout with shardwise.comm.mesh.ensure_layout(ep=...) (the one owner of the layout)"
        )
    return "dp"


def get_expert_data_parallel_group() -> Group:
    """The group expert parameters are averaged over (the data-parallel one while ``ep`` is 1)."""
    topology = current_topology()
    return topology.group_of(_expert_data(topology))


def get_expert_data_parallel_world_size() -> int:
    """The expert-data-parallel degree."""
    topology = current_topology()
    return topology.size_of(_expert_data(topology))


def get_expert_data_parallel_rank() -> int:
    """This rank's place in the expert-data-parallel group."""
    topology = current_topology()
    return topology.rank_in(_expert_data(topology))
