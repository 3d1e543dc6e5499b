"""``utils.groups``-style accessors, all read from the one :class:`~shardwise.comm.topology.Topology`.

DeepSpeed code asks module-level functions for its groups (``deepspeed.utils.groups``:
``_get_data_parallel_group()``, ``_get_expert_parallel_world_size(name)``, ...). Here those
questions have one answer: the topology that :func:`shardwise.initialize` built and
registered with :func:`set_topology`. Before any engine is built (or after
:func:`clear_topology`) the layout is the world's pure data parallelism, which is what
DeepSpeed answers without an mpu.

A dimension of degree 1 has no group of its own: its accessors return ``None`` for the
group (torch's spelling of "the world" — so do not pass it to a collective; ask the size
first), 1 for the size and 0 for the rank. The expert-parallel dimension is 1 today, so the
expert-data-parallel group is the data-parallel one.

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
    """The pipeline-parallel group: None today (no pipeline dimension has a group yet)."""
    return None


def get_pipeline_parallel_world_size() -> int:
    """The pipeline degree the layout records (``dims.pp``: what an mpu's groups leave over)."""
    return current_topology().dims.pp


def get_pipeline_parallel_rank() -> int:
    """This rank's pipeline stage: 0 while the pipeline dimension has no group."""
    return 0


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
    """The expert-parallel group: None while the expert dimension is 1."""
    return None


def get_expert_parallel_world_size() -> int:
    """The expert-parallel degree (``dims.ep``; 1 today)."""
    return current_topology().dims.ep


def get_expert_parallel_rank() -> int:
    """This rank's place in the expert-parallel group: 0 while the dimension is 1."""
    return 0


def _data_parallel_for_experts() -> Topology:
    topology = current_topology()
    if topology.dims.ep > 1:
        raise ValueError(
            f"expert-parallel degree {topology.dims.ep}: the expert dimension has no groups yet; "
            "add them in shardwise.comm.topology (the one owner of the layout) before asking for them"
        )
    return topology


def get_expert_data_parallel_group() -> Group:
    """The group expert parameters are averaged over: the data-parallel group while ``ep`` is 1."""
    return _data_parallel_for_experts().dp_group


def get_expert_data_parallel_world_size() -> int:
    """The expert-data-parallel degree: the data-parallel degree while ``ep`` is 1."""
    return _data_parallel_for_experts().dp_size


def get_expert_data_parallel_rank() -> int:
    """This rank's place in the expert-data-parallel group."""
    return _data_parallel_for_experts().dp_rank
