"""Section models (spec 1.5, 1.6, 3): defaults against the spec's tables, legacy spellings,
strict vs lenient sections, value validation, cross-section rules and removed sections."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from shardwise.config import ConfigError, ConfigErrors, Source, load_config

BASE: dict[str, Any] = {"train_batch_size": 8}


def _load(extra: dict[str, Any], **kwargs: Any):
    return load_config({**BASE, **extra}, **kwargs)


def _error(extra: dict[str, Any], **kwargs: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        _load(extra, **kwargs)
    assert "fix:" in str(info.value)
    return info.value


# ------------------------------------------------------------------ defaults = spec tables
# Each table is copied from spec section 3 (key -> default). A section's resolved values are
# read back through ``to_ds_dict`` so the JSON names are checked as well.

SPEC_DEFAULTS: dict[str, dict[str, Any]] = {
    # 3.1
    "": {
        "managed_gradient_accumulation": True,
        "steps_per_print": None,
        "dataloader_drop_last": False,
        "disable_python_gc": False,
        "wall_clock_breakdown": False,
        "memory_breakdown": False,
        "dump_state": False,
        "log_level": None,
        "vocabulary_size": None,
        "zero_allow_untested_optimizer": False,
        "zero_force_ds_cpu_optimizer": True,
        "use_data_before_expert_parallelism": False,
        "gradient_clipping": 1.0,  # 3.6
        # 3.4
        "communication_data_type": None,
        "seq_parallel_communication_data_type": "fp32",
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "gradient_allreduce_op": "mean",
        "disable_allgather": False,
    },
    "timers": {"throughput": {"enabled": True, "synchronized": True}},
    # 3.5
    # loss_scale is a float in the spec; min_loss_scale is a float on purpose (docs/config-defaults.md)
    "fp16": {
        "enabled": False,
        "auto_cast": False,
        "loss_scale": 0.0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "consecutive_hysteresis": False,
        "min_loss_scale": 1.0,
        "fp16_master_weights_and_grads": False,
    },
    "bf16": {
        "enabled": False,
        "immediate_grad_update": False,
        "check_grad_overflow": True,
        "bf16_master_weights_and_grads": False,
        "bf16_optimizer_states": False,
    },
    "torch_autocast": {"enabled": False, "lower_precision_safe_modules": None},
    # 3.7 core and stage 3 (leaf_module's class list is not compared: see the report)
    "zero_optimization": {
        "stage": 0,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 500_000_000,
        "use_multi_rank_bucket_allreduce": True,
        "allgather_partitions": True,
        "allgather_bucket_size": 500_000_000,
        "overlap_comm": None,
        "compute_grad_norm": True,
        "load_from_fp32_weights": True,
        "elastic_checkpoint": False,
        "sub_group_size": 1_000_000_000,
        "offload_param": None,
        "offload_optimizer": None,
        "ignore_unused_parameters": True,
        "legacy_stage1": False,
        "round_robin_gradients": False,
        "parameter_alignment": False,
        "memory_efficient_linear": True,
        "pipeline_loading_checkpoint": False,
        "override_module_apply": True,
        "log_trace_cache_warnings": False,
        "enable_sanity_checks": False,
        "save_muon_momentum_buffer_in_memory": False,
        "zenflow": None,
        "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_param_persistence_threshold": 100_000,
        "stage3_model_persistence_threshold": sys.maxsize,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
        "stage3_gather_16bit_weights_on_model_save": False,
        "stage3_module_granularity_threshold": 0,
        "stage3_use_all_reduce_for_fetch_params": False,
        "stage3_allgather_sequential": False,
        "zero_hpz_partition_size": 1,
        "zero_quantized_weights": False,
        "zero_quantized_nontrainable_weights": False,
        "zero_quantized_gradients": False,
    },
    # 3.8
    "aio": {
        "block_size": 1_048_576,
        "queue_depth": 8,
        "intra_op_parallelism": 1,
        "single_submit": False,
        "overlap_events": True,
        "use_gds": False,
    },
    # 3.10
    "flops_profiler": {
        "enabled": False,
        "recompute_fwd_factor": 0.0,
        "profile_step": 1,
        "module_depth": -1,
        "top_modules": 1,
        "detailed": True,
        "output_file": None,
    },
    # 3.11
    "autotuning": {
        "enabled": False,
        "fast": True,
        "results_dir": "autotuning_results",
        "exps_dir": "autotuning_exps",
        "overwrite": True,
        "start_profile_step": 3,
        "end_profile_step": 5,
        "metric": "throughput",
        "metric_path": None,
        "tuner_type": "gridsearch",
        "tuner_early_stopping": 5,
        "tuner_num_trials": 50,
        "arg_mappings": None,
        "model_info_path": None,
        "mp_size": 1,
        "max_train_batch_size": None,
        "min_train_batch_size": 1,
        "max_train_micro_batch_size_per_gpu": 1024,
        "min_train_micro_batch_size_per_gpu": 1,
        "num_tuning_micro_batch_sizes": 3,
    },
    # 3.12
    "activation_checkpointing": {
        "partition_activations": False,
        "cpu_checkpointing": False,
        "contiguous_memory_optimization": False,
        "number_checkpoints": None,
        "synchronize_checkpoint_boundary": False,
        "profile": False,
    },
    # 3.13
    "data_efficiency": {"enabled": False, "seed": 1234},
    # 3.14
    "tensorboard": {"enabled": False, "output_path": "", "job_name": "DeepSpeedJobName"},
    "wandb": {"enabled": False, "group": None, "team": None, "project": "deepspeed"},
    "csv_monitor": {"enabled": False, "output_path": "", "job_name": "DeepSpeedJobName"},
    "comet": {
        "enabled": False,
        "samples_log_interval": 100,
        "project": None,
        "workspace": None,
        "api_key": None,
        "experiment_name": None,
        "experiment_key": None,
        "online": None,
        "mode": None,
    },
    # 3.17
    "checkpoint": {
        "tag_validation": "Warn",
        "load_universal": False,
        "use_node_local_storage": False,
        "parallel_write": {"pipeline_stage": False},
        "checkpoint_serialization": True,
        "writer": None,
    },
    # 3.18
    "data_types": {
        "grad_accum_dtype": None,
        "param_dtype": None,
        "buffer_dtype": None,
        "keep_in_fp32_modules": "auto",
    },
    # 3.19
    "pipeline": {
        "stages": "auto",
        "partition": "best",
        "seed_layers": False,
        "activation_checkpoint_interval": 0,
        "pipe_partitioned": True,
        "grad_partitioned": True,
    },
    # 3.20
    "hybrid_engine": {
        "enabled": False,
        "max_out_tokens": 512,
        "inference_tp_size": 1,
        "release_inference_cache": False,
        "pin_parameters": True,
        "tp_gather_partition_size": 8,
        "enable_cuda_graph": False,
    },
    "tensor_parallel": {"autotp_size": 0},
}


@pytest.fixture(scope="module")
def default_dump() -> dict[str, Any]:
    return load_config(BASE).to_ds_dict()


@pytest.mark.parametrize("section", list(SPEC_DEFAULTS))
def test_defaults_match_spec(section: str, default_dump: dict[str, Any]) -> None:
    block = default_dump if section == "" else default_dump[section]
    expected = SPEC_DEFAULTS[section]
    got = {k: block[k] for k in expected}
    assert got == expected
    for key, value in expected.items():  # types too: 5e8 must come back as an int, 1.0 as a float
        if value is not None:
            assert type(got[key]) is type(value), key


def test_defaults_are_recorded_as_default(default_dump: dict[str, Any]) -> None:
    cfg = load_config(BASE)
    assert cfg.sources["zero_optimization.stage"].source is Source.DEFAULT
    assert cfg.sources["fp16.initial_scale_power"].source is Source.DEFAULT
    assert cfg.sources["train_batch_size"].source is Source.FILE


def test_overlap_comm_default_depends_on_stage() -> None:
    # spec 3.7: None -> True for stage 3, else False
    assert [
        _load({"zero_optimization": {"stage": s}}).config.zero_optimization.overlap_comm_effective
        for s in range(4)
    ] == [False, False, False, True]
    assert (
        _load(
            {"zero_optimization": {"stage": 3, "overlap_comm": False}}
        ).config.zero_optimization.overlap_comm_effective
        is False
    )


def test_offload_block_defaults() -> None:
    cfg = _load({"zero_optimization": {"stage": 3, "offload_param": {}, "offload_optimizer": {}}})
    dump = cfg.to_ds_dict()["zero_optimization"]
    assert dump["offload_param"] == {
        "device": "none",
        "nvme_path": None,
        "buffer_count": 5,
        "buffer_size": 100_000_000,
        "max_in_cpu": 1_000_000_000,
        "pin_memory": True,
    }
    assert dump["offload_optimizer"] == {
        "device": "none",
        "nvme_path": None,
        "buffer_count": 4,
        "pin_memory": True,
        "pipeline_read": False,
        "pipeline_write": False,
        "fast_init": False,
        "ratio": 1.0,
        "super_offload": False,
        "cpuadam_cores_perc": 0.8,
    }


def test_comms_logger_absent_by_default_and_spec_defaults_when_present() -> None:
    assert load_config(BASE).config.comms_logger is None  # spec 3.15: active only when the key is present
    dump = _load({"comms_logger": {}}).to_ds_dict()["comms_logger"]
    assert dump == {"enabled": False, "verbose": False, "prof_all": True, "debug": False, "prof_ops": []}


def test_data_efficiency_nested_defaults(default_dump: dict[str, Any]) -> None:
    sampling = default_dump["data_efficiency"]["data_sampling"]
    assert {k: sampling[k] for k in ("enabled", "num_epochs", "num_workers", "pin_memory")} == {
        "enabled": False,
        "num_epochs": 1000,
        "num_workers": 0,
        "pin_memory": False,
    }
    dyn = sampling["dynamic_batching"]
    assert (dyn["lr_scaling_method"], dyn["min_batch_size"], dyn["sequence_picking_order"]) == (
        "linear",
        1,
        "dataloader",
    )
    assert default_dump["data_efficiency"]["data_routing"]["enabled"] is False


def test_autotuning_model_info_defaults(default_dump: dict[str, Any]) -> None:
    assert default_dump["autotuning"]["model_info"] == {
        "profile": False,
        "num_params": None,
        "hidden_size": None,
        "num_layers": None,
    }


def test_checkpoint_writer_defaults() -> None:
    writer = _load({"checkpoint": {"writer": {}}}).to_ds_dict()["checkpoint"]["writer"]
    assert writer == {
        "type": "fast",
        "decoupled": False,
        "io_buffer_size": 64 * 1024 * 1024,
        "io_buffer_double": True,
        "show_statistics": False,
        "data_parallel": "replica",
        "io_multiplier": 1,
    }


def test_removed_section_defaults() -> None:
    cfg = _load({"elasticity": {}, "progressive_layer_drop": {}, "eigenvalue": {}, "sparse_attention": {}})
    e = cfg.config.elasticity
    assert (e.enabled, e.max_train_batch_size, e.micro_batch_sizes, e.min_gpus, e.max_gpus, e.version) == (
        False,
        2000,
        [2, 4, 6],
        1,
        10000,
        0.2,
    )
    assert (
        e.num_gpus_per_node,
        e.model_parallel_size,
        e.min_time,
        e.prefer_larger_batch,
        e.ignore_non_elastic_batch_info,
    ) == (1, 1, 0, True, False)
    pld = cfg.config.progressive_layer_drop
    assert (pld.enabled, pld.theta, pld.gamma) == (False, 1.0, 0.001)
    ev = cfg.config.eigenvalue
    assert (ev.max_iter, ev.tol, ev.stability, ev.gas_boundary_resolution, ev.layer_name, ev.layer_num) == (
        100,
        1e-2,
        1e-6,
        1,
        "bert.encoder.layer",
        0,
    )
    sa = cfg.config.sparse_attention
    assert (
        sa.mode,
        sa.block,
        sa.num_local_blocks,
        sa.num_global_blocks,
        sa.attention,
        sa.num_random_blocks,
        sa.local_window_blocks,
        sa.global_block_indices,
        sa.num_sliding_window_blocks,
    ) == ("fixed", 16, 4, 1, "bidirectional", 0, [4], [0], 3)


# ------------------------------------------------------------------ aliases and legacy forms (spec 1.6)


def test_bfloat16_is_bf16() -> None:
    cfg = _load({"bfloat16": {"enabled": True}})
    assert cfg.config.bf16.enabled is True and cfg.config.precision == "bf16"
    assert "bfloat16" not in cfg.to_ds_dict() and cfg.to_ds_dict()["bf16"]["enabled"] is True


def test_bfloat16_ignored_when_bf16_present() -> None:
    cfg = _load({"bfloat16": {"enabled": True}, "bf16": {"enabled": False}})
    assert cfg.config.bf16.enabled is False
    assert any("'bfloat16' is ignored" in w for w in cfg.warnings)


@pytest.mark.parametrize(("flag", "stage"), [(True, 1), (False, 0)])
def test_zero_optimization_boolean_form(flag: bool, stage: int) -> None:
    cfg = _load({"zero_optimization": flag})
    assert cfg.config.zero_stage == stage
    assert any("old boolean form" in w for w in cfg.warnings)
    prov = cfg.sources["zero_optimization.stage"]
    assert prov.source is Source.FILE and "legacy spelling" in prov.note


def test_zero_boolean_form_reads_top_level_allgather_size() -> None:
    cfg = _load({"zero_optimization": True, "allgather_size": 123_456})
    assert cfg.config.zero_optimization.allgather_bucket_size == 123_456
    assert "allgather_size" not in cfg.unknown_keys


def test_cpu_offload() -> None:
    cfg = _load({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert cfg.config.zero_optimization.offload_optimizer_device == "cpu"
    assert any("cpu_offload" in w for w in cfg.warnings)
    assert cfg.sources["zero_optimization.offload_optimizer.device"].note == (
        "legacy spelling 'zero_optimization.cpu_offload'"
    )


def test_cpu_offload_false_is_dropped() -> None:
    cfg = _load({"zero_optimization": {"stage": 2, "cpu_offload": False}})
    assert cfg.config.zero_optimization.offload_optimizer is None


def test_cpu_offload_with_offload_optimizer_names_both() -> None:
    err = _error(
        {"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}}
    )
    assert err.key == "zero_optimization.cpu_offload"
    assert "cpu_offload" in str(err) and "offload_optimizer" in str(err)


def test_cpu_offload_param() -> None:
    cfg = _load({"zero_optimization": {"stage": 3, "cpu_offload_param": True}})
    assert cfg.config.zero_optimization.offload_param_device == "cpu"
    err = _error(
        {"zero_optimization": {"stage": 3, "cpu_offload_param": True, "offload_param": {"device": "cpu"}}}
    )
    assert "cpu_offload_param" in str(err) and "offload_param" in err.fix


def test_cpu_offload_use_pin_memory_is_ignored_with_warning() -> None:
    cfg = _load({"zero_optimization": {"stage": 2, "cpu_offload_use_pin_memory": True}})
    assert any("cpu_offload_use_pin_memory" in w for w in cfg.warnings)


def test_stage3_gather_fp16_weights_on_model_save() -> None:
    cfg = _load({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}})
    assert cfg.config.zero_optimization.stage3_gather_16bit_weights_on_model_save is True


@pytest.mark.parametrize(
    ("short", "value"),
    [
        ("prefetch_bucket_size", 7),
        ("param_persistence_threshold", 11),
        ("model_persistence_threshold", 13),
        ("max_live_parameters", 17),
        ("max_reuse_distance", 19),
        ("gather_16bit_weights_on_model_save", True),
        ("module_granularity_threshold", 23),
        ("use_all_reduce_for_fetch_params", True),
        ("allgather_sequential", True),
    ],
)
def test_short_stage3_names(short: str, value: object) -> None:
    cfg = _load({"zero_optimization": {"stage": 3, short: value}})
    dump = cfg.to_ds_dict()["zero_optimization"]
    assert dump[f"stage3_{short}"] == value
    assert short not in dump


def test_both_spellings_is_an_error_naming_both() -> None:
    err = _error(
        {"zero_optimization": {"stage": 3, "prefetch_bucket_size": 7, "stage3_prefetch_bucket_size": 8}}
    )
    assert err.key == "zero_optimization.prefetch_bucket_size"
    assert "'zero_optimization.prefetch_bucket_size'" in err.rule
    assert "'zero_optimization.stage3_prefetch_bucket_size'" in err.rule


def test_fp32_allreduce_is_communication_data_type_fp32() -> None:
    cfg = _load({"fp32_allreduce": True})
    assert cfg.config.communication_data_type == "fp32"
    assert "fp32_allreduce" not in cfg.unknown_keys
    assert cfg.sources["communication_data_type"].source is Source.FILE


def test_fp32_allreduce_false_is_dropped() -> None:
    cfg = _load({"fp32_allreduce": False})
    assert cfg.config.communication_data_type is None and cfg.warnings == []


def test_fp32_allreduce_conflicting_with_communication_data_type() -> None:
    err = _error({"fp32_allreduce": True, "communication_data_type": "bf16"})
    assert err.key == "fp32_allreduce" and "bf16" in err.rule


def test_aio_thread_count() -> None:
    assert _load({"aio": {"thread_count": 4}}).config.aio.intra_op_parallelism == 4
    err = _error({"aio": {"thread_count": 4, "intra_op_parallelism": 2}})
    assert "aio.thread_count" in str(err) and "aio.intra_op_parallelism" in str(err)


def test_partitioned_activations_spelling() -> None:
    cfg = _load({"activation_checkpointing": {"partitioned_activations": True}})
    assert cfg.config.activation_checkpointing.partition_activations is True


def test_fp16_only_keys_in_bf16_are_a_warning() -> None:
    cfg = _load({"bf16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2}})
    assert cfg.config.bf16.enabled is True
    warning = next(w for w in cfg.warnings if "bf16 section has fp16-only keys" in w)
    assert "loss_scale" in warning and "initial_scale_power" in warning and "hysteresis" in warning


def test_amp_keys_in_fp16_are_a_warning() -> None:
    cfg = _load({"fp16": {"enabled": True, "opt_level": "O2"}})
    assert cfg.config.fp16.enabled and any("opt_level" in w for w in cfg.warnings)


@pytest.mark.parametrize(("text", "expected"), [("BFloat16", "bf16"), ("FP16", "fp16"), ("float32", "fp32")])
def test_communication_data_type_aliases(text: str, expected: str) -> None:
    assert _load({"communication_data_type": text}).config.communication_data_type == expected


def test_communication_data_type_invalid() -> None:
    err = _error({"communication_data_type": "int8"})
    assert err.key == "communication_data_type" and "'fp16'" in err.fix


# ------------------------------------------------------------------ unknown keys (spec 1.5)


@pytest.mark.parametrize(
    ("extra", "key", "suggestion"),
    [
        (
            {"zero_optimization": {"stage": 2, "overlap_com": True}},
            "zero_optimization.overlap_com",
            "overlap_comm",
        ),
        ({"bf16": {"check_overflow": True}}, "bf16.check_overflow", "check_grad_overflow"),
        ({"fp16": {"loss_scale_windw": 100}}, "fp16.loss_scale_windw", "loss_scale_window"),
        ({"wandb": {"projet": "x"}}, "wandb.projet", "project"),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memroy": True}}},
            "zero_optimization.offload_param.pin_memroy",
            "pin_memory",
        ),
    ],
)
def test_unknown_key_in_strict_section_is_an_error_with_did_you_mean(
    extra: dict[str, Any], key: str, suggestion: str
) -> None:
    err = _error(extra)
    assert err.key == key
    assert f"did you mean '{suggestion}'?" in err.fix


def test_unknown_key_without_close_match_lists_choices() -> None:
    err = _error({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "fast_init": True}}})
    assert err.key == "zero_optimization.offload_param.fast_init"
    assert "buffer_count" in err.fix and "max_in_cpu" in err.fix


def test_misplaced_key_points_to_its_section() -> None:
    err = _error({"zero_optimization": {"stage": 1, "loss_scale": 0}})
    assert err.key == "zero_optimization.loss_scale"
    assert "belongs in the 'fp16' section" in err.fix


@pytest.mark.parametrize(
    ("section", "block", "bad"),
    [
        ("pipeline", {"stagez": 2}, "pipeline.stagez"),
        ("aio", {"foo": 1}, "aio.foo"),
        ("checkpoint", {"tag_validaton": "Warn"}, "checkpoint.tag_validaton"),
        (
            "activation_checkpointing",
            {"partition_activation": True},
            "activation_checkpointing.partition_activation",
        ),
        ("flops_profiler", {"profile_steps": 3}, "flops_profiler.profile_steps"),
    ],
)
def test_unknown_key_in_lenient_section(section: str, block: dict[str, Any], bad: str) -> None:
    cfg = _load({section: block})
    warning = next(w for w in cfg.warnings if bad in w)
    assert "ignored" in warning
    err = _error({section: block}, strict=True)
    assert err.key == bad


def test_lenient_warning_has_did_you_mean() -> None:
    cfg = _load({"pipeline": {"stagez": 2}})
    assert any("did you mean 'stages'?" in w for w in cfg.warnings)


def test_lenient_unknown_key_does_not_hide_other_errors() -> None:
    err = _error({"pipeline": {"stagez": 2}, "zero_optimization": {"stage": 7}})
    assert err.key == "zero_optimization.stage"


def test_unknown_top_level_key_is_a_warning_with_did_you_mean() -> None:
    cfg = _load({"gradient_accumulation": 2})
    assert cfg.config.gradient_accumulation_steps == 1
    assert cfg.unknown_keys == {"gradient_accumulation": 2}
    assert any("did you mean 'gradient_accumulation_steps'?" in w for w in cfg.warnings)


def test_unknown_top_level_key_strict() -> None:
    err = _error({"gradient_accumulation": 2}, strict=True)
    assert err.key == "gradient_accumulation"
    assert "did you mean 'gradient_accumulation_steps'?" in err.fix


def test_top_level_key_that_lives_in_a_section() -> None:
    cfg = _load({"stage": 2})
    assert cfg.config.zero_stage == 0
    assert any("zero_optimization.stage" in w for w in cfg.warnings)


# ------------------------------------------------------------------ value validation


def test_integral_floats_accepted_for_ints() -> None:
    cfg = _load(
        {
            "zero_optimization": {
                "stage": 3,
                "reduce_bucket_size": 5e8,
                "stage3_max_live_parameters": 1e9,
                "stage3_prefetch_bucket_size": 5e7,
            }
        }
    )
    z = cfg.config.zero_optimization
    assert (z.reduce_bucket_size, z.stage3_max_live_parameters, z.stage3_prefetch_bucket_size) == (
        500_000_000,
        1_000_000_000,
        50_000_000,
    )
    assert type(z.reduce_bucket_size) is int


def test_fractional_float_rejected_for_int() -> None:
    err = _error({"zero_optimization": {"reduce_bucket_size": 1.5}})
    assert err.key == "zero_optimization.reduce_bucket_size" and err.value == 1.5
    assert "1.5 is not" in err.fix


@pytest.mark.parametrize("stage", ["2", 2.0, " 2 "])
def test_stage_text_accepted(stage: object) -> None:
    assert _load({"zero_optimization": {"stage": stage}}).config.zero_stage == 2


@pytest.mark.parametrize("stage", [4, -1, "three"])
def test_stage_out_of_range_rejected(stage: object) -> None:
    err = _error({"zero_optimization": {"stage": stage}})
    assert err.key == "zero_optimization.stage" and "0, 1, 2 or 3" in err.fix


def test_placeholder_in_section_value() -> None:
    err = _error({"zero_optimization": {"stage": "ZERO_STAGE"}})
    assert err.key == "zero_optimization.stage" and "placeholder" in err.rule


@pytest.mark.parametrize("block", ["offload_param", "offload_optimizer"])
def test_offload_device_validation(block: str) -> None:
    err = _error({"zero_optimization": {"stage": 3, block: {"device": "gpu"}}})
    assert err.key == f"zero_optimization.{block}.device" and "'nvme'" in err.fix
    cfg = _load({"zero_optimization": {"stage": 3, block: {"device": "CPU"}}})
    assert getattr(cfg.config.zero_optimization, f"{block}_device") == "cpu"


def test_nvme_offload_needs_a_path() -> None:
    err = _error({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    assert "nvme_path" in err.rule
    cfg = _load(
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local"}}}
    )
    assert str(cfg.config.zero_optimization.offload_param.nvme_path) == "/local"


@pytest.mark.parametrize("stage", [1, 2])
def test_partial_offload_needs_stage_3(stage: int) -> None:
    err = _error(
        {"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}
    )
    assert "offload_optimizer.ratio=0.5" in err.rule and "stage 3" in err.rule
    cfg = _load({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}})
    assert cfg.config.zero_optimization.offload_optimizer.ratio == 0.5


def test_ratio_out_of_range() -> None:
    err = _error({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}})
    assert err.key == "zero_optimization.offload_optimizer.ratio"


@pytest.mark.parametrize("stage", [0, 3])
def test_compute_grad_norm_false_only_at_stage_1_or_2(stage: int) -> None:
    err = _error({"zero_optimization": {"stage": stage, "compute_grad_norm": False}, "gradient_clipping": 0})
    assert "stage 1 or 2" in err.rule


@pytest.mark.parametrize("stage", [1, 2])
def test_odd_allgather_bucket_refused_at_stages_1_2(stage: int) -> None:
    err = _error({"zero_optimization": {"stage": stage, "allgather_bucket_size": 1001}})
    assert err.key == "zero_optimization.allgather_bucket_size" and err.value == 1001
    assert isinstance(err, AssertionError) and "1002" in err.fix


@pytest.mark.parametrize(("stage", "size"), [(0, 1001), (3, 1001), (2, 1000)])
def test_allgather_bucket_accepted(stage: int, size: int) -> None:
    assert _load({"zero_optimization": {"stage": stage, "allgather_bucket_size": size}}) is not None


def test_legacy_stage1_rejected() -> None:
    err = _error({"zero_optimization": {"legacy_stage1": True}})
    assert "legacy_stage1" in err.rule


def test_fp16_value_rules() -> None:
    assert "boolean" in _error({"fp16": {"enabled": True, "loss_scale": True}}).rule
    assert "finite" in _error({"fp16": {"enabled": True, "loss_scale": float("inf")}}).rule
    assert _error({"fp16": {"enabled": True, "min_loss_scale": 0}}).key == "fp16.min_loss_scale"
    assert _error({"fp16": {"enabled": True, "loss_scale_window": 0}}).key == "fp16.loss_scale_window"
    # a fractional minimum is accepted (0.19.8 types it as int; see docs/config-defaults.md)
    assert _load({"fp16": {"enabled": True, "min_loss_scale": 1e-4}}).config.fp16.min_loss_scale == 1e-4


@pytest.mark.parametrize(("text", "expected"), [("fail", "Fail"), ("IGNORE", "Ignore"), ("Warn", "Warn")])
def test_tag_validation_case_insensitive(text: str, expected: str) -> None:
    assert _load({"checkpoint": {"tag_validation": text}}).config.checkpoint.tag_validation == expected


def test_tag_validation_invalid() -> None:
    err = _error({"checkpoint": {"tag_validation": "bogus"}})
    assert err.key == "checkpoint.tag_validation"


def test_autotuning_dirs_must_be_non_empty() -> None:
    assert _error({"autotuning": {"results_dir": ""}}).key == "autotuning.results_dir"


def test_torch_autocast_dtype_aliases() -> None:
    assert _load({"torch_autocast": {"dtype": "torch.float16"}}).config.torch_autocast.dtype == "float16"
    assert _error({"torch_autocast": {"dtype": "int8"}}).key == "torch_autocast.dtype"


# ------------------------------------------------------------------ cross-section rules (checks.py)


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16.enabled"),
        ({"fp16": {"enabled": True}, "amp": {"enabled": True}}, "amp.enabled"),
        ({"bf16": {"enabled": True}, "amp": {"enabled": True}}, "amp.enabled"),
        ({"bf16": {"enabled": True}, "data_types": {"param_dtype": "fp16"}}, "data_types.param_dtype"),
        ({"data_types": {"param_dtype": "bf16"}}, "data_types.param_dtype"),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, "bf16.bf16_optimizer_states"),
        ({"prescale_gradients": True, "zero_optimization": {"stage": 2}}, "prescale_gradients"),
        ({"gradient_predivide_factor": 2.0, "zero_optimization": {"stage": 2}}, "gradient_predivide_factor"),
        ({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}}, "gradient_allreduce_op"),
        ({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 2, "zenflow": {}}}, "gradient_allreduce_op"),
        ({"gradient_allreduce_op": "sum", "compile": {"deepcompile": True}}, "gradient_allreduce_op"),
        ({"gradient_allreduce_op": "max"}, "gradient_allreduce_op"),
        (
            {"zero_optimization": {"stage": 2, "compute_grad_norm": False}},
            "zero_optimization.compute_grad_norm",
        ),
        ({"nebula": {"enabled": True}}, "nebula.enabled"),
        ({"zero_optimization": {"stage": 3, "mics_shard_size": 2}}, "zero_optimization.mics_shard_size"),
        ({"managed_gradient_accumulation": False, "compile": {"deepcompile": True}}, "managed_gradient_accumulation"),
        (
            {"managed_gradient_accumulation": False, "zero_optimization": {"stage": 1, "overlap_comm": True}},
            "zero_optimization.overlap_comm",
        ),
    ],
)
def test_cross_section_rule(extra: dict[str, Any], key: str) -> None:
    err = _error(extra)
    assert err.key == key
    assert f"'{key}'" in str(err)


@pytest.mark.parametrize(
    "extra",
    [
        {"bf16": {"enabled": True}, "data_types": {"param_dtype": "bf16"}},
        {"bf16": {"enabled": True, "bf16_optimizer_states": True, "bf16_master_weights_and_grads": True}},
        {"prescale_gradients": True, "zero_optimization": {"stage": 2, "reduce_scatter": False}},
        {"prescale_gradients": True, "zero_optimization": {"stage": 1}},
        {"gradient_predivide_factor": 2.0, "zero_optimization": {"stage": 2}, "gradient_allreduce_op": "sum"},
        {"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 2}},
        {"zero_optimization": {"stage": 1, "compute_grad_norm": False}, "gradient_clipping": 0},
        {"amp": {"enabled": True, "opt_level": "O2"}},
        {"managed_gradient_accumulation": True},
        {"managed_gradient_accumulation": False},
        {"managed_gradient_accumulation": False, "zero_optimization": {"stage": 2, "overlap_comm": True}},
    ],
)
def test_cross_section_rule_allowed_neighbours(extra: dict[str, Any]) -> None:
    _load(extra)


def test_nebula_disabled_is_accepted() -> None:
    cfg = _load({"nebula": {"enabled": False, "persistent_storage_path": "/tmp/x"}})
    assert cfg.config.nebula is not None and cfg.config.nebula.enabled is False


def test_mics_off_is_accepted() -> None:
    cfg = _load(
        {"zero_optimization": {"stage": 3, "mics_shard_size": -1, "mics_hierarchical_params_gather": False}}
    )
    assert cfg.config.zero_optimization.mics_shard_size == -1


# ------------------------------------------------------------------ removed sections accepted


def test_removed_sections_accepted_with_their_meaning() -> None:
    cfg = _load(
        {
            "compression_training": {
                "weight_quantization": {
                    "shared_parameters": {"enabled": True, "quantization_type": "symmetric"},
                    "different_groups": {
                        "wq1": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["attention.self"]}
                    },
                }
            },
            "sparse_attention": {"mode": "bigbird", "block": 32, "num_random_blocks": 2},
            "amp": {"enabled": True, "opt_level": "O2", "loss_scale": "dynamic"},
            "curriculum_learning": {
                "enabled": True,
                "curriculum_type": "seqlen",
                "min_difficulty": 8,
                "max_difficulty": 1024,
                "schedule_type": "fixed_linear",
                "schedule_config": {"total_curriculum_step": 100, "difficulty_step": 8},
            },
            "progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.001},
            "eigenvalue": {"enabled": True, "max_iter": 50, "layer_num": 12},
            "quantize_training": {"enabled": True, "quantize_bits": {"start_bits": 16, "target_bits": 8}},
        }
    )
    group = cfg.config.compression_training.weight_quantization.different_groups["wq1"]
    assert group.params == {"start_bits": 8, "target_bits": 8} and group.modules == ["attention.self"]
    assert cfg.config.compression_training.sparse_pruning.different_groups == {}
    assert (
        cfg.config.sparse_attention.mode,
        cfg.config.sparse_attention.block,
        cfg.config.sparse_attention.num_random_blocks,
    ) == ("bigbird", 32, 2)
    assert cfg.config.amp.enabled is True and cfg.config.amp.opt_level == "O2"
    assert cfg.to_ds_dict()["amp"]["loss_scale"] == "dynamic"  # apex options are kept
    assert (cfg.config.curriculum_learning.min_difficulty, cfg.config.curriculum_learning.max_difficulty) == (
        8,
        1024,
    )
    assert (
        cfg.config.progressive_layer_drop.theta,
        cfg.config.eigenvalue.max_iter,
        cfg.config.eigenvalue.layer_num,
    ) == (
        0.5,
        50,
        12,
    )
    assert cfg.to_ds_dict()["quantize_training"]["quantize_bits"] == {"start_bits": 16, "target_bits": 8}
    assert cfg.warnings == []


def test_compression_group_default_modules() -> None:
    cfg = _load({"compression_training": {"sparse_pruning": {"different_groups": {"sp1": {"params": {}}}}}})
    assert cfg.config.compression_training.sparse_pruning.different_groups["sp1"].modules == ["*"]


def test_sparse_attention_mode_validated() -> None:
    assert _error({"sparse_attention": {"mode": "weird"}}).key == "sparse_attention.mode"


ELASTIC_V01 = {
    "enabled": True,
    "max_train_batch_size": 2000,
    "micro_batch_sizes": [2, 4, 6],
    "min_gpus": 1,
    "max_gpus": 10000,
    "version": 0.1,
}


def test_elasticity_sets_the_batch() -> None:
    # spec 10.4: v0.1 with world size 8 gives (1680, [...], 6); GAS = 1680 // (6 * 8)
    cfg = load_config({"elasticity": ELASTIC_V01}, world_size=8)
    assert (
        cfg.config.train_batch_size,
        cfg.config.train_micro_batch_size_per_gpu,
        cfg.config.gradient_accumulation_steps,
    ) == (
        1680,
        6,
        35,
    )
    prov = cfg.sources["train_batch_size"]
    assert prov.source is Source.DERIVED and "elasticity" in prov.note


def test_elasticity_rejects_explicit_batch_keys() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 8, "elasticity": ELASTIC_V01}, world_size=8)
    assert info.value.key == "elasticity"
    assert "train_batch_size" in str(info.value) and "ignore_non_elastic_batch_info" in str(info.value)


def test_elasticity_overrides_explicit_batch_keys_when_told_to() -> None:
    block = {**ELASTIC_V01, "ignore_non_elastic_batch_info": True}
    cfg = load_config(
        {"train_batch_size": 8, "gradient_accumulation_steps": 1, "elasticity": block}, world_size=8
    )
    assert (cfg.config.train_batch_size, cfg.config.train_micro_batch_size_per_gpu) == (1680, 6)


def test_elasticity_disabled_leaves_batch_alone() -> None:
    cfg = load_config({"train_batch_size": 8, "elasticity": {**ELASTIC_V01, "enabled": False}}, world_size=2)
    assert cfg.config.train_batch_size == 8 and cfg.config.elasticity.enabled is False


def test_elasticity_block_validation() -> None:
    err = _error({"elasticity": {"enabled": False, "min_gpus": 8, "max_gpus": 4}})
    assert err.rule == "elasticity.max_gpus must be an integer >= min_gpus (8), got 4."
    # one rule set (shardwise.elasticity) for the section and the elastic batch maths: an
    # enabled block's mistake is reported once, not by both
    err = _error({"elasticity": {**ELASTIC_V01, "micro_batch_size": [2]}})
    assert type(err) is ConfigError and err.key == "elasticity"
    assert "Did you mean 'micro_batch_sizes'?" in err.rule
    err = _error({"elasticity": {"enabled": False, "version": 0.3}})
    assert "version must be one of [0.1, 0.2]" in err.rule


# ------------------------------------------------------------------ several problems at once


def test_several_problems_reported_together() -> None:
    with pytest.raises(ConfigErrors) as info:
        load_config(
            {
                "train_batch_size": 30,
                "zero_optimization": {"stage": 9, "overlap_com": True},
                "fp16": {"hysteresis": True},
            },
            world_size=4,
        )
    errs = info.value
    keys = [e.key for e in errs.errors]
    assert keys[0] == "train_batch_size"
    assert set(keys) == {
        "train_batch_size",
        "zero_optimization.stage",
        "zero_optimization.overlap_com",
        "fp16.hysteresis",
    }
    text = str(errs)
    assert text.startswith(f"{len(keys)} problems in the config:")
    for i, key in enumerate(keys, 1):
        assert f"  {i}. '{key}'" in text
    assert text.count("fix:") == len(keys)
    assert isinstance(errs, ConfigError)  # callers catching ConfigError see it


def test_several_cross_section_problems_reported_together() -> None:
    with pytest.raises(ConfigErrors) as info:
        _load({"fp16": {"enabled": True}, "bf16": {"enabled": True}, "nebula": {"enabled": True}})
    assert {e.key for e in info.value.errors} == {"bf16.enabled", "nebula.enabled"}


@pytest.mark.parametrize(
    ("block", "bad", "suggestion"),
    [
        (
            {
                "data_efficiency": {
                    "data_sampling": {
                        "curriculum_learning": {"curriculum_metrics": {"seqlen": {"min_dificulty": 1}}}
                    }
                }
            },
            "data_efficiency.data_sampling.curriculum_learning.curriculum_metrics.seqlen.min_dificulty",
            "min_difficulty",
        ),
        (
            {
                "compression_training": {
                    "weight_quantization": {"different_groups": {"wq1": {"params": {}, "moduls": ["attn"]}}}
                }
            },
            "compression_training.weight_quantization.different_groups.wq1.moduls",
            "modules",
        ),
    ],
)
def test_unknown_key_inside_a_named_group_suggests_the_group_fields(
    block: dict[str, Any], bad: str, suggestion: str
) -> None:
    # entries of a dict of models (curriculum_metrics.<name>, different_groups.<name>) must be
    # checked against their own model's fields, not the top-level keys
    err = _error(block, strict=True)
    assert err.key == bad
    assert f"did you mean '{suggestion}'?" in err.fix
    assert "zero_optimization" not in err.fix


def test_gradient_allreduce_op_ignores_case() -> None:
    """DeepSpeed reads "SUM" as "sum"."""
    assert load_config({"train_batch_size": 1, "gradient_allreduce_op": "SUM"}).config.gradient_allreduce_op == "sum"


def test_pipeline_schedule_spelling_of_real_configs_is_accepted() -> None:
    # a public config (the corpus's BERT-Parallelism-Efficiency) writes "schedule": "1F1B"
    from shardwise.config.sections.features import PipelineConfig

    assert PipelineConfig.model_validate({"schedule": "1F1B"}).schedule == "1f1b"
    assert PipelineConfig.model_validate({"schedule": "Interleaved-1F1B"}).schedule == "interleaved_1f1b"
