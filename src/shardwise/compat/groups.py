"""``deepspeed.utils.groups``: the data, model, sequence and expert parallel groups, read from shardwise's
one owner of the process layout, the topology :mod:`shardwise.comm.groups` holds (the one the last
``initialize`` registered); nothing here creates a group.

The layout is the world's (pure data parallelism) unless an engine was built with an ``mpu`` or
:func:`initialize` here was given one (DeepSpeed's / Megatron's model-parallel unit); the layout read
from it is registered for every reader, as ``initialize`` does. A group of
``None`` is the world group, as in torch. Expert groups (``deepspeed.moe``) are declared to
:mod:`shardwise.comm.mesh` (``ep``), which builds them; DeepSpeed's group names (``"ep_size_<N>"``)
all read that one layout. :func:`_get_expert_parallel_ranks` is the pure rank arithmetic of
DeepSpeed's expert layout.
"""

from __future__ import annotations

from shardwise.comm import groups as _comm
from shardwise.comm import mesh as _mesh
from shardwise.comm.group_type import Group
from shardwise.comm.topology import build_topology


def initialize(ep_size: int = 1, mpu: object = None) -> None:
    """Register the layout ``mpu`` describes (none: keep the current one); ``ep_size`` > 1 declares
    the expert dimension to the process layout (collective); both at once are refused."""
    if mpu is not None and ep_size > 1:
        raise ValueError(
            f"deepspeed.utils.groups.initialize(ep_size={ep_size}, mpu=...): shardwise builds expert groups "
            "in its own process layout, not from an mpu; fix: call it without mpu"
        )
    if ep_size > 1:
        _declare_experts("groups.initialize", ep_size)
    if mpu is not None:
        _comm.set_topology(build_topology(mpu))


def _declare_experts(name: str, expert_parallel_size: int) -> None:
    """``ep`` declared to the one process layout (collective; a different earlier degree raises)."""
    _mesh.ensure_layout(ep=expert_parallel_size, source=f"deepspeed.utils.groups.{name}({expert_parallel_size})")


def _ensure_divisibility(numerator: int, denominator: int) -> None:
    """Raise ``AssertionError`` unless ``denominator`` divides ``numerator``."""
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"


# DeepSpeed's names (both the private ``_get_*`` spellings its code calls and the public ones), each the
# accessor of shardwise.comm.groups that reads the same dimension of the registered topology
_get_data_parallel_group = get_data_parallel_group = _comm.get_data_parallel_group
_get_data_parallel_world_size = get_data_parallel_world_size = _comm.get_data_parallel_world_size
_get_data_parallel_rank = get_data_parallel_rank = _comm.get_data_parallel_rank
_get_model_parallel_world_size = _comm.get_model_parallel_world_size
get_model_parallel_group = get_tensor_model_parallel_group = _comm.get_model_parallel_group
get_model_parallel_world_size = get_tensor_model_parallel_world_size = _comm.get_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank = _comm.get_model_parallel_rank


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of this rank's tensor-parallel group's first member (the source of its broadcasts)."""
    from shardwise.comm.init import get_rank, group_source_rank

    if _comm.get_model_parallel_world_size() == 1:
        return get_rank()
    return group_source_rank(_comm.get_model_parallel_group())
_get_sequence_parallel_group = _comm.get_sequence_parallel_group
_get_sequence_parallel_world_size = _comm.get_sequence_parallel_world_size
_get_sequence_parallel_rank = _comm.get_sequence_parallel_rank
_get_sequence_data_parallel_group = _comm.get_sequence_data_parallel_group
_get_sequence_data_parallel_world_size = _comm.get_sequence_data_parallel_world_size
_get_sequence_data_parallel_rank = _comm.get_sequence_data_parallel_rank


def _get_expert_parallel_world_size(group_name: str = "") -> int:
    """The expert-parallel degree (1: without MoE every rank holds every expert)."""
    return _comm.get_expert_parallel_world_size()


def _get_expert_parallel_rank(group_name: str = "") -> int:
    """This rank's place in its expert group (0 without MoE)."""
    return _comm.get_expert_parallel_rank()


def _get_expert_data_parallel_world_size(group_name: str = "") -> int:
    """Without MoE, the data-parallel degree."""
    return _comm.get_expert_data_parallel_world_size()


def _get_expert_data_parallel_rank(group_name: str = "") -> int:
    """Without MoE, the data-parallel rank."""
    return _comm.get_expert_data_parallel_rank()


def _get_expert_parallel_ranks(
    world_size: int,
    tensor_parallel_size_: int,
    expert_parallel_size_: int,
    pipeline_parallel_size_: int = 1,
    use_data_before_expert_parallel_: bool = False,
) -> tuple[list[list[int]], list[list[int]]]:
    """DeepSpeed's expert layout as rank lists: (expert-parallel groups, expert-data-parallel groups).

    Each pipeline stage's data-parallel groups (ranks with the same tensor-parallel index) are cut into
    consecutive runs of ``expert_parallel_size_`` (the expert groups); the ranks at the same position of
    those runs form an expert-data-parallel group. With ``use_data_before_expert_parallel_`` a
    data-parallel group is ordered data-first (its ranks transposed as an ``expert x data`` grid).

    Example:
        >>> _get_expert_parallel_ranks(8, 2, 2)
        ([[0, 2], [4, 6], [1, 3], [5, 7]], [[0, 4], [2, 6], [1, 5], [3, 7]])
    """
    _ensure_divisibility(world_size, tensor_parallel_size_ * pipeline_parallel_size_)
    dp_size = world_size // (tensor_parallel_size_ * pipeline_parallel_size_)
    _ensure_divisibility(dp_size, expert_parallel_size_)
    stage_size = world_size // pipeline_parallel_size_
    expert_groups: list[list[int]] = []
    expert_data_groups: list[list[int]] = []
    for stage_start in range(0, world_size, stage_size):
        for tp_index in range(tensor_parallel_size_):
            dp_ranks = list(range(stage_start + tp_index, stage_start + stage_size, tensor_parallel_size_))
            if use_data_before_expert_parallel_:
                stride = dp_size // expert_parallel_size_
                dp_ranks = [
                    dp_ranks[d + e * stride] for d in range(stride) for e in range(expert_parallel_size_)
                ]
            runs = [dp_ranks[i : i + expert_parallel_size_] for i in range(0, dp_size, expert_parallel_size_)]
            expert_groups.extend(runs)
            expert_data_groups.extend([list(position) for position in zip(*runs)])
    return expert_groups, expert_data_groups


def _create_expert_and_data_parallel(
    expert_parallel_size_: int, use_data_before_expert_parallel_: bool = False
) -> None:
    """Declare ``ep`` to the process layout (size 1 needs no group: the data-parallel ones serve);
    ``use_data_before_expert_parallel_`` is refused (the layout puts expert ranks consecutive)."""
    if use_data_before_expert_parallel_:
        raise ValueError(
            "deepspeed.utils.groups._create_expert_and_data_parallel(use_data_before_expert_parallel_=True): "
            "shardwise's layout makes expert groups of consecutive ranks only; fix: leave it False"
        )
    if expert_parallel_size_ > 1:
        _declare_experts("_create_expert_and_data_parallel", expert_parallel_size_)


def _get_expert_parallel_group(group_name: str = "") -> Group:
    """This rank's expert-parallel group (one layout: every group name reads it)."""
    return _comm.get_expert_parallel_group()


def _get_expert_data_parallel_group(group_name: str = "") -> Group:
    """This rank's expert-data-parallel group (the data-parallel one without expert parallelism)."""
    return _comm.get_expert_data_parallel_group()


def _expert_group_name() -> str:
    return f"ep_size_{_comm.get_expert_parallel_world_size()}"


def _get_expert_parallel_group_dict() -> dict[str, Group]:
    """``{"ep_size_<N>": group}`` for the declared expert layout (empty without one)."""
    declared = _mesh.declared_degrees().get("ep", 1)
    return {_expert_group_name(): _comm.get_expert_parallel_group()} if declared > 1 else {}


def _get_expert_data_parallel_group_dict() -> dict[str, Group]:
    """``{"ep_size_<N>": expert-data-parallel group}`` for the declared expert layout (empty without one)."""
    declared = _mesh.declared_degrees().get("ep", 1)
    return {_expert_group_name(): _comm.get_expert_data_parallel_group()} if declared > 1 else {}
