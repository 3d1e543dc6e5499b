"""DeepSpeed names that stand for parts shardwise does not have: importable (so code that only imports or
subclasses them loads), failing when used with an error naming the DeepSpeed name and what to use instead.

Two kinds: DeepSpeed's own optimizer wrappers and ZeRO internals (shardwise's engine has its own
strategies, :mod:`shardwise.zero`); ``deepspeed.moe`` is :mod:`shardwise.moe`. Of
``deepspeed.pipe`` only ``DualPipeVModule`` is here: shardwise runs DualPipeV as a schedule of an
ordinary PipelineModule (:mod:`shardwise.pipe.executor`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

_DUALPIPEV = (
    "shardwise runs DualPipeV as a schedule of a plain PipelineModule: set the config's pipeline.schedule to "
    '"dualpipev" and pipeline.virtual_stages to 2'
)
_FPDT = ("FPDT (deepspeed.sequence.fpdt_layer, chunked offloading attention on CUDA) is not in shardwise; use "
         "Ulysses (deepspeed.sequence.layer.DistributedAttention) with TiledMLP/TiledFusedLogitsLoss")
_ZERO = "the engine's optimizer is a shardwise ZeRO strategy (engine.optimizer); use its methods, not DeepSpeed's classes"


class UnavailableDeepSpeedName(NotImplementedError):
    """A DeepSpeed name that shardwise keeps importable but cannot run."""


def _raise(qualname: str, instead: str) -> NoReturn:
    raise UnavailableDeepSpeedName(f"{qualname} is not provided by shardwise: {instead}")


def unavailable_class(qualname: str, instead: str) -> type:
    """A class named like DeepSpeed's whose construction raises naming ``qualname`` and ``instead``."""

    def __init__(self: object, *args: object, **kwargs: object) -> None:
        _raise(qualname, instead)

    module, _, name = qualname.rpartition(".")
    return type(name, (), {"__init__": __init__, "__module__": module,
                           "__doc__": f"Not provided by shardwise: {instead}."})


def unavailable_function(qualname: str, instead: str) -> Callable[..., NoReturn]:
    """A function named like DeepSpeed's whose call raises naming ``qualname`` and ``instead``."""

    def function(*args: object, **kwargs: object) -> NoReturn:
        _raise(qualname, instead)

    function.__name__ = function.__qualname__ = qualname.rpartition(".")[2]
    function.__doc__ = f"Not provided by shardwise: {instead}."
    return function


DualPipeVModule = unavailable_class("deepspeed.pipe.DualPipeVModule", _DUALPIPEV)

DeepSpeedZeroOptimizer = unavailable_class("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer", _ZERO)
DeepSpeedZeroOptimizer_Stage3 = unavailable_class("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3", _ZERO)
FP16_Optimizer = unavailable_class("deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer", _ZERO)
FP16_UnfusedOptimizer = unavailable_class("deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer", _ZERO)
BF16_Optimizer = unavailable_class("deepspeed.runtime.bf16_optimizer.BF16_Optimizer", _ZERO)
MultipleAllGatherHandles = unavailable_class(
    "deepspeed.runtime.zero.partition_parameters.MultipleAllGatherHandles",
    "shardwise's stage 3 gathers through FSDP2; use deepspeed.zero.GatheredParameters to read full parameters")
PartitionedTensor = unavailable_class(
    "deepspeed.runtime.utils.PartitionedTensor",
    "shard a tensor over a group with torch.distributed.tensor.distribute_tensor(tensor, mesh, [Shard(0)]) "
    "and read it whole with .full_tensor()")
partitioned_param_data_shape = unavailable_function(
    "deepspeed.runtime.zero.partition_parameters.partitioned_param_data_shape",
    "stage-3 parameters are FSDP2 DTensors; read param.to_local().shape for this rank's shard")
_FPDTGPUOffloadingAttentionImpl_ = unavailable_class("deepspeed.sequence.fpdt_layer._FPDTGPUOffloadingAttentionImpl_", _FPDT)
FPDT_InputConstruct = unavailable_class("deepspeed.sequence.fpdt_layer.FPDT_InputConstruct", _FPDT)


# deepspeed.comm's backend objects and set-up hooks: shardwise has one communication layer, torch.distributed
# through shardwise.comm, set up by init_distributed; there is no backend object to pick or build.
_INIT = ("shardwise has one communication backend, torch.distributed (nccl/gloo) behind deepspeed.comm; "
         "call deepspeed.comm.init_distributed(dist_backend=...)")
TorchBackend = unavailable_class("deepspeed.comm.torch.TorchBackend", _INIT)
CCLBackend = unavailable_class(
    "deepspeed.comm.ccl.CCLBackend", "oneCCL is DeepSpeed's compiled backend for Intel devices; " + _INIT)
init_deepspeed_backend = unavailable_function(
    "deepspeed.comm.init_deepspeed_backend", "it builds DeepSpeed's ccl/mpi/hccl backend objects; " + _INIT)
set_backend = unavailable_function("deepspeed.comm.set_backend", "there is no backend object to select; " + _INIT)
mpi_discovery = unavailable_function(
    "deepspeed.comm.mpi_discovery",
    "init_distributed(auto_mpi_discovery=True) reads Open MPI, MPICH/Intel MPI and Slurm variables itself")
patch_aml_env_for_torch_nccl_backend = unavailable_function(
    "deepspeed.comm.patch_aml_env_for_torch_nccl_backend",
    "shardwise does not translate Azure ML's variables; set MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK")
patch_aws_sm_env_for_torch_nccl_backend = unavailable_function(
    "deepspeed.comm.patch_aws_sm_env_for_torch_nccl_backend",
    "shardwise does not translate SageMaker's variables; set MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK")
initialize_mesh_device = unavailable_function(
    "deepspeed.comm.initialize_mesh_device",
    "the process layout has one owner, shardwise.comm.mesh: declare degrees with ensure_layout(pp=, tp=, sp=, ep=) "
    "and read the DeviceMesh with current_layout().device_mesh(device_type)")
enable_symm_mem_for_group = unavailable_function(
    "deepspeed.comm.enable_symm_mem_for_group",
    "shardwise uses no CUDA symmetric memory; call torch.distributed._symmetric_memory.enable_symm_mem_for_group")
_LAYOUT = ("the tensor-parallel layout comes from shardwise.comm.mesh (tp_model_init or tensor_parallel.autotp_size) "
           "and its rank and size are read from there; they cannot be overridden")
set_tensor_model_parallel_rank = unavailable_function("deepspeed.utils.groups.set_tensor_model_parallel_rank", _LAYOUT)
set_tensor_model_parallel_world_size = unavailable_function(
    "deepspeed.utils.groups.set_tensor_model_parallel_world_size", _LAYOUT)
CheckOverflow = unavailable_class(
    "deepspeed.runtime.utils.CheckOverflow",
    "shardwise's ZeRO strategies check gradients for overflow themselves; for a list of tensors use "
    "deepspeed.runtime.utils.has_inf_or_nan")
