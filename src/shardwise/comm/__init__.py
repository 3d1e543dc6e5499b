"""The only door to ``torch.distributed``: process group, topology, collectives.

DeepSpeed-compatible names (``deepspeed.comm``) where they exist, so
``import shardwise.comm as dist`` reads like DeepSpeed code. Importing this package does
not import torch: names load on first use, so the pure environment discovery in
:mod:`shardwise.comm.env` stays usable (and fast) without torch.

Example:
    >>> import shardwise.comm as comm
    >>> # comm.init_distributed()
    >>> # comm.get_rank(), comm.get_world_size()
    >>> # -> (0, 1)
"""

from __future__ import annotations

from shardwise.utils.lazy import lazy_exports

# public name -> (module, attribute)
_LAZY: dict[str, tuple[str, str | None]] = {
    # environment (pure)
    "DistEnv": ("shardwise.comm.env", "DistEnv"),
    "discover_environment": ("shardwise.comm.env", "discover_environment"),
    "expand_nodelist": ("shardwise.comm.env", "expand_nodelist"),
    "timeout_from_env": ("shardwise.comm.env", "timeout_from_env"),
    # process group
    "init_distributed": ("shardwise.comm.init", "init_distributed"),
    "is_initialized": ("shardwise.comm.init", "is_initialized"),
    "get_rank": ("shardwise.comm.init", "get_rank"),
    "get_world_size": ("shardwise.comm.init", "get_world_size"),
    "get_local_rank": ("shardwise.comm.init", "get_local_rank"),
    "get_global_rank": ("shardwise.comm.init", "get_global_rank"),
    "group_ranks": ("shardwise.comm.init", "group_ranks"),
    "get_backend": ("shardwise.comm.init", "get_backend"),
    "get_world_group": ("shardwise.comm.init", "get_world_group"),
    "group_source_rank": ("shardwise.comm.init", "group_source_rank"),
    "new_group": ("shardwise.comm.init", "new_group"),
    "barrier": ("shardwise.comm.init", "barrier"),
    # hang diagnosis
    "check_all_ranks_arrive": ("shardwise.comm.diagnostics", "check_all_ranks_arrive"),
    "RanksDidNotArriveError": ("shardwise.comm.diagnostics", "RanksDidNotArriveError"),
    "destroy_process_group": ("shardwise.comm.init", "destroy_process_group"),
    # topology
    "Topology": ("shardwise.comm.topology", "Topology"),
    "build_topology": ("shardwise.comm.topology", "build_topology"),
    "ParallelDims": ("shardwise.comm.parallel_dims", "ParallelDims"),
    "Group": ("shardwise.comm.group_type", "Group"),
    "groups": ("shardwise.comm.groups", None),
    # collectives
    "CommHandle": ("shardwise.comm.collectives", "CommHandle"),
    "all_reduce": ("shardwise.comm.collectives", "all_reduce"),
    "inference_all_reduce": ("shardwise.comm.collectives", "inference_all_reduce"),
    "reduce_scatter_flat": ("shardwise.comm.collectives", "reduce_scatter_flat"),
    "reduce_scatter_ranges": ("shardwise.comm.collectives", "reduce_scatter_ranges"),
    "all_gather_flat": ("shardwise.comm.collectives", "all_gather_flat"),
    "reduce_scatter_tensor": ("shardwise.comm.collectives", "reduce_scatter_tensor"),
    "all_gather_into_tensor": ("shardwise.comm.collectives", "all_gather_into_tensor"),
    "broadcast": ("shardwise.comm.collectives", "broadcast"),
    "broadcast_into": ("shardwise.comm.collectives", "broadcast_into"),
    "all_reduce_max_flag": ("shardwise.comm.collectives", "all_reduce_max_flag"),
    "choose_algorithm": ("shardwise.comm.collectives", "choose_algorithm"),
    "all_to_all_single": ("shardwise.comm.torch_api", "all_to_all_single"),
    "all_to_all": ("shardwise.comm.torch_api", "all_to_all"),
    "gather": ("shardwise.comm.torch_api", "gather"),
    "scatter": ("shardwise.comm.torch_api", "scatter"),
    "all_reduce_coalesced": ("shardwise.comm.torch_api", "all_reduce_coalesced"),
    "all_gather_coalesced": ("shardwise.comm.torch_api", "all_gather_coalesced"),
    "allgather_fn": ("shardwise.comm.torch_api", "allgather_fn"),
    "reduce_scatter_fn": ("shardwise.comm.torch_api", "reduce_scatter_fn"),
    "has_all_gather_into_tensor": ("shardwise.comm.torch_api", "has_all_gather_into_tensor"),
    "has_reduce_scatter_tensor": ("shardwise.comm.torch_api", "has_reduce_scatter_tensor"),
    "has_all_reduce_coalesced": ("shardwise.comm.torch_api", "has_all_reduce_coalesced"),
    "has_coalescing_manager": ("shardwise.comm.torch_api", "has_coalescing_manager"),
    "send": ("shardwise.comm.point_to_point", "send"),
    "recv": ("shardwise.comm.point_to_point", "recv"),
    "isend": ("shardwise.comm.point_to_point", "isend"),
    "irecv": ("shardwise.comm.point_to_point", "irecv"),
    "P2POp": ("shardwise.comm.point_to_point", "P2POp"),
    "batch_isend_irecv": ("shardwise.comm.point_to_point", "batch_isend_irecv"),
    "all_gather_object": ("shardwise.comm.object_api", "all_gather_object"),
    "broadcast_object_list": ("shardwise.comm.object_api", "broadcast_object_list"),
    "monitored_barrier": ("shardwise.comm.object_api", "monitored_barrier"),
    "get_all_ranks_from_group": ("shardwise.comm.object_api", "get_all_ranks_from_group"),
    "is_available": ("shardwise.comm.object_api", "is_available"),
    "ReduceOp": ("torch.distributed", "ReduceOp"),
    "ProcessGroup": ("torch.distributed", "ProcessGroup"),
    # launcher environment (pure)
    "get_local_rank_from_launcher": ("shardwise.comm.launcher_env", "get_local_rank_from_launcher"),
    "get_world_rank_from_launcher": ("shardwise.comm.launcher_env", "get_world_rank_from_launcher"),
    "get_world_size_from_launcher": ("shardwise.comm.launcher_env", "get_world_size_from_launcher"),
    "in_aml": ("shardwise.comm.launcher_env", "in_aml"),
    "in_aws_sm": ("shardwise.comm.launcher_env", "in_aws_sm"),
    "in_dlts": ("shardwise.comm.launcher_env", "in_dlts"),
    # comms logger (``comms_logger`` section)
    "configure": ("shardwise.comm.comms_logger", "configure"),
    "configure_comms_logger": ("shardwise.comm.comms_logger", "configure_comms_logger"),
    "log_summary": ("shardwise.comm.comms_logger", "log_summary"),
    "reset_log": ("shardwise.comm.comms_logger", "reset_log"),
    "has_comm_data": ("shardwise.comm.comms_logger", "has_comm_data"),
    "get_comm_operation_count": ("shardwise.comm.comms_logger", "get_comm_operation_count"),
    "get_logged_comm_ops": ("shardwise.comm.comms_logger", "get_logged_comm_ops"),
    "CommsLogger": ("shardwise.comm.comms_logger", "CommsLogger"),
    "timed_op": ("shardwise.comm.op_logging", "timed_op"),
    "get_caller_func": ("shardwise.comm.op_logging", "get_caller_func"),
    "get_debug_log_name": ("shardwise.comm.op_logging", "get_debug_log_name"),
    "get_default_args": ("shardwise.comm.op_logging", "get_default_args"),
    "get_msg_size_from_args": ("shardwise.comm.op_logging", "get_msg_size_from_args"),
    "get_tensor_kwarg": ("shardwise.comm.op_logging", "get_tensor_kwarg"),
    "get_tensor_position": ("shardwise.comm.op_logging", "get_tensor_position"),
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports("shardwise.comm", _LAZY, globals())
