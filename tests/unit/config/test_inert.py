"""Nothing silently ignored: every entry of ``config.inert`` warns once when set, stays quiet at its
default, is listed by ``config check`` under its own heading and fails ``--strict``."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shardwise.cli.main import main
from shardwise.config import ConfigError, load_config
from shardwise.config.inert import INERT_KEYS, _default_at
from shardwise.config.sections.zero import ZeroConfig
from shardwise.utils.logging import get_logger, logger

BASE: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2}

# one config fragment per registry entry that sets it to something it ignores
EXAMPLES: dict[str, dict[str, Any]] = {
    "disable_allgather": {"disable_allgather": True},
    "sparse_gradients": {"sparse_gradients": True},
    "disable_python_gc": {"disable_python_gc": True},
    "vocabulary_size": {"vocabulary_size": 50257},
    "use_data_before_expert_parallelism": {"use_data_before_expert_parallelism": True},
    "data_parallel_size": {"data_parallel_size": 2},
    "graph_harvesting": {"graph_harvesting": True},
    "weight_quantization": {"weight_quantization": {"bits": 8}},
    "datastates": {"datastates": {"enabled": True}},
    "optimizer.legacy_fusion": {"optimizer": {"type": "AdamW", "params": {}, "legacy_fusion": True}},
    "fp16.fp16_master_weights_and_grads": {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
    "bf16.immediate_grad_update": {"bf16": {"enabled": True, "immediate_grad_update": True}},
    "bf16.bf16_master_weights_and_grads": {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
    "bf16.bf16_optimizer_states": {
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    },
    "amp.opt_level": {"amp": {"enabled": True, "opt_level": "O2"}},
    "torch_autocast.lower_precision_safe_modules": {
        "torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["torch.nn.Linear"]}
    },
    "zero_optimization.contiguous_gradients": {
        "zero_optimization": {"stage": 2, "contiguous_gradients": False}
    },
    "zero_optimization.reduce_scatter": {"zero_optimization": {"stage": 3, "reduce_scatter": False}},
    "zero_optimization.allgather_bucket_size": {
        "zero_optimization": {"stage": 3, "allgather_bucket_size": 2e8}
    },
    "zero_optimization.allgather_partitions": {
        "zero_optimization": {"stage": 0, "allgather_partitions": False}
    },
    "zero_optimization.round_robin_gradients": {
        "zero_optimization": {"stage": 2, "round_robin_gradients": True}
    },
    "zero_optimization.use_multi_rank_bucket_allreduce": {
        "zero_optimization": {"use_multi_rank_bucket_allreduce": False}
    },
    "zero_optimization.elastic_checkpoint": {"zero_optimization": {"stage": 1, "elastic_checkpoint": True}},
    "zero_optimization.compute_grad_norm": {
        "zero_optimization": {"stage": 2, "compute_grad_norm": False},
        "gradient_clipping": 0,
    },
    "zero_optimization.zero_quantized_weights": {
        "zero_optimization": {"stage": 0, "zero_quantized_weights": True}
    },
    "zero_optimization.zero_quantized_nontrainable_weights": {
        "zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}
    },
    "zero_optimization.zero_quantized_gradients": {
        "zero_optimization": {"stage": 1, "zero_quantized_gradients": True}
    },
    "zero_optimization.zero_hpz_partition_size": {
        "zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}
    },
    "zero_optimization.parameter_alignment": {"zero_optimization": {"parameter_alignment": True}},
    "zero_optimization.save_muon_momentum_buffer_in_memory": {
        "zero_optimization": {"save_muon_momentum_buffer_in_memory": True}
    },
    "zero_optimization.zenflow": {"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}},
    "zero_optimization.mics_hierarchical_params_gather": {
        "zero_optimization": {"mics_hierarchical_params_gather": True}
    },
    "zero_optimization.offload_optimizer.fast_init": {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "fast_init": True}}
    },
    "zero_optimization.offload_optimizer.super_offload": {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "super_offload": True}}
    },
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "cpuadam_cores_perc": 0.5}}
    },
    "zero_optimization.offload_param.max_in_cpu": {
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "max_in_cpu": 1000}}
    },
    "aio.use_gds": {"aio": {"use_gds": True}},
    "zero_optimization.offload_param": {
        "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}
    },
    "zero_optimization.overlap_comm": {"zero_optimization": {"stage": 3, "overlap_comm": False}},
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": {
        "zero_optimization": {"stage": 3, "stage3_use_all_reduce_for_fetch_params": True}
    },
    "zero_optimization.memory_efficient_linear": {
        "zero_optimization": {"stage": 3, "memory_efficient_linear": False}
    },
    "zero_optimization.override_module_apply": {
        "zero_optimization": {"stage": 3, "override_module_apply": False}
    },
    "zero_optimization.pipeline_loading_checkpoint": {
        "zero_optimization": {"stage": 3, "pipeline_loading_checkpoint": True}
    },
    "zero_optimization.log_trace_cache_warnings": {
        "zero_optimization": {"stage": 3, "log_trace_cache_warnings": True}
    },
    "zero_optimization.enable_sanity_checks": {
        "zero_optimization": {"stage": 3, "enable_sanity_checks": True}
    },
    "zero_optimization.reduce_bucket_size": {"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}},
    "zero_optimization.sub_group_size": {"zero_optimization": {"stage": 2, "sub_group_size": 1000}},
    "data_efficiency.data_sampling.dynamic_batching": {
        "data_efficiency": {"enabled": True, "data_sampling": {"dynamic_batching": {"enabled": True}}}
    },
    "eigenvalue": {"eigenvalue": {"enabled": True}},
    "quantize_training": {"quantize_training": {"enabled": True}},
    "hybrid_engine": {"hybrid_engine": {"enabled": True}},
    "tensor_parallel.tp_overlap_comm": {"tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True}},
    "tensor_parallel.tp_grain_size": {"tensor_parallel": {"autotp_size": 2, "tp_grain_size": 64}},
    "tensor_parallel.keep_module_on_host": {"tensor_parallel": {"autotp_size": 2, "keep_module_on_host": True}},
    "tensor_parallel.vocab_parallel_ce_backend": {"tensor_parallel": {"vocab_parallel_ce_backend": "liger"}},
    "pipeline.stages": {"pipeline": {"stages": 2}},
    "pipeline.partition": {"pipeline": {"partition": "uniform"}},
    "pipeline.seed_layers": {"pipeline": {"seed_layers": True}},
    "pipeline.pipe_partitioned": {"pipeline": {"pipe_partitioned": False}},
    "pipeline.grad_partitioned": {"pipeline": {"grad_partitioned": False}},
    **{
        f"compile.{key}": {"compile": {key: value}}
        for key, value in (
            ("free_activation", True),
            ("free_activation_threshold", 1024),
            ("offload_activation", True),
            ("offload_activation_pin_memory", False),
            ("offload_opt_states", True),
            ("offload_parameters", True),
            ("double_buffer", False),
            ("symmetric_memory", True),
            ("sync_before_reduce", True),
            ("sync_after_reduce", True),
            ("sync_before_allgather", True),
            ("sync_after_allgather", True),
            ("keep_int_input_tensors", False),
            ("keep_all_input_tensors", True),
            ("backend", "eager"),  # compile.disable left true: nothing compiles at initialize
            ("kwargs", {"fullgraph": True}),
        )
    },
    "checkpoint.writer": {"checkpoint": {"writer": {"type": "fast"}}},
    "checkpoint.parallel_write": {"checkpoint": {"parallel_write": {"pipeline_stage": True}}},
    "checkpoint.checkpoint_serialization": {"checkpoint": {"checkpoint_serialization": False}},
}


@pytest.fixture(autouse=True)
def _keep_log_level() -> Iterator[None]:
    level = get_logger().level
    yield
    get_logger().setLevel(level)


@pytest.fixture
def warnings_logged() -> Iterator[list[str]]:
    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = _Keep(level=logging.WARNING)
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_every_registry_entry_has_an_example() -> None:
    assert set(EXAMPLES) == {entry.path for entry in INERT_KEYS}


@pytest.mark.parametrize("entry", INERT_KEYS, ids=[e.path for e in INERT_KEYS])
def test_each_entry_warns_once_naming_the_key(entry: Any, warnings_logged: list[str]) -> None:
    cfg = load_config({**BASE, **EXAMPLES[entry.path]}, world_size=2)
    (setting,) = [s for s in cfg.ignored if s.path == entry.path]
    # the example sets only this entry (bf16_optimizer_states needs bf16_master_weights_and_grads too)
    assert len(cfg.ignored) == (2 if entry.path == "bf16.bf16_optimizer_states" else 1)
    assert setting.instead == entry.instead and entry.instead in setting.message
    assert [m for m in warnings_logged if f"'{entry.path}'" in m] == [setting.message]
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, **EXAMPLES[entry.path]}, world_size=2, strict=True)
    (error,) = [e for e in getattr(info.value, "errors", [info.value]) if e.key == entry.path]
    assert "strict" in error.rule and error.fix


@pytest.mark.parametrize("name", [n for n in ZeroConfig.model_fields if n.startswith("stage3_")])
def test_stage3_keys_are_reported_below_stage_3_only(name: str) -> None:
    default = ZeroConfig.model_fields[name].default
    value = (not default) if isinstance(default, bool) else default + 1
    zero = {name: value}
    (setting,) = load_config({**BASE, "zero_optimization": {"stage": 2, **zero}}).ignored
    assert setting.path == f"zero_optimization.{name}" and "no effect at stages 0-2" in setting.message
    at_three = [s.path for s in load_config({**BASE, "zero_optimization": {"stage": 3, **zero}}).ignored]
    # only the stage-3 keys FSDP2 has no use for are reported at stage 3 (their own registry entries)
    expected = [setting.path] if name == "stage3_use_all_reduce_for_fetch_params" else []
    assert at_three == expected


def _set_path(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def test_keys_left_at_their_default_do_not_warn() -> None:
    config: dict[str, Any] = {**BASE, "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"}}
    written = 0
    for entry in INERT_KEYS:
        default = _default_at(entry.path)
        if isinstance(default, bool | int | float | str) and not entry.path.startswith(
            "zero_optimization.offload"
        ):
            _set_path(config, entry.path, default)
            written += 1
    assert written > 30
    assert load_config(config, world_size=2).ignored == []


def test_hpz_is_used_at_stage_3_when_it_divides_the_world() -> None:
    zero = {"stage": 3, "zero_hpz_partition_size": 2}
    assert load_config({**BASE, "zero_optimization": zero}, world_size=4).ignored == []
    (setting,) = load_config({**BASE, "zero_optimization": zero}, world_size=3).ignored
    assert setting.path == "zero_optimization.zero_hpz_partition_size"


def test_onebit_optimizers_are_not_listed(warnings_logged: list[str]) -> None:
    # all three compress (shardwise.optim.onebit_adam, zero_one_adam, onebit_lamb): none is listed
    for name in ("OneBitAdam", "ZeroOneAdam", "OneBitLamb"):
        assert load_config({**BASE, "optimizer": {"type": name, "params": {"lr": 1e-3}}}).ignored == []
    assert not [m for m in warnings_logged if "optimizer.type" in m]


def _check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, Any], *flags: str
) -> tuple[int, str]:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    code = main(["config", "check", str(path), "--world-size", "2", *flags])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_config_check_lists_ignored_settings_under_a_heading_and_strict_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {**BASE, **EXAMPLES["zero_optimization.round_robin_gradients"], **EXAMPLES["eigenvalue"]}
    code, text = _check(tmp_path, capsys, config)
    assert code == 0 and "(2 ignored setting(s))" in text
    heading, first, second = text.splitlines()[1:4]
    assert heading.strip() == "accepted but ignored (--strict makes these errors):"
    assert "'zero_optimization.round_robin_gradients' = True has no effect" in first
    assert "section 'eigenvalue' has no effect" in second
    code, text = _check(tmp_path, capsys, config, "--strict")
    assert code == 1 and "2 problems in the config" in text
    assert "'zero_optimization.round_robin_gradients' = True:" in text and "'eigenvalue': section" in text
    code, text = _check(tmp_path, capsys, BASE, "--strict")
    assert code == 0 and "ignored" not in text


#: one example of each seed feature section (the wave-2 sections of DeepSpeed's config reference),
#: the repository's own copy of the project's seed-sections check
SEED_SECTIONS = Path(__file__).resolve().parents[2] / "data" / "configs" / "seed_sections.json"


def test_seed_sections_file_names_every_section_that_does_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tests/data/configs/seed_sections.json enables one example of each wave-2 section; with
    activation_checkpointing (issue 14) the last of them acts, so none is listed any more."""
    seeds = SEED_SECTIONS
    code = main(["config", "check", str(seeds), "--world-size", "2"])
    text = capsys.readouterr().out
    assert code == 0 and "accepted but ignored" not in text
    # implemented (issue 15): the legacy curriculum and random-LTD sections act, so they are not listed
    assert "curriculum_learning" not in text and "data_efficiency" not in text
    # implemented (issue 16): compression_training acts, so it is not listed either
    assert "compression_training" not in text
    # implemented (issue 18): the 1-bit optimizers compress, so they are not listed either
    assert "'optimizer.type'" not in text
    # left at their defaults there: a disabled autotuning block and sparse_gradients: false
    assert "'autotuning'" not in text and "'sparse_gradients'" not in text
    assert "'sparse_attention'" not in text  # a real feature now (shardwise.ops.sparse_attention)
    # activation_checkpointing acts (shardwise.checkpointing, issue 14): no longer listed
    assert "activation_checkpointing" not in text
    # nothing in the file is ignored any more, so --strict has nothing to refuse
    assert main(["config", "check", str(seeds), "--world-size", "2", "--strict"]) == 0


# keys that act now (issue 20): each is reported only where it still means nothing
ACTING = {
    "zero_optimization.reduce_scatter": ({"reduce_scatter": False}, (1, 2), (0, 3)),
    "zero_optimization.allgather_bucket_size": ({"allgather_bucket_size": 1000}, (1, 2), (0, 3)),
    "zero_optimization.allgather_partitions": ({"allgather_partitions": False}, (1, 2), (0, 3)),
    "zero_optimization.zero_quantized_weights": ({"zero_quantized_weights": True}, (1, 2, 3), (0,)),
    "zero_optimization.zero_quantized_gradients": ({"zero_quantized_gradients": True}, (3,), (0, 1, 2)),
    "zero_optimization.ignore_unused_parameters": ({"ignore_unused_parameters": False}, (0, 1, 2, 3), ()),
    "zero_optimization.load_from_fp32_weights": ({"load_from_fp32_weights": False}, (0, 1, 2, 3), ()),
    # issue 38: all-reduce buckets at stages 0-2; at stage 3 only the unsharded parameters' ones
    "zero_optimization.reduce_bucket_size": ({"reduce_bucket_size": 1000}, (0, 1, 2), (3,)),
    # issue 38: stage 3 steps sub-group by sub-group; below it only an offloaded step is split
    "zero_optimization.sub_group_size": ({"sub_group_size": 1000}, (3,), (0, 1, 2)),
}


@pytest.mark.parametrize("path", sorted(ACTING))
def test_keys_that_act_are_reported_only_where_they_do_not(path: str) -> None:
    zero, acting, ignored = ACTING[path]
    for stage in (0, 1, 2, 3):
        paths = [s.path for s in load_config({**BASE, "zero_optimization": {"stage": stage, **zero}}).ignored]
        assert (path in paths) == (stage in ignored), (path, stage, paths)
    assert stage in acting or stage in ignored


def test_dump_state_and_disable_allgather_act() -> None:
    assert load_config({**BASE, "dump_state": True}).ignored == []
    for stage, reported in ((0, True), (1, False), (2, False), (3, True)):
        cfg = load_config({**BASE, "disable_allgather": True, "zero_optimization": {"stage": stage}})
        assert [s.path for s in cfg.ignored] == (["disable_allgather"] if reported else [])


def test_reduce_bucket_size_at_stage_3_says_what_it_still_does(warnings_logged: list[str]) -> None:
    zero = {"stage": 3, "reduce_bucket_size": 1000}
    (setting,) = load_config({**BASE, "zero_optimization": zero}).ignored
    assert setting.message == (
        "'zero_optimization.reduce_bucket_size' = 1000 acts only on unsharded parameters: at stage 3 it "
        "sizes only the all-reduce buckets of the unsharded parameters (those below "
        "stage3_param_persistence_threshold); FSDP2 reduce-scatters the sharded parameters' gradients one "
        "shard unit per collective, whatever this value"
    )
    assert warnings_logged == [setting.message]


@pytest.mark.parametrize("stage", [1, 2])
def test_sub_group_size_below_stage_3_is_reported_only_without_optimizer_offload(stage: int) -> None:
    zero = {"stage": stage, "sub_group_size": 1000}
    (setting,) = load_config({**BASE, "zero_optimization": zero}).ignored
    assert setting.message.startswith(
        "'zero_optimization.sub_group_size' = 1000 has no effect: below stage 3 it splits only the "
        "offloaded optimizer step"
    )
    offloaded = {**zero, "offload_optimizer": {"device": "cpu"}}
    assert load_config({**BASE, "zero_optimization": offloaded}).ignored == []
