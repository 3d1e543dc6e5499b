"""DeepSpeed names that real training code imports (Megatron-DeepSpeed, DeepSpeedExamples, OpenRLHF):
constants, the curriculum scheduler, random-LTD's state-dict helpers, the module-path helpers, the TP
seed reconfiguration, ds_report, and their resolution through the installed ``deepspeed`` package.

Expected values were read from DeepSpeed 0.19.8 (its ``deepspeed.utils.timer``, ``deepspeed.constants``,
``deepspeed.checkpoint.constants``; ``CurriculumScheduler.update_difficulty`` on the configs below;
``remove_random_ltd_state_dict``; ``model_parallel_reconfigure_tp_seed`` after a tracker stream exists).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from deepspeed_install import installed_deepspeed
from torch import nn

from shardwise.checkpointing import rng
from shardwise.cli import report_cmd
from shardwise.compat import (
    checkpoint_constants,
    curriculum_scheduler,
    process_env,
    timer_names,
)
from shardwise.compat.op_builder import OpBuilder
from shardwise.config.errors import ConfigError
from shardwise.data_efficiency.random_ltd import (
    convert_to_random_ltd,
    remove_random_ltd_state_dict,
    save_without_random_ltd,
)
from shardwise.launcher.planner import LaunchOptions
from shardwise.tensor_parallel.gather import GatherReplacedLayerParams
from shardwise.testing.models import Block, GPTConfig, TinyGPT
from shardwise.utils.module_paths import recursive_getattr, recursive_setattr

# DeepSpeed 0.19.8's values
TIMERS = {
    "FORWARD_GLOBAL_TIMER": "fwd", "FORWARD_MICRO_TIMER": "fwd_microstep",
    "BACKWARD_GLOBAL_TIMER": "bwd", "BACKWARD_MICRO_TIMER": "bwd_microstep",
    "BACKWARD_INNER_GLOBAL_TIMER": "bwd_inner", "BACKWARD_INNER_MICRO_TIMER": "bwd_inner_microstep",
    "BACKWARD_REDUCE_GLOBAL_TIMER": "bwd_allreduce", "BACKWARD_REDUCE_MICRO_TIMER": "bwd_allreduce_microstep",
    "STEP_GLOBAL_TIMER": "step", "STEP_MICRO_TIMER": "step_microstep",
}
PROCESS = {"CROSS_RANK": "CROSS_RANK", "CROSS_SIZE": "CROSS_SIZE", "LOCAL_RANK": "LOCAL_RANK",
           "TORCH_DISTRIBUTED_DEFAULT_PORT": 29500}
CHECKPOINT = {
    "UNIVERSAL_CHECKPOINT_INFO": "universal_checkpoint_info",
    "UNIVERSAL_CHECKPOINT_VERSION_KEY": "universal_checkpoint_version",
    "UNIVERSAL_CHECKPOINT_VERSION_VALUE": 0.4,
    "ORIGINAL_VOCAB_SIZE": "original_vocab_size",
    "PADDED_VOCAB_SIZE": "padded_vocab_size",
    "VOCABULARY_PARAMETER_PATTERNS": "vocabulary_parameter_patterns",
    "PIPELINE_REPLICATED_PARAMETER_PATTERNS": "pipeline_replicated_parameter_patterns",
    "TP_REPLICATED_PARAMETER_PATTERNS": "tp_replicated_parameter_patterns",
    "PARAMETER_WITH_ROW_PARALLELISM_PATTERNS": "parameter_with_row_parallelism_patterns",
    "PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0": "parameter_with_2_sub_params_cat_dim_0",
}
STEPS = (0, 1, 5, 6, 10, 11, 50, 100, 101)
CURRICULA: list[tuple[dict[str, Any], list[int], int]] = [  # config, update_difficulty(STEPS), get_difficulty(3)
    ({"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
      "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}},
     [8, 8, 32, 40, 64, 64, 64, 64, 64], 24),
    ({"min_difficulty": 8, "max_difficulty": 1024, "schedule_type": "fixed_root",
      "schedule_config": {"total_curriculum_step": 100, "difficulty_step": 8, "root_degree": 2}},
     [8, 104, 232, 256, 328, 344, 720, 1024, 1024], 176),
    ({"min_difficulty": 1, "max_difficulty": 3, "schedule_type": "fixed_discrete",
      "schedule_config": {"difficulty": [1, 2, 3], "max_step": [5, 10]}},
     [1, 1, 1, 2, 2, 3, 3, 3, 3], 1),
]


def test_constants_have_deepspeeds_values() -> None:
    for module, expected in ((timer_names, TIMERS), (process_env, PROCESS), (checkpoint_constants, CHECKPOINT)):
        assert {name: getattr(module, name) for name in expected} == expected
    assert LaunchOptions.master_port == process_env.TORCH_DISTRIBUTED_DEFAULT_PORT  # the launcher's default


@pytest.mark.parametrize(("config", "difficulties", "at_3"), CURRICULA)
def test_curriculum_scheduler_follows_deepspeeds_schedule(config: dict[str, Any], difficulties: list[int],
                                                          at_3: int) -> None:
    scheduler = curriculum_scheduler.CurriculumScheduler(config)
    assert [scheduler.update_difficulty(step) for step in STEPS] == difficulties
    assert scheduler.get_difficulty(3) == at_3
    assert sorted(scheduler.state) == [
        "current_difficulty", "max_difficulty", "min_difficulty", "schedule_config", "schedule_type"]


def test_curriculum_scheduler_custom_and_bad_config() -> None:
    scheduler = curriculum_scheduler.CurriculumScheduler(
        {"min_difficulty": 2, "max_difficulty": 10, "schedule_type": "custom"})
    scheduler.set_custom_get_difficulty(lambda step: min(2 + step, 10))
    assert [scheduler.update_difficulty(step) for step in (0, 3, 8, 9)] == [2, 5, 10, 10]
    assert "schedule_config" not in scheduler.state
    with pytest.raises(ConfigError, match="max_difficulty"):
        curriculum_scheduler.CurriculumScheduler({"min_difficulty": 1, "schedule_type": "fixed_linear"})
    with pytest.raises(ConfigError, match="total_curriculum_step"):
        curriculum_scheduler.CurriculumScheduler({"min_difficulty": 1, "max_difficulty": 2, "schedule_type": "fixed_linear",
                                                  "schedule_config": {"difficulty_step": 8}})


def test_random_ltd_state_dict_helpers_restore_the_unconverted_names() -> None:
    assert list(remove_random_ltd_state_dict(
        {"a.random_ltd_layer.w": 1, "b.random_ltd_layer.c.random_ltd_layer.w": 2, "x.random_ltd_layerX": 3, "h": 4}
    ).items()) == [("a.w", 1), ("b.c.w", 2), ("xX", 3), ("h", 4)]  # DeepSpeed's output for this input
    torch.manual_seed(0)
    plain = TinyGPT(GPTConfig(n_layer=2, n_embd=8))
    converted = convert_to_random_ltd(TinyGPT(GPTConfig(n_layer=2, n_embd=8)), Block)
    assert any(".random_ltd_layer." in key for key in converted.state_dict())
    stripped = save_without_random_ltd(converted)
    assert list(stripped) == list(plain.state_dict())
    plain.load_state_dict(stripped)  # loads into the model before conversion
    holder = nn.Module()
    holder.module = converted  # an engine-like wrapper: its .module is saved
    assert list(save_without_random_ltd(holder)) == list(stripped)


def test_deepspeeds_convert_to_random_ltd_wraps_a_model_and_refuses_an_engine() -> None:
    import shardwise
    from shardwise.compat.data_routing import convert_to_random_ltd as ds_convert

    model = ds_convert(TinyGPT(GPTConfig(n_layer=2, n_embd=8)), Block)  # DeepSpeed's two arguments
    assert [type(b).__name__ for b in model.blocks] == ["RandomLTDLayer", "RandomLTDLayer"]
    engine, *_ = shardwise.initialize(model=nn.Linear(2, 2), config={"train_micro_batch_size_per_gpu": 1})
    with pytest.raises(TypeError, match="before initialize"):
        ds_convert(engine, Block)


def test_recursive_getattr_and_setattr() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU()))
    recursive_setattr(model, "1.0", nn.Tanh())
    assert isinstance(recursive_getattr(model, "1.0"), nn.Tanh) and isinstance(model[1][0], nn.Tanh)
    assert recursive_getattr(model, "0.weight").shape == (2, 2)
    with pytest.raises(AttributeError):
        recursive_getattr(model, "2")


def test_model_parallel_reconfigure_tp_seed_reseeds_only_the_tp_stream() -> None:
    saved = rng.get_cuda_rng_tracker().get_states()
    try:
        rng.model_parallel_cuda_manual_seed(1, tp_rank=0)
        before = torch.get_rng_state().clone()
        rng.model_parallel_reconfigure_tp_seed(5, tp_rank=0)
        assert torch.equal(before, torch.get_rng_state())  # the default generator is untouched
        with rng.get_cuda_rng_tracker().fork():
            drawn = torch.rand(3)
        # DeepSpeed draws [0.7585, 0.4482, 0.6721] here: the stream seeded with 5 + 2718 + tp_rank
        assert torch.allclose(drawn, torch.tensor([0.7585, 0.4482, 0.6721]), atol=1e-4)
        rng.get_cuda_rng_tracker().reset()
        with pytest.raises(KeyError, match="model-parallel-rng"):
            rng.model_parallel_reconfigure_tp_seed(5, tp_rank=0)
    finally:
        rng.get_cuda_rng_tracker().set_states(saved)


def test_ds_report_prints_the_report_and_hides_the_feature_table(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(report_cmd, "collect_report", lambda: {
        "versions": {"shardwise": "x"}, "features": [{"feature": "csv monitor", "needs": "nothing", "available": True}]})
    report_cmd.ds_report()
    shown = capsys.readouterr().out
    assert "shardwise" in shown and "[OK] csv monitor" in shown
    report_cmd.ds_report(hide_operator_status=True)
    assert "csv monitor" not in capsys.readouterr().out


def test_op_builder_is_rocm_pytorch_reports_torchs_build() -> None:
    assert OpBuilder.is_rocm_pytorch() is (getattr(torch.version, "hip", None) is not None)
    assert OpBuilder.is_sycl_enabled() is False


def test_gather_replaced_layer_params_without_split_parameters_does_nothing() -> None:
    model = nn.Linear(3, 2)
    context = GatherReplacedLayerParams(model.parameters(), model)
    assert not context.enabled
    with context:
        assert model.weight.shape == (2, 3)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        GatherReplacedLayerParams([model.weight], object())


def test_data_analyzer_with_deepspeeds_arguments_writes_deepspeeds_rows(tmp_path: Path) -> None:
    # DeepSpeed 0.19.8's DataAnalyzer on these eight samples (batch_size 3, one worker) writes index_to_metric
    # [1, 2, 3, 4, 5] and index_to_sample (and its percentile-merged form) [[1, 3], [2, 5, 6], [0], [7], [4]]
    from shardwise.compat.data_analyzer import DataAnalyzer
    from shardwise.data_efficiency.index_files import read_index_to_metric, read_index_to_sample

    data = [torch.ones(n) for n in (3, 1, 2, 1, 5, 2, 2, 4)]

    def seqlen(batch: list[torch.Tensor]) -> torch.Tensor:
        return torch.tensor([len(sample) for sample in batch])

    common: dict[str, Any] = {"batch_size": 3, "metric_names": ["seqlen"], "metric_functions": [seqlen],
                              "metric_types": ["single_value_per_sample"], "save_path": str(tmp_path),
                              "collate_fn": list}
    for worker in (0, 1):  # two workers' maps, then the reduce
        DataAnalyzer(data, num_workers=2, worker_id=worker, metric_dtypes=[torch.int64], **common).run_map()
    DataAnalyzer(data, num_workers=2, num_threads_reduce=2, metric_dtypes=[torch.int64], **common).run_reduce()
    prefix = f"{tmp_path}/seqlen/seqlen_"  # DeepSpeed's paths, as a config names them
    for name in ("index_to_sample", "index_to_sample_percentile_merged"):
        rows = read_index_to_sample(prefix + name, "index_to_sample_path")
        assert [rows.row(i).tolist() for i in range(len(rows))] == [[1, 3], [2, 5, 6], [0], [7], [4]]
    assert read_index_to_metric(prefix + "index_to_metric", "index_to_metric_path").tolist() == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="dtype"):  # DeepSpeed's map asserts the values' dtype too
        DataAnalyzer(data, metric_dtypes=[np.int64], **{**common, "save_path": str(tmp_path / "x")}).run_map()
    with pytest.raises(ValueError, match="single_value_per_sample"):
        DataAnalyzer(data, metric_dtypes=[torch.int64], **{**common, "metric_types": ["accumulate_value_over_samples"]})
    with pytest.raises(ValueError, match="custom_reduce"):
        DataAnalyzer(data, metric_dtypes=[torch.int64], custom_reduce=print, **common)


@pytest.fixture
def deepspeed_package(tmp_path: Path) -> Iterator[Any]:
    with installed_deepspeed(tmp_path) as package:  # a fresh install per test
        yield package


def test_names_resolve_through_the_deepspeed_package(deepspeed_package: Any) -> None:
    from shardwise.compat import accelerator
    from shardwise.data import RepeatingLoader
    from shardwise.pipe.engine import PipelineEngine

    ds = deepspeed_package
    assert ds.version == ds.__version__ == "0.19.8" and ds.version >= "0.16.4"  # OpenRLHF's check
    assert ds.PipelineEngine is PipelineEngine
    real = importlib.import_module("deepspeed.accelerator.real_accelerator")
    assert real.get_accelerator is accelerator.get_accelerator and real.set_accelerator is accelerator.set_accelerator
    assert importlib.import_module("deepspeed.env_report").main is report_cmd.ds_report
    assert importlib.import_module("deepspeed.ops.op_builder.builder").OpBuilder is OpBuilder
    checkpoint = importlib.import_module("deepspeed.checkpoint")
    assert {name: getattr(checkpoint, name) for name in CHECKPOINT} == CHECKPOINT
    timer = importlib.import_module("deepspeed.utils.timer")
    assert {name: getattr(timer, name) for name in TIMERS} == TIMERS
    ds_constants = importlib.import_module("deepspeed.constants")
    assert {name: getattr(ds_constants, name) for name in PROCESS} == PROCESS
    assert ds.checkpointing.model_parallel_reconfigure_tp_seed is rng.model_parallel_reconfigure_tp_seed
    assert ds.runtime.zero.partition_parameters.ZeroParamStatus.NOT_AVAILABLE.value == 2
    assert importlib.import_module("deepspeed.compression.helper").recursive_setattr is recursive_setattr
    assert importlib.import_module("deepspeed.utils.module_utils").recursive_getattr is recursive_getattr
    loader = importlib.import_module("deepspeed.runtime.dataloader").RepeatingLoader
    assert loader is RepeatingLoader
    it = loader([1, 2])
    assert [next(it) for _ in range(5)] == [1, 2, 1, 2, 1]  # DeepSpeed's output
    from shardwise.compat import data_routing

    helper = importlib.import_module("deepspeed.runtime.data_pipeline.data_routing.helper")
    assert (helper.convert_to_random_ltd, helper.save_without_random_ltd, helper.remove_random_ltd_state_dict) == (
        data_routing.convert_to_random_ltd, save_without_random_ltd, remove_random_ltd_state_dict)
    scheduler = importlib.import_module("deepspeed.runtime.data_pipeline.curriculum_scheduler").CurriculumScheduler
    assert scheduler is curriculum_scheduler.CurriculumScheduler
    assert ds.module_inject.layers.GatherReplacedLayerParams is GatherReplacedLayerParams
    from shardwise.data.mmap_indexed import MMapIndexedDataset, MMapIndexedDatasetBuilder

    indexed = importlib.import_module("deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset")
    assert (indexed.MMapIndexedDataset, indexed.MMapIndexedDatasetBuilder) == (MMapIndexedDataset, MMapIndexedDatasetBuilder)
    analyzer = importlib.import_module("deepspeed.runtime.data_pipeline.data_sampling.data_analyzer").DataAnalyzer
    from shardwise.compat.data_analyzer import DataAnalyzer

    assert analyzer is DataAnalyzer
