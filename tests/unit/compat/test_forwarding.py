"""The forwarding table: every deepspeed name the clients import resolves; a missing one says so."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from deepspeed_install import installed_deepspeed

from shardwise.compat import forwarding

# (module path, name) pairs read from transformers 5.x, accelerate 1.x and the list
CLIENT_NAMES = [
    ("deepspeed", "initialize"),
    ("deepspeed", "init_distributed"),
    ("deepspeed", "DeepSpeedEngine"),
    ("deepspeed.comm", "get_rank"),
    ("deepspeed.comm", "is_initialized"),
    ("deepspeed.comm", "init_distributed"),
    ("deepspeed.comm", "all_gather"),
    ("deepspeed.comm", "all_gather_into_tensor"),
    ("deepspeed.comm", "reduce"),
    ("deepspeed.comm", "reduce_scatter"),
    ("deepspeed.comm", "reduce_scatter_tensor"),
    ("deepspeed.comm", "broadcast"),
    ("deepspeed.comm", "send"),
    ("deepspeed.comm", "recv"),
    ("deepspeed.comm", "isend"),
    ("deepspeed.comm", "irecv"),
    ("deepspeed.comm", "all_to_all_single"),
    ("deepspeed.comm", "barrier"),
    ("deepspeed.comm", "get_world_size"),
    ("deepspeed.comm", "get_local_rank"),
    ("deepspeed.comm", "new_group"),
    ("deepspeed.zero", "Init"),
    ("deepspeed.zero", "GatheredParameters"),
    ("deepspeed.zero", "register_external_parameter"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine"),
    ("deepspeed.runtime.lr_schedules", "VALID_LR_SCHEDULES"),
    ("deepspeed.runtime.zero.partition_parameters", "zero_wrapper_for_fp_tensor_constructor"),
    ("deepspeed.runtime.zero.partition_parameters", "_orig_torch_arange"),
    ("deepspeed.runtime.zero.partition_parameters", "get_accelerator"),
    ("deepspeed.runtime.zero", "GatheredParameters"),
    ("deepspeed.runtime.utils", "move_to_device"),
    ("deepspeed.utils", "logger"),
    ("deepspeed.utils", "safe_get_full_fp32_param"),
    ("deepspeed.utils", "safe_set_full_optimizer_state"),
    ("deepspeed.utils", "safe_get_local_grad"),
    ("deepspeed.utils.tensor_fragment", "safe_get_full_grad"),
    ("deepspeed.accelerator", "get_accelerator"),
    ("deepspeed.ops.adam", "DeepSpeedCPUAdam"),
    ("deepspeed.ops.adam", "FusedAdam"),
    ("deepspeed.ops.adagrad", "DeepSpeedCPUAdagrad"),
    ("deepspeed.ops.lion", "DeepSpeedCPULion"),
    ("deepspeed.checkpoint.utils", "clone_tensors_for_torch_save"),
    ("deepspeed.launcher.runner", "DEEPSPEED_ENVIRONMENT_NAME"),
]

# what DeepSpeed's own unit tests (and scripts written for DeepSpeed) import, issue 38
DEEPSPEED_TEST_NAMES = [
    ("deepspeed", "OnDevice"),
    ("deepspeed", "tp_model_init"),
    ("deepspeed.ops", "__compatible_ops__"),
    ("deepspeed.ops.op_builder", "CPUAdamBuilder"),
    ("deepspeed.ops.aio", "AsyncIOBuilder"),
    ("deepspeed.ops.op_builder", "FusedAdamBuilder"),
    ("deepspeed.ops.op_builder", "FusedLambBuilder"),
    ("deepspeed.accelerator", "is_current_accelerator_supported"),
    ("deepspeed.checkpoint.utils", "get_model_ckpt_name_for_rank"),
    ("deepspeed.git_version_info", "version"),
    ("deepspeed.git_version_info", "torch_info"),
    ("deepspeed.launcher.runner", "parse_resource_filter"),
    ("deepspeed.launcher.runner", "_parse_hostfile"),
    ("deepspeed.launcher.runner", "main"),
    ("deepspeed.launcher.multinode_runner", "MultiNodeRunner"),
    ("deepspeed.monitor.comet", "CometMonitor"),
    ("deepspeed.monitor.config", "DeepSpeedMonitorConfig"),
    ("deepspeed.monitor.csv_monitor", "csvMonitor"),
    ("deepspeed.monitor.tensorboard", "TensorBoardMonitor"),
    ("deepspeed.monitor.wandb", "WandbMonitor"),
    ("deepspeed.moe.layer", "MoE"),
    ("deepspeed.moe.utils", "split_params_into_different_moe_groups_for_optimizer"),
    ("deepspeed.moe.utils", "is_moe_param"),
    ("deepspeed.moe.sharded_moe", "top2gating"),
    ("deepspeed.moe.sharded_moe", "_sparse_encode"),
    ("deepspeed.utils", "set_z3_leaf_modules"),
    ("deepspeed.utils", "get_z3_leaf_modules"),
    ("deepspeed.utils.z3_leaf_module", "z3_leaf_module"),
    ("deepspeed", "get_accelerator"),
    ("deepspeed.pipe", "PipelineModule"),
    ("deepspeed.pipe", "LayerSpec"),
    ("deepspeed.pipe", "TiedLayerSpec"),
    ("deepspeed.runtime.pipe", "ProcessTopology"),
    ("deepspeed.runtime.pipe.module", "PipelineModule"),
    ("deepspeed.runtime.pipe.topology", "PipelineParallelGrid"),
    ("deepspeed.runtime.pipe.schedule", "TrainSchedule"),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine"),
    ("deepspeed.runtime.activation_checkpointing.checkpointing", "checkpoint"),
    ("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer"),
    ("deepspeed.runtime.config", "ADAM_OPTIMIZER"),
    ("deepspeed.runtime.config", "DeepSpeedConfig"),
    ("deepspeed.runtime.config_utils", "DeepSpeedConfigModel"),
    ("deepspeed.runtime.fp16.fused_optimizer", "FP16_Optimizer"),
    ("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer"),
    ("deepspeed.runtime.lr_schedules", "WARMUP_LR"),
    ("deepspeed.runtime.lr_schedules", "CYCLE_MAX_MOM"),
    ("deepspeed.runtime.lr_schedules", "LR_RANGE_TEST_STAIRCASE"),
    ("deepspeed.runtime.lr_schedules", "WarmupCosineLR"),
    ("deepspeed.runtime.pipe.topology", "PipeModelDataParallelTopology"),
    ("deepspeed.runtime.precision_config", "get_bfloat16_config"),
    ("deepspeed.runtime.utils", "see_memory_usage"),
    ("deepspeed.runtime.utils", "partition_balanced"),
    ("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
    ("deepspeed.runtime.zero.config", "DeepSpeedZeroOffloadOptimizerConfig"),
    ("deepspeed.runtime.zero.config", "DeepSpeedZeroOffloadParamConfig"),
    ("deepspeed.runtime.zero.partition_parameters", "MultipleAllGatherHandles"),
    ("deepspeed.runtime.zero.partition_parameters", "partitioned_param_data_shape"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"),
    ("deepspeed.runtime.zero.utils", "ZeRORuntimeException"),
    ("deepspeed.utils.groups", "_get_expert_parallel_ranks"),
    ("deepspeed.utils.numa", "parse_range_list"),
    ("deepspeed.utils.torch", "required_torch_version"),
    ("deepspeed.utils.zero_to_fp32", "get_optim_files"),
    ("deepspeed.sequence.layer", "DistributedAttention"),
    ("deepspeed.runtime.sequence_parallel.ulysses_sp", "UlyssesSPAttentionHF"),
    ("deepspeed.module_inject.auto_ep", "AutoEP"),
    ("deepspeed.module_inject.auto_ep_config", "parse_autoep_config"),
    ("deepspeed.module_inject.auto_ep_config", "MoELayerSpec"),
    ("deepspeed.module_inject.auto_ep_layer", "AutoEPMoELayer"),
    ("deepspeed.module_inject.auto_ep_presets.registry", "preset_name_for_hf_model_type"),
    ("deepspeed.moe.ep_router", "TokenChoiceTopKRouter"),
    ("deepspeed.moe.ep_experts", "GroupedExperts"),
    ("deepspeed.moe.ep_repack", "repack_expert_weights"),
    ("deepspeed.checkpoint.autoep_universal", "consolidate_autoep_zero12_expert_states"),
    ("deepspeed.accelerator.cpu_accelerator", "CPU_Accelerator"),
]


@pytest.fixture
def deepspeed_package(tmp_path: Path) -> Iterator[Any]:
    with installed_deepspeed(tmp_path) as package:  # a fresh install per test
        yield package


@pytest.mark.parametrize(("path", "name"), CLIENT_NAMES + DEEPSPEED_TEST_NAMES)
def test_client_names_resolve(deepspeed_package: object, path: str, name: str) -> None:
    module = importlib.import_module(path)
    assert getattr(module, name) is not None


def test_names_are_shardwise_objects(deepspeed_package: object) -> None:
    import deepspeed  # type: ignore[import-not-found]
    from deepspeed.runtime.engine import DeepSpeedEngine  # type: ignore[import-not-found]

    import shardwise
    from shardwise.engine import ShardwiseEngine
    from shardwise.zero import Init

    assert DeepSpeedEngine is ShardwiseEngine
    assert deepspeed.zero.Init is Init
    assert deepspeed.__version__ == "0.19.8"
    assert (deepspeed.__version_major__, deepspeed.__version_minor__, deepspeed.__version_patch__) == (0, 19, 8)
    assert deepspeed.__git_hash__ == deepspeed.__git_branch__ == "shardwise"
    assert deepspeed.__shardwise_version__ == shardwise.__version__


def test_missing_name_names_itself(deepspeed_package: object) -> None:
    import deepspeed

    with pytest.raises(AttributeError, match=r"deepspeed\.no_such_name is not provided by shardwise"):
        deepspeed.no_such_name  # noqa: B018
    with pytest.raises(ModuleNotFoundError, match=r"deepspeed\.no_such_module is not provided by shardwise"):
        importlib.import_module("deepspeed.no_such_module")
    with pytest.raises(ImportError, match="no_such_function"):
        from deepspeed.utils import no_such_function  # type: ignore[attr-defined]  # noqa: F401


def test_unlisted_path_falls_back_to_the_shardwise_module_of_that_path() -> None:
    # what lets shardwise.checkpointing / shardwise.compression / shardwise.ops.sparse_attention reach
    # the clients as soon as they exist: the same dotted path under shardwise
    assert forwarding.sources_of("deepspeed.elasticity") == ("shardwise.elasticity",)
    assert (
        forwarding.resolve("deepspeed.elasticity", "compute_elastic_config")
        is importlib.import_module("shardwise.elasticity").compute_elastic_config
    )
    assert forwarding.sources_of("deepspeed.not_in_shardwise") == ()
    # issue 16's package, merged: DeepSpeed's own import path reaches it with no table entry
    compress = importlib.import_module("shardwise.compression.compress")
    assert forwarding.resolve("deepspeed.compression.compress", "init_compression") is compress.init_compression


def test_unavailable_parts_import_and_fail_with_their_names(deepspeed_package: object) -> None:
    from deepspeed.pipe import DualPipeVModule  # type: ignore[import-not-found]
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3  # type: ignore[import-not-found]

    class Pipe(DualPipeVModule):  # subclassing works, as DeepSpeed's test models do
        pass

    with pytest.raises(NotImplementedError, match=r"deepspeed\.pipe\.DualPipeVModule is not provided.*dualpipev"):
        Pipe()
    with pytest.raises(NotImplementedError, match=r"DeepSpeedZeroOptimizer_Stage3.*engine\.optimizer"):
        DeepSpeedZeroOptimizer_Stage3()
    assert not isinstance(object(), DeepSpeedZeroOptimizer_Stage3)
    from deepspeed.runtime.utils import PartitionedTensor  # type: ignore[import-not-found]

    with pytest.raises(NotImplementedError, match=r"runtime\.utils\.PartitionedTensor.*distribute_tensor"):
        PartitionedTensor([0.0, 1.0], group=None)


def test_a_forwarded_module_has_its_first_sources_file(deepspeed_package: object) -> None:
    import inspect

    import deepspeed.moe.ep_router  # type: ignore[import-not-found]

    from shardwise.autoep import router

    assert deepspeed.moe.ep_router.__file__ == router.__file__
    assert inspect.getsource(deepspeed.moe.ep_router) == inspect.getsource(router)


def test_dunder_names_come_only_from_the_table(deepspeed_package: object) -> None:
    import deepspeed.ops  # type: ignore[import-not-found]

    from shardwise.compat.op_builder import COMPATIBLE_OPS

    assert deepspeed.ops.__compatible_ops__ is COMPATIBLE_OPS
    with pytest.raises(AttributeError):
        deepspeed.ops.__no_such_dunder__  # noqa: B018


def test_names_added_by_the_wider_suite_sweep_reach_their_homes(deepspeed_package: object) -> None:
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT  # type: ignore[import-not-found]
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config  # type: ignore[import-not-found]
    from deepspeed.sequence.layer import _torchembed_available, apply_rotary_pos_emb  # type: ignore[import-not-found]

    from shardwise.config.sections.precision import FP16Config
    from shardwise.sequence import layer

    assert GRADIENT_CLIPPING_DEFAULT == 1.0 and DeepSpeedFP16Config is FP16Config
    assert _torchembed_available is False and apply_rotary_pos_emb is layer.apply_rotary_pos_emb


def test_a_package_attribute_reexported_over_its_submodule(deepspeed_package: object) -> None:
    """``deepspeed.utils.z3_leaf_module`` is the function (DeepSpeed's package binds it after the
    submodule), whether or not the submodule was imported first; the submodule still imports."""
    import deepspeed.utils.z3_leaf_module  # type: ignore[import-not-found]  # noqa: F401
    from deepspeed.utils import z3_leaf_module  # type: ignore[import-not-found]
    from deepspeed.utils.z3_leaf_module import set_z3_leaf_modules  # type: ignore[import-not-found]

    from shardwise.zero import leaf_modules

    assert z3_leaf_module is leaf_modules.z3_leaf_module and callable(z3_leaf_module)
    assert set_z3_leaf_modules is leaf_modules.set_z3_leaf_modules


def test_leaf_module_config_names(deepspeed_package: object) -> None:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # type: ignore[import-not-found]
    from deepspeed.runtime.zero.leaf_module_config import (  # type: ignore[import-not-found]
        DEFAULT_LEAF_MODULE_CLASSES,
        DEFAULT_LEAF_MODULE_NAMES,
        DeepSpeedZeroLeafModuleConfig,
    )

    config = DeepSpeedZeroConfig()
    assert config.leaf_module.classes == DEFAULT_LEAF_MODULE_CLASSES and config.leaf_module.names == DEFAULT_LEAF_MODULE_NAMES
    assert DeepSpeedZeroLeafModuleConfig(names="tail").names == ["tail"]
