"""The curriculum sampler: never above the current difficulty, covers the dataset, splits ranks,
several metrics, percentile metrics; the config errors of its sections."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardwise.config import load_config
from shardwise.config.errors import ConfigError
from shardwise.data_efficiency.analyzer import DataAnalyzer
from shardwise.data_efficiency.index_files import index_paths
from shardwise.data_efficiency.metric_index import MetricIndex
from shardwise.data_efficiency.sampler import CurriculumSampler
from shardwise.data_efficiency.sampler_factory import build_curriculum_sampler
from shardwise.data_efficiency.schedule import CurriculumSchedule

N = 200
LENGTHS = np.random.default_rng(1).integers(1, 101, size=N)  # a per-sample metric in [1, 100]


def _linear(lo: int, hi: int, steps: int, k: int = 1) -> CurriculumSchedule:
    return CurriculumSchedule(lo, hi, "fixed_linear", {"total_curriculum_step": steps, "difficulty_step": k})


def _sampler(metrics: list[MetricIndex], **kw: Any) -> CurriculumSampler:
    args = {"num_samples": N, "micro_batch_size": 4, "dp_rank": 0, "dp_size": 1, "num_epochs": 5, **kw}
    return CurriculumSampler(metrics, **args)


def _per_batch(sampler: CurriculumSampler) -> list[tuple[dict, np.ndarray]]:
    out = []
    for batch in sampler.global_batches():
        out.append((dict(sampler.current_difficulties), batch.copy()))
    return out


def test_no_sample_above_the_current_difficulty_and_the_dataset_is_covered() -> None:
    metric = MetricIndex("len", _linear(10, 100, 60), "value", True, LENGTHS.astype(float))
    batches = _per_batch(_sampler([metric], gradient_accumulation_steps=2))
    assert len(batches) == 5 * N // 8
    for difficulties, batch in batches:
        assert len(batch) == 8 and LENGTHS[batch].max() <= difficulties["len"]
    assert batches[0][0]["len"] < 20  # it starts easy
    seen = {int(i) for _, batch in batches for i in batch}
    assert seen == set(range(N))


def test_ranks_split_every_micro_batch_and_agree_on_the_global_batch() -> None:
    metric = MetricIndex("len", _linear(10, 100, 20), "value", True, LENGTHS.astype(float))
    ranks = [list(_sampler([metric], dp_rank=r, dp_size=2, gradient_accumulation_steps=3)) for r in range(2)]
    whole = [
        int(i)
        for b in _sampler([metric], dp_size=2, gradient_accumulation_steps=3).global_batches()
        for i in b
    ]
    assert len(ranks[0]) == len(ranks[1]) == len(_sampler([metric], dp_size=2, gradient_accumulation_steps=3))
    rebuilt = []
    for start in range(0, len(ranks[0]), 4):
        rebuilt += ranks[0][start : start + 4] + ranks[1][start : start + 4]
    assert rebuilt == whole


def test_the_same_seed_gives_the_same_order_and_another_seed_another() -> None:
    metric = MetricIndex("len", _linear(10, 100, 20), "value", True, LENGTHS.astype(float))
    assert list(_sampler([metric])) == list(_sampler([metric]))
    assert list(_sampler([metric])) != list(_sampler([metric], seed=7))


def test_two_metrics_narrow_together_and_percentiles_admit_the_easiest_share() -> None:
    other = (np.arange(N) % 10).astype(float)
    rank = np.empty(N)
    rank[np.argsort(other, kind="stable")] = np.arange(N)
    value = MetricIndex("len", _linear(50, 100, 40), "value", True, LENGTHS.astype(float))
    percentile = MetricIndex("mod", _linear(20, 100, 40), "percentile", True, rank)
    for difficulties, batch in _per_batch(_sampler([value, percentile])):
        assert LENGTHS[batch].max() <= difficulties["len"]
        admitted = (N // 100) * difficulties["mod"] if difficulties["mod"] < 100 else N
        assert rank[batch].max() < admitted


def test_single_cluster_metrics_admit_everything() -> None:
    metric = MetricIndex("seqlen", _linear(8, 64, 10, 8), "value", False, None)
    seen = {int(i) for i in list(_sampler([metric]))[:N]}
    assert len(seen) == N  # one shuffled pass over one cluster


def test_a_difficulty_admitting_nothing_says_what_to_raise() -> None:
    metric = MetricIndex("len", _linear(0, 1000, 1000), "value", True, LENGTHS.astype(float) + 1)
    with pytest.raises(ValueError, match="min_difficulty"):
        list(_sampler([metric]))


# ------------------------------------------------------------------------ config and index files
def _analyzed(tmp_path: Path) -> dict[str, Path]:
    data = [[0] * int(n) for n in LENGTHS]
    DataAnalyzer(data, {"seqlen": lambda b: [len(s) for s in b]}, tmp_path, collate_fn=list).run_map_reduce()
    return index_paths(tmp_path, "seqlen")


def _config(metric: dict[str, Any], **curriculum: Any) -> Any:
    section = {"enabled": True, "curriculum_metrics": {"seqlen": metric}, **curriculum}
    cfg = {
        "train_batch_size": 8,
        "data_efficiency": {
            "enabled": True,
            "seed": 3,
            "data_sampling": {"enabled": True, "num_epochs": 2, "curriculum_learning": section},
        },
    }
    return load_config(cfg).config


def _metric(paths: dict[str, Path], **kw: Any) -> dict[str, Any]:
    prefix = str(paths["index_to_sample"])[: -len(".npz")]  # a DeepSpeed-style prefix works too
    return {
        "index_to_sample_path": prefix,
        "index_to_metric_path": str(paths["index_to_metric"]),
        "difficulty_type": "value",
        "clustering_type": "schedule_based",
        "min_difficulty": 10,
        "max_difficulty": 100,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 20, "difficulty_step": 1},
        **kw,
    }


def _build(cfg: Any, num_samples: int = N) -> CurriculumSampler | None:
    return build_curriculum_sampler(
        cfg, num_samples=num_samples, micro_batch_size=4, dp_rank=0, dp_size=1, gradient_accumulation_steps=2
    )


def test_the_config_builds_a_sampler_from_the_analyzer_files(tmp_path: Path) -> None:
    paths = _analyzed(tmp_path / "index")
    sampler = _build(_config(_metric(paths), data_cluster_path=str(tmp_path / "clusters")))
    assert sampler is not None and sampler.seed == 3 and len(sampler) == 2 * N
    for batch in sampler.global_batches():
        assert LENGTHS[batch].max() <= sampler.current_difficulties["seqlen"]
    assert any((tmp_path / "clusters").iterdir())


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"index_to_sample_path": "/nonexistent/x"}, "index_to_sample_path"),
        ({"index_to_metric_path": None}, "index_to_metric_path"),
        ({"min_difficulty": None}, "min_difficulty"),
        ({"schedule_config": {"difficulty_step": 1}}, "schedule_config.total_curriculum_step"),
    ],
)
def test_inconsistent_metrics_name_the_key(tmp_path: Path, change: dict[str, Any], key: str) -> None:
    paths = _analyzed(tmp_path)
    with pytest.raises(ConfigError) as info:
        _build(_config(_metric(paths, **change)))
    assert (
        info.value.key == f"data_efficiency.data_sampling.curriculum_learning.curriculum_metrics.seqlen.{key}"
    )
    assert info.value.fix


def test_index_files_of_another_dataset_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="indexes 200 samples, but the training data has 150"):
        _build(_config(_metric(_analyzed(tmp_path))), num_samples=150)


def test_no_metric_and_disabled_sections() -> None:
    with pytest.raises(ConfigError, match="at least one metric"):
        _build(
            load_config(
                {
                    "train_batch_size": 8,
                    "data_efficiency": {
                        "enabled": True,
                        "data_sampling": {"enabled": True, "curriculum_learning": {"enabled": True}},
                    },
                }
            ).config
        )
    assert _build(load_config({"train_batch_size": 8}).config) is None


def test_a_metric_named_twice_in_the_file_is_an_error_naming_it(tmp_path: Path) -> None:
    text = (
        '{"train_batch_size": 8, "data_efficiency": {"enabled": true, "data_sampling": {"enabled": true, '
        '"curriculum_learning": {"enabled": true, "curriculum_metrics": {"seqlen": {}, "seqlen": {}}}}}}'
    )
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert info.value.key == "seqlen" and "more than once" in info.value.rule and info.value.fix
