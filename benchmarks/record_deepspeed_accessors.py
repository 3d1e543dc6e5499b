"""Record what DeepSpeed's engine config accessors return, as the reference for shardwise's.

Run with a Python that has DeepSpeed installed (never the project venv) and WITHOUT shardwise's
``deepspeed`` package on ``PYTHONPATH``::

    OMP_NUM_THREADS=1 /work/venv-ds/bin/python benchmarks/record_deepspeed_accessors.py

It builds one ``DeepSpeedEngine`` per config below (CPU, gloo, world size 1, a ``Linear(4, 2)``),
calls every accessor in :data:`ACCESSORS` and writes ``tests/data/deepspeed_engine_accessors.json``:
DeepSpeed's version, each config, and each accessor's value as JSON (pydantic objects as their
``model_dump``, enums as their value, tuples as lists, dtypes and paths as ``str``; the working
directory inside a string as ``$CWD``; an accessor that raises as ``{"raises": "ErrorType"}``).
``tests/unit/runtime/test_ds_config_accessors.py`` builds shardwise engines from the same configs
and compares.
"""

from __future__ import annotations

import copy
import enum
import json
import os
import sys
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "deepspeed_engine_accessors.json"
CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "corpus" / "configs"

# Every DeepSpeedEngine method that reads the config and that shardwise implements in
# ``shardwise.runtime.ds_config_accessors`` / ``ds_zero_accessors``.
ACCESSORS = [
    "aio_config",
    "autotuning_enabled",
    "autotuning_end_profile_step",
    "autotuning_metric",
    "autotuning_metric_path",
    "autotuning_model_info_path",
    "autotuning_profile_model_info",
    "autotuning_start_profile_step",
    "bf16_master_weights_and_gradients",
    "bf16_optimizer_states",
    "checkpoint_serialization_enabled",
    "checkpoint_tag_validation_enabled",
    "checkpoint_tag_validation_fail",
    "checkpoint_writer_enabled",
    "communication_data_type",
    "compile_autosp",
    "compile_autotp",
    "compile_zero_optimization_stage",
    "cpuadam_cores_perc",
    "curriculum_learning_config",
    "curriculum_learning_enabled",
    "data_efficiency_config",
    "data_efficiency_enabled",
    "data_sampling_config",
    "data_sampling_enabled",
    "dataloader_drop_last",
    "dump_state",
    "dynamic_loss_scale",
    "dynamic_loss_scale_args",
    "flops_profiler_detailed",
    "flops_profiler_enabled",
    "flops_profiler_module_depth",
    "flops_profiler_output_file",
    "flops_profiler_profile_step",
    "flops_profiler_recompute_fwd_factor",
    "flops_profiler_top_modules",
    "fp16_auto_cast",
    "fp16_master_weights_and_gradients",
    "get_data_types",
    "gradient_predivide_factor",
    "initial_dynamic_scale",
    "is_sanity_checks_enabled",
    "load_universal_checkpoint",
    "memory_breakdown",
    "optimizer_legacy_fusion",
    "optimizer_name",
    "optimizer_params",
    "postscale_gradients",
    "random_ltd_config",
    "random_ltd_enabled",
    "scheduler_name",
    "scheduler_params",
    "tensor_parallel_config",
    "torch_autocast_dtype",
    "torch_autocast_enabled",
    "torch_autocast_lower_precision_safe_modules",
    "use_node_local_storage",
    "wall_clock_breakdown",
    "zenflow_config",
    "zero_allgather_bucket_size",
    "zero_allgather_partitions",
    "zero_allgather_sequential",
    "zero_allow_untested_optimizer",
    "zero_compute_grad_norm",
    "zero_contiguous_gradients",
    "zero_cpu_offload",
    "zero_elastic_checkpoint",
    "zero_force_ds_cpu_optimizer",
    "zero_hpz_partition_size",
    "zero_ignore_unused_parameters",
    "zero_legacy_stage1",
    "zero_load_from_fp32_weights",
    "zero_log_trace_cache_warnings",
    "zero_max_live_parameters",
    "zero_max_reuse_distance",
    "zero_model_persistence_threshold",
    "zero_module_granularity_threshold",
    "zero_multi_rank_bucket_allreduce",
    "zero_nvme_offload_optimizer",
    "zero_offload_optimizer",
    "zero_offload_param",
    "zero_optimization",
    "zero_optimization_partition_gradients",
    "zero_optimization_partition_weights",
    "zero_overlap_comm",
    "zero_param_persistence_threshold",
    "zero_parameter_alignment",
    "zero_partial_offload",
    "zero_prefetch_bucket_size",
    "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_weights",
    "zero_reduce_bucket_size",
    "zero_reduce_scatter",
    "zero_round_robin_gradients",
    "zero_save_muon_momentum_buffer_in_memory",
    "zero_sub_group_size",
    "zero_use_cpu_optimizer",
]
PROPERTIES = frozenset({"communication_data_type"})  # read, not called

_BATCH = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
_ADAM = {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}

# (name, config, client optimizer?) -- hand-written ones cover each section; corpus ones are real files.
HAND_WRITTEN: list[tuple[str, dict[str, Any], bool]] = [
    ("defaults", {**_BATCH}, False),
    (
        "zero0_fp32_optimizer_scheduler",
        {
            **_BATCH,
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": 1e-3, "torch_adam": True},
                "legacy_fusion": False,
            },
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
            "wall_clock_breakdown": True,
            "memory_breakdown": True,
            "dataloader_drop_last": True,
            "prescale_gradients": True,
            "gradient_predivide_factor": 2.0,
            "communication_data_type": "fp32",
        },
        False,
    ),
    (
        "zero1_bf16",
        {
            **_BATCH,
            "optimizer": _ADAM,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 1, "reduce_bucket_size": 1000, "allgather_bucket_size": 2000},
            "data_types": {"grad_accum_dtype": "fp32"},
        },
        False,
    ),
    (
        "zero2_client_optimizer",
        {
            **_BATCH,
            "zero_optimization": {
                "stage": 2,
                "overlap_comm": True,
                "contiguous_gradients": False,
                "round_robin_gradients": True,
                "reduce_scatter": False,
                "elastic_checkpoint": True,
                "load_from_fp32_weights": False,
                "ignore_unused_parameters": False,
            },
            "zero_allow_untested_optimizer": True,
        },
        True,
    ),
    (
        "zero3_tuned",
        {
            **_BATCH,
            "optimizer": _ADAM,
            "zero_optimization": {
                "stage": 3,
                "sub_group_size": 1000,
                "stage3_prefetch_bucket_size": 100,
                "stage3_param_persistence_threshold": 10,
                "stage3_model_persistence_threshold": 1000,
                "stage3_max_live_parameters": 5000,
                "stage3_max_reuse_distance": 4000,
                "stage3_module_granularity_threshold": 7,
                "zero_hpz_partition_size": 1,
                "log_trace_cache_warnings": True,
                "enable_sanity_checks": True,
            },
        },
        False,
    ),
    (
        "zero3_offload_cpu",
        {
            **_BATCH,
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "cpu", "pin_memory": False, "buffer_count": 2},
                "offload_param": {"device": "cpu", "buffer_count": 3},
            },
            "zero_force_ds_cpu_optimizer": False,
        },
        True,
    ),
    (
        "profiler_autotuning_checkpoint",
        {
            **_BATCH,
            "flops_profiler": {
                "enabled": True,
                "profile_step": 2,
                "module_depth": 3,
                "top_modules": 4,
                "detailed": False,
                "output_file": "flops.txt",
                "recompute_fwd_factor": 1.0,
            },
            "autotuning": {
                "enabled": False,
                "metric": "latency",
                "start_profile_step": 4,
                "end_profile_step": 6,
            },
            "checkpoint": {"tag_validation": "fail", "use_node_local_storage": True, "load_universal": True},
            "aio": {"block_size": 4096, "queue_depth": 4, "single_submit": True},
            "dump_state": True,
        },
        False,
    ),
    (
        "autotuning_enabled",
        {
            **_BATCH,
            "autotuning": {
                "enabled": True,
                "metric_path": "/tmp/metrics.json",
                "model_info": {"profile": True, "num_params": 10},
                "start_profile_step": 2,
            },
            "flops_profiler": {"enabled": False, "profile_step": 7, "detailed": True},
            "checkpoint": {"tag_validation": "Ignore", "checkpoint_serialization": False},
        },
        False,
    ),
    (
        "data_efficiency",
        {
            **_BATCH,
            "data_efficiency": {
                "enabled": True,
                "seed": 7,
                "data_sampling": {
                    "enabled": True,
                    "num_workers": 0,
                    "curriculum_learning": {
                        "enabled": True,
                        "data_cluster_path": "/tmp/clusters",
                        "curriculum_metrics": {
                            "seqlen": {
                                "index_to_sample_path": "/tmp/s",
                                "index_to_metric_path": "/tmp/m",
                                "difficulty_type": "value",
                                "clustering_type": "single_cluster",
                                "min_difficulty": 8,
                                "max_difficulty": 64,
                                "schedule_type": "fixed_linear",
                                "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8},
                            }
                        },
                    },
                },
                "data_routing": {
                    "enabled": True,
                    "random_ltd": {
                        "enabled": True,
                        "total_layer_num": 4,
                        "random_ltd_layer_num": 2,
                        "random_ltd_layer_id": [1, 2],
                        "model_mask_name": "attention_mask",
                        "model_type": "decoder",
                        "hidden_state_order": "batch_seq_dim",
                        "random_ltd_schedule": {
                            "min_value": 16,
                            "max_value": 64,
                            "schedule_type": "fixed_linear",
                            "schedule_config": {"require_steps": 10, "seq_per_step": 16},
                        },
                    },
                },
            },
        },
        False,
    ),
    (
        "torch_autocast",
        {
            **_BATCH,
            "torch_autocast": {
                "enabled": True,
                "dtype": "bfloat16",
                "lower_precision_safe_modules": ["torch.nn.Linear"],
            },
        },
        False,
    ),
    (
        "fp16_static_settings",
        {
            **_BATCH,
            "fp16": {
                "enabled": False,
                "auto_cast": True,
                "loss_scale": 128,
                "initial_scale_power": 8,
                "loss_scale_window": 100,
                "hysteresis": 3,
                "consecutive_hysteresis": True,
                "min_loss_scale": 2,
            },
            "communication_data_type": "bf16",
        },
        False,
    ),
    (
        "bf16_master_weights",
        {
            **_BATCH,
            "optimizer": _ADAM,
            "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
            "zero_optimization": {"stage": 2},
        },
        False,
    ),
    (
        "tensor_parallel_section",
        {**_BATCH, "tensor_parallel": {"autotp_size": 1, "tp_overlap_comm": True, "preset_model": "llama"}},
        False,
    ),
]

# Not recorded: a ``checkpoint.writer`` block (DeepSpeed 0.19.8 fails to build its writer at world size 1:
# 'UniversalParallelInfo' object has no attribute 'dp_rank'), NVMe offload (needs DeepSpeed's aio op),
# fp16 enabled (its CPU accelerator has no fp16), ``compile.passes`` (shardwise refuses them by name).

# Real files DeepSpeed 0.19.8 accepts at world size 1 on CPU (fp16 ones are not: the CPU accelerator
# has no fp16), with their ``"auto"`` values written out as a client would resolve them.
CORPUS_FILES = (
    "011_axolotl-ai-cloud__axolotl__deepspeed__zero1.json",
    "014_axolotl-ai-cloud__axolotl__deepspeed__zero3_bf16.json",
    "021_axolotl-ai-cloud__axolotl__deepspeed_configs__zero3_bf16_cpuoffload_all.json",
)


def _resolve_auto(value: Any, key: str = "") -> Any:
    """A corpus file's ``"auto"`` values as accelerate/transformers fill them for a tiny run."""
    if isinstance(value, dict):
        return {k: _resolve_auto(v, k) for k, v in value.items()}
    if value != "auto":
        return value
    fills = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0}
    if key in fills:
        return fills[key]
    if key in ("train_batch_size",):
        return None
    if key in ("lr", "warmup_max_lr"):
        return 1e-3
    if key == "weight_decay":
        return 0.0
    if key == "betas":
        return [0.9, 0.999]
    if key == "eps":
        return 1e-8
    if key in ("warmup_min_lr",):
        return 0.0
    if key in ("warmup_num_steps", "total_num_steps"):
        return 10
    if key in ("reduce_bucket_size", "stage3_prefetch_bucket_size"):
        return 16
    if key == "stage3_param_persistence_threshold":
        return 40
    return value


def corpus_configs() -> list[tuple[str, dict[str, Any], bool]]:
    """The corpus files of :data:`CORPUS_FILES`, ``"auto"`` filled, a ``None`` batch size dropped."""
    out = []
    for name in CORPUS_FILES:
        config = json.loads((CORPUS / name).read_text())
        for section, enabled in (("fp16", False), ("bf16", True)):  # a CPU run: bf16, never fp16
            if config.get(section, {}).get("enabled") == "auto":
                config[section]["enabled"] = enabled
        config = _resolve_auto(config)
        config = {k: v for k, v in config.items() if v is not None}
        if "optimizer" in config:
            config["optimizer"].setdefault("params", {})["torch_adam"] = True
        config["zero_force_ds_cpu_optimizer"] = False
        out.append((name.removesuffix(".json"), config, "optimizer" not in config))
    return out


def jsonable(value: Any, cwd: str) -> Any:
    """``value`` as plain JSON by the rules in the module docstring."""
    import torch
    from pydantic import BaseModel

    if isinstance(value, BaseModel):
        return jsonable(value.model_dump(), cwd)
    if isinstance(value, enum.Enum):
        return jsonable(value.value, cwd)
    if isinstance(value, torch.dtype | Path):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v, cwd) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v, cwd) for v in value]
    if isinstance(value, str):
        return value.replace(cwd, "$CWD")
    if value is None or isinstance(value, bool | int | float):
        return value
    return {"unrecorded_type": type(value).__name__}


def accessor_values(engine: Any) -> dict[str, Any]:
    """Every accessor of :data:`ACCESSORS` on ``engine``, as JSON."""
    cwd = os.getcwd()
    values: dict[str, Any] = {}
    for name in ACCESSORS:
        try:
            value = getattr(engine, name) if name in PROPERTIES else getattr(engine, name)()
        except Exception as error:  # DeepSpeed's own accessor failing is a fact to record
            values[name] = {"raises": type(error).__name__}
            continue
        values[name] = jsonable(value, cwd)
    return values


def main() -> int:
    """Build each engine, record, write :data:`OUTPUT`."""
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29517",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }.items():
        os.environ.setdefault(key, value)
    import deepspeed
    import torch

    if "shardwise" in (getattr(deepspeed, "__file__", "") or ""):
        raise SystemExit("this recorded shardwise's deepspeed package: run it without PYTHONPATH")
    deepspeed.init_distributed(dist_backend="gloo")
    records = []
    for name, config, client_optimizer in HAND_WRITTEN + corpus_configs():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3) if client_optimizer else None
        engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=model.parameters(),
            optimizer=optimizer,
            config=copy.deepcopy(config),
        )
        records.append(
            {
                "name": name,
                "config": config,
                "client_optimizer": client_optimizer,
                "values": accessor_values(engine),
            }
        )
        engine.destroy()
        print(f"recorded {name}", file=sys.stderr)
    OUTPUT.write_text(
        json.dumps(
            {"deepspeed_version": deepspeed.__version__, "accessors": list(ACCESSORS), "configs": records},
            indent=1,
            sort_keys=True,
        )
        + "\n"
    )
    print(f"wrote {OUTPUT} ({len(records)} configs x {len(ACCESSORS)} accessors)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
