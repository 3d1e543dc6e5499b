"""Where each ``deepspeed.<path>`` is found in shardwise: the forwarding table.

``SOURCES[path]`` lists the shardwise modules searched, in order, for ``deepspeed.<path>.<name>``.
A path with no entry falls back to the shardwise module of the same dotted path
(``deepspeed.checkpointing`` -> ``shardwise.checkpointing``, ``deepspeed.compression`` ->
``shardwise.compression``, ``deepspeed.ops.sparse_attention`` -> ``shardwise.ops.sparse_attention``)
when it exists, so a module added to shardwise reaches the clients without a new entry here.
``RENAMES`` maps single names whose shardwise spelling differs.
"""

from __future__ import annotations

ROOT = "deepspeed"
"""The package name the clients import."""

DEEPSPEED_VERSION = "0.19.8"
"""The DeepSpeed release whose API and config shardwise follows; the compatibility package's version
is ``<this>+shardwise.<shardwise version>`` so clients' version checks (accelerate: >= 0.9.3) pass."""

SOURCES: dict[str, tuple[str, ...]] = {
    "deepspeed": ("shardwise", "shardwise.compat.ds_utils"),
    "deepspeed.comm": ("shardwise.comm", "shardwise.comm.torch_api", "shardwise.comm.constants"),
    # deepspeed.comm.comm is the module deepspeed.comm re-exports; dist is its name inside DeepSpeed's modules
    "deepspeed.comm.comm": ("shardwise.comm", "shardwise.comm.torch_api", "shardwise.comm.constants"),
    "deepspeed.utils.dist": ("shardwise.comm", "shardwise.comm.torch_api", "shardwise.comm.constants"),
    "deepspeed.utils.groups.dist": ("shardwise.comm", "shardwise.comm.torch_api", "shardwise.comm.constants"),
    "deepspeed.runtime.utils.dist": ("shardwise.comm", "shardwise.comm.torch_api", "shardwise.comm.constants"),
    "deepspeed.comm.utils": ("shardwise.comm.launcher_env", "shardwise.comm.op_logging"),
    "deepspeed.utils.comms_logging": ("shardwise.comm.comms_logger", "shardwise.comm.op_logging"),
    "deepspeed.zero": ("shardwise.zero",),
    "deepspeed.accelerator": ("shardwise.compat.accelerator",),
    "deepspeed.accelerator.cpu_accelerator": ("shardwise.compat.cpu_accelerator",),
    "deepspeed.accelerator.real_accelerator": ("shardwise.compat.accelerator",),
    "deepspeed.constants": ("shardwise.compat.process_env",),
    "deepspeed.env_report": ("shardwise.cli.report_cmd",),
    "deepspeed.utils.timer": ("shardwise.compat.timer_names", "shardwise.profiling.named_timers", "shardwise.profiling.timers"),
    "deepspeed.utils.module_utils": ("shardwise.utils.module_paths",),
    "deepspeed.compression.helper": ("shardwise.utils.module_paths",),
    "deepspeed.runtime.dataloader": ("shardwise.data",),
    "deepspeed.runtime.data_pipeline.curriculum_scheduler": ("shardwise.compat.curriculum_scheduler",),
    "deepspeed.runtime.data_pipeline.data_routing.helper": ("shardwise.compat.data_routing",),
    "deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset": ("shardwise.data.mmap_indexed",),
    "deepspeed.runtime.data_pipeline.data_sampling.data_analyzer": ("shardwise.compat.data_analyzer",),
    "deepspeed.utils": (
        "shardwise.compat.ds_utils",
        "shardwise.utils.logging",
        "shardwise.zero.param_access",
        "shardwise.zero.leaf_modules",
        "shardwise.compat.groups",
        "shardwise.compat.bwc",
        "shardwise.compat.tensor_fragment",
        "shardwise.profiling.nvtx",
    ),
    "deepspeed.utils.bwc": ("shardwise.compat.bwc",),
    "deepspeed.utils.nvtx": ("shardwise.profiling.nvtx",),
    "deepspeed.utils.init_on_device": ("shardwise.compat.small_names",),
    "deepspeed.comm.timer": ("shardwise.profiling.named_timers",),
    "deepspeed.utils.z3_leaf_module": ("shardwise.zero.leaf_modules",),
    "deepspeed.utils.logging": ("shardwise.utils.logging",),
    "deepspeed.utils.groups": ("shardwise.compat.groups", "shardwise.compat.bwc", "shardwise.utils.logging"),
    # DeepSpeed's runtime.utils imports the groups module by that name
    "deepspeed.runtime.utils.groups": ("shardwise.compat.groups", "shardwise.compat.bwc", "shardwise.utils.logging"),
    "deepspeed.git_version_info": ("shardwise.compat.git_version_info",),
    "deepspeed.utils.tensor_fragment": ("shardwise.zero.param_access", "shardwise.compat.tensor_fragment"),
    "deepspeed.utils.zero_to_fp32": ("shardwise.compat.zero_to_fp32",),
    "deepspeed.checkpoint.utils": ("shardwise.compat.ds_utils",),
    "deepspeed.checkpoint": ("shardwise.compat.ds_utils", "shardwise.compat.universal", "shardwise.compat.checkpoint_constants"),
    "deepspeed.checkpoint.ds_to_universal": ("shardwise.compat.universal",),
    "deepspeed.checkpoint.constants": (
        "shardwise.compat.universal",
        "shardwise.compat.checkpoint_constants",
        "shardwise.autoep.universal",
        "shardwise.checkpoint.folding_metadata",
    ),
    "deepspeed.runtime.engine": ("shardwise.engine",),
    "deepspeed.runtime.lr_schedules": ("shardwise.compat.lr_schedules", "shardwise.schedulers"),
    "deepspeed.runtime.zero": ("shardwise.zero",),
    "deepspeed.runtime.zero.partition_parameters": ("shardwise.compat.partition_parameters",),
    "deepspeed.runtime.zero.config": ("shardwise.compat.zero_config",),
    "deepspeed.runtime.zero.offload_config": ("shardwise.compat.zero_config",),
    "deepspeed.runtime.zero.offload_states": ("shardwise.zero.offload_states",),
    "deepspeed.runtime.zero.leaf_module_config": ("shardwise.compat.zero_config",),
    "deepspeed.runtime.zero.tiling": ("shardwise.zero.tiling",),
    "deepspeed.runtime.utils": (
        "shardwise.compat.runtime_utils",
        "shardwise.precision.tensor_norms",
        "shardwise.runtime.script_helpers",
        "shardwise.compat.bwc",
    ),
    "deepspeed.runtime.config": ("shardwise.compat.ds_config", "shardwise.config"),
    "deepspeed.runtime.precision_config": ("shardwise.compat.ds_config",),
    "deepspeed.runtime.constants": ("shardwise.compat.runtime_constants",),
    "deepspeed.runtime.config_utils": ("shardwise.compat.config_model",),
    "deepspeed.runtime.activation_checkpointing.checkpointing": ("shardwise.checkpointing",),
    "deepspeed.runtime.pipe": ("shardwise.pipe",),
    "deepspeed.runtime.pipe.topology": ("shardwise.pipe.topology", "shardwise.pipe.grid"),
    "deepspeed.runtime.pipe.module": ("shardwise.pipe.module", "shardwise.pipe.spec"),
    "deepspeed.runtime.pipe.schedule": ("shardwise.pipe.schedule",),
    "deepspeed.runtime.pipe.engine": ("shardwise.pipe.engine",),
    "deepspeed.launcher.runner": ("shardwise.compat.launcher_runner", "shardwise.launcher.command"),
    "deepspeed.launcher.multinode_runner": ("shardwise.compat.launcher_runner",),
    "deepspeed.monitor.config": ("shardwise.compat.monitors",),
    "deepspeed.monitor.monitor": ("shardwise.compat.monitors",),
    "deepspeed.monitor.tensorboard": ("shardwise.compat.monitors",),
    "deepspeed.monitor.wandb": ("shardwise.compat.monitors",),
    "deepspeed.monitor.csv_monitor": ("shardwise.compat.monitors",),
    "deepspeed.monitor.comet": ("shardwise.compat.monitors",),
    "deepspeed.ops.op_builder": ("shardwise.compat.op_builder",),
    "deepspeed.ops.op_builder.builder": ("shardwise.compat.op_builder",),
    "deepspeed.ops.aio": ("shardwise.compat.op_builder",),
    "deepspeed.ops.adam": ("shardwise.compat.ops",),
    "deepspeed.ops.adagrad": ("shardwise.compat.ops",),
    "deepspeed.ops.lion": ("shardwise.compat.ops",),
    "deepspeed.ops.lamb": ("shardwise.compat.ops",),
    "deepspeed.sequence": ("shardwise.sequence",),
    "deepspeed.sequence.layer": ("shardwise.sequence.layer",),
    "deepspeed.runtime.sequence_parallel": ("shardwise.sequence",),
    "deepspeed.runtime.sequence_parallel.ulysses_sp": (
        "shardwise.sequence.hf_attention",
        "shardwise.sequence.data",
        "shardwise.sequence.tiled",
    ),
    "deepspeed.runtime.sequence_parallel.parallel_state_sp": ("shardwise.sequence.parallel_state",),
    "deepspeed.module_inject": ("shardwise.compat.autotp",),
    "deepspeed.module_inject.layers": ("shardwise.compat.autotp", "shardwise.tensor_parallel.gather"),
    "deepspeed.module_inject.tp_shard": ("shardwise.compat.autotp",),
    "deepspeed.module_inject.auto_tp": ("shardwise.compat.autotp",),
    "deepspeed.module_inject.autotp_config": ("shardwise.tensor_parallel.specs", "shardwise.tensor_parallel.presets"),
    "deepspeed.runtime.tensor_parallel": ("shardwise.tensor_parallel.model_init",),
    "deepspeed.moe.sharded_moe": ("shardwise.moe.layer", "shardwise.moe.gating", "shardwise.moe.dispatch"),
    "deepspeed.module_inject.auto_ep": ("shardwise.autoep.detect",),
    "deepspeed.module_inject.auto_ep_config": ("shardwise.autoep.config", "shardwise.autoep.presets"),
    "deepspeed.module_inject.auto_ep_folding": ("shardwise.autoep.folding", "shardwise.compat.folding_corrections"),
    "deepspeed.module_inject.auto_ep_layer": ("shardwise.autoep.layer",),
    "deepspeed.module_inject.auto_ep_preset_adapters": ("shardwise.autoep.presets",),
    "deepspeed.module_inject.auto_ep_presets": ("shardwise.autoep.presets",),
    "deepspeed.module_inject.auto_ep_presets.base": ("shardwise.autoep.presets", "shardwise.autoep.config"),
    "deepspeed.module_inject.auto_ep_presets.registry": ("shardwise.autoep.presets",),
    "deepspeed.moe.ep_router": ("shardwise.autoep.router",),
    "deepspeed.moe.ep_count": ("shardwise.autoep.router",),
    "deepspeed.moe.ep_experts": ("shardwise.autoep.experts",),
    "deepspeed.moe.ep_kernels": ("shardwise.autoep.experts",),
    "deepspeed.moe.ep_repack": ("shardwise.autoep.repack",),
    "deepspeed.moe.ep_tp_dispatch": ("shardwise.autoep.tp_dispatch",),
    "deepspeed.moe.fused_expert_layout": ("shardwise.autoep.fused_layout",),
    "deepspeed.checkpoint.autoep_universal": (
        "shardwise.autoep.universal",
        "shardwise.checkpoint.folding_metadata",
        "shardwise.checkpoint.universal_experts",
    ),
}

RENAMES: dict[str, str] = {
    "deepspeed.initialize": "shardwise.compat.client_checks:initialize",
    "deepspeed.DeepSpeedEngine": "shardwise.engine:ShardwiseEngine",
    "deepspeed.PipelineEngine": "shardwise.pipe.engine:PipelineEngine",
    "deepspeed.env_report.main": "shardwise.cli.report_cmd:ds_report",
    "deepspeed.runtime.engine.DeepSpeedEngine": "shardwise.engine:ShardwiseEngine",
    "deepspeed.DeepSpeedConfig": "shardwise.compat.ds_config:DeepSpeedConfig",
    "deepspeed.OnDevice": "shardwise.compat.small_names:OnDevice",
    "deepspeed.utils.OnDevice": "shardwise.compat.small_names:OnDevice",
    **{f"deepspeed.{path}.get_accelerator": "shardwise.compat.accelerator:get_accelerator"
       for path in ("comm", "utils", "utils.groups", "runtime.utils")},
    **{f"deepspeed.{path}.DeprecatedException": "shardwise.compat.small_names:DeprecatedException"
       for path in ("utils", "utils.groups")},
    "deepspeed.runtime.utils.is_moe_param": "shardwise.moe.utils:is_moe_param",
    "deepspeed.utils.get_caller_func": "shardwise.comm.op_logging:get_caller_func",
    **{f"deepspeed.{path}.trim_mean": "shardwise.comm.comms_logger:trimmed_mean" for path in ("utils.timer", "comm.timer")},
    "deepspeed.utils.exceptions.DeprecatedException": "shardwise.compat.small_names:DeprecatedException",
    "deepspeed.comm.reduce_op.ReduceOp": "torch.distributed:ReduceOp",
    "deepspeed.comm.config.CommsLoggerConfig": "shardwise.config.sections.observability:CommsLoggerConfig",
    "deepspeed.get_accelerator": "shardwise.compat.accelerator:get_accelerator",
    "deepspeed.launcher.runner.main": "shardwise.compat.launcher_runner:main",
    "deepspeed.module_inject.tp_shard.get_shard_size_list": "shardwise.sequence.layout:get_shard_size_list",
    "deepspeed.ops.__compatible_ops__": "shardwise.compat.op_builder:COMPATIBLE_OPS",
    "deepspeed.utils.torch.required_torch_version": "shardwise.compat.small_names:required_torch_version",
    "deepspeed.utils.numa.parse_range_list": "shardwise.compat.small_names:parse_range_list",
    "deepspeed.sequence.layer._torchembed_available": "shardwise.compat.small_names:FUSED_ROTARY_AVAILABLE",
    # a submodule's name re-exported by its package as a function: the package attribute is the function
    "deepspeed.utils.z3_leaf_module": "shardwise.zero.leaf_modules:z3_leaf_module",
    **{f"deepspeed.{package}.{name}": f"shardwise.zero.tiling:{name}"
       for package in ("zero", "runtime.zero") for name in ("TiledLinear", "TiledLinearReturnBias")},
    "deepspeed.runtime.zero.utils.ZeRORuntimeException": "shardwise.compat.small_names:ZeRORuntimeException",
    "deepspeed.utils.RepeatingLoader": "shardwise.data:RepeatingLoader",
    "deepspeed.tp_model_init": "shardwise.tensor_parallel.model_init:tp_model_init",
    "deepspeed.moe.sharded_moe._AllToAll": "shardwise.moe.dispatch:AllToAll",
    "deepspeed.moe.sharded_moe._route_slots": "shardwise.moe.dispatch:route_slots",
    "deepspeed.moe.sharded_moe._sparse_encode": "shardwise.moe.dispatch:sparse_encode",
    "deepspeed.moe.sharded_moe._sparse_decode": "shardwise.moe.dispatch:sparse_decode",
    "deepspeed.moe.sharded_moe._capacity": "shardwise.moe.gating:capacity",
    "deepspeed.accelerator.cpu_accelerator.CPU_Accelerator": "shardwise.compat.cpu_accelerator:CpuAccelerator",
    "deepspeed.module_inject.auto_ep_config._UNSET": "shardwise.autoep.config:UNSET",
    "deepspeed.module_inject.auto_ep_presets.base._UNSET": "shardwise.autoep.config:UNSET",
    **{
        f"deepspeed.{path}": f"shardwise.compat.unavailable:{path.rpartition('.')[2]}"
        for path in (
            "pipe.DualPipeVModule",
            "runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer",
            "runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3",
            "runtime.fp16.fused_optimizer.FP16_Optimizer",
            "runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer",
            "runtime.bf16_optimizer.BF16_Optimizer",
            "runtime.zero.partition_parameters.MultipleAllGatherHandles",
            "runtime.zero.partition_parameters.partitioned_param_data_shape",
            "runtime.utils.PartitionedTensor",
            "runtime.utils.CheckOverflow",
            "comm.TorchBackend",
            "comm.CCLBackend",
            "comm.init_deepspeed_backend",
            "comm.set_backend",
            "comm.mpi_discovery",
            "comm.patch_aml_env_for_torch_nccl_backend",
            "comm.patch_aws_sm_env_for_torch_nccl_backend",
            "comm.initialize_mesh_device",
            "comm.enable_symm_mem_for_group",
            "utils.groups.set_tensor_model_parallel_rank",
            "utils.groups.set_tensor_model_parallel_world_size",
            "utils.set_tensor_model_parallel_rank",
            "utils.set_tensor_model_parallel_world_size",
            "sequence.fpdt_layer._FPDTGPUOffloadingAttentionImpl_",
            "sequence.fpdt_layer.FPDT_InputConstruct",
        )
    },
}
"""Single names: DeepSpeed's spelling -> ``module:attribute`` in shardwise. The ``unavailable`` ones are
DeepSpeed parts shardwise does not have (DualPipeVModule, DeepSpeed's own optimizer wrappers): importable,
raising with their name and the alternative when used."""

PACKAGES: frozenset[str] = frozenset({"deepspeed.runtime", "deepspeed.ops", "deepspeed.launcher"})
"""Paths that exist only to hold sub-paths (``deepspeed.runtime.engine``...)."""


def shardwise_twin(path: str) -> str:
    """The shardwise module of the same dotted path: ``deepspeed.a.b`` -> ``shardwise.a.b``.

    Example:
        >>> shardwise_twin("deepspeed.checkpointing")
        'shardwise.checkpointing'
    """
    return "shardwise" + path[len(ROOT) :]
