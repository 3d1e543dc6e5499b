"""``deepspeed.utils.bwc``: read tensor- and pipeline-parallel sizes, ranks and groups from an ``mpu`` of any
vintage (Megatron's ``get_tensor_model_parallel_*`` / ``get_pipeline_model_parallel_*``, DeepSpeed's
topology ``get_slice_parallel_*`` / ``get_pipe_parallel_*``, the older ``get_model_parallel_*``).

Without an ``mpu`` they give the answers of a job without model parallelism (rank 0, size 1, no group).

Example:
    >>> class Megatron:
    ...     def get_tensor_model_parallel_world_size(self): return 2
    >>> bwc_tensor_model_parallel_world_size(Megatron()), bwc_tensor_model_parallel_world_size(None)
    (2, 1)
"""

from __future__ import annotations

from shardwise.comm.group_type import Group

__all__ = [
    "bwc_pipeline_parallel_group",
    "bwc_pipeline_parallel_world_size",
    "bwc_tensor_model_parallel_group",
    "bwc_tensor_model_parallel_rank",
    "bwc_tensor_model_parallel_world_size",
]


def _ask(mpu: object, what: str, spellings: tuple[str, ...]) -> object:
    for name in spellings:
        method = getattr(mpu, name, None)
        if method is not None:
            return method()
    raise AttributeError(f"the mpu {type(mpu).__name__} has none of {', '.join(spellings)}: cannot read its {what}")


def bwc_tensor_model_parallel_rank(mpu: object = None) -> int:
    """This rank's place in its tensor-parallel group (0 without an mpu)."""
    if mpu is None:
        return 0
    spellings = ("get_tensor_model_parallel_rank", "get_slice_parallel_rank", "get_model_parallel_rank")
    return int(_ask(mpu, "tensor-parallel rank", spellings))  # type: ignore[call-overload]


def bwc_tensor_model_parallel_world_size(mpu: object = None) -> int:
    """The tensor-parallel degree (1 without an mpu)."""
    if mpu is None:
        return 1
    spellings = (
        "get_tensor_model_parallel_world_size", "get_slice_parallel_world_size", "get_model_parallel_world_size"
    )
    return int(_ask(mpu, "tensor-parallel world size", spellings))  # type: ignore[call-overload]


def bwc_tensor_model_parallel_group(mpu: object = None) -> Group:
    """This rank's tensor-parallel group (None without an mpu)."""
    if mpu is None:
        return None
    spellings = ("get_tensor_model_parallel_group", "get_slice_parallel_group", "get_model_parallel_group")
    return _ask(mpu, "tensor-parallel group", spellings)  # type: ignore[return-value]


def bwc_pipeline_parallel_world_size(mpu: object = None) -> int:
    """The pipeline-parallel degree (1 without an mpu, or one that knows no pipeline)."""
    if mpu is None:
        return 1
    for name in ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size"):
        method = getattr(mpu, name, None)
        if method is not None:
            return int(method())
    return 1


def bwc_pipeline_parallel_group(mpu: object = None) -> Group:
    """This rank's pipeline-parallel group (None without an mpu); an mpu without one raises."""
    if mpu is None:
        return None
    spellings = ("get_pipeline_model_parallel_group", "get_pipe_parallel_group")
    return _ask(mpu, "pipeline-parallel group", spellings)  # type: ignore[return-value]
