"""Data efficiency in the real engine on 2 gloo ranks: the model receives the scheduled
``curriculum_seqlen``; random-LTD and the curriculum sampler run through ``initialize``; a run
resumed mid-curriculum equals the uninterrupted one, loss for loss."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_efficiency_cases import (
    custom_schedule_reaches_the_model,
    dataset,
    difficulty_of,
    model_receives_the_scheduled_seqlen,
    resume_mid_curriculum,
)

from shardwise.data_efficiency import DataAnalyzer
from shardwise.data_efficiency.index_files import index_paths
from shardwise.testing import run_distributed, run_distributed_cases

pytestmark = [pytest.mark.distributed]


def test_the_model_receives_the_scheduled_seqlen_on_training_forwards_only() -> None:
    for ranks in run_distributed_cases(model_receives_the_scheduled_seqlen, [{"stage": 0}, {"stage": 3}]):
        for result in ranks:
            seen = result["seen"]
            # 8 steps x 2 micro batches, then one eval forward; step s+1 of 6, from 4 to 16 by 4
            expected = [min(16, max(4, (4 + 12 * (s + 1) // 6) // 4 * 4)) for s in range(8) for _ in range(2)]
            assert [s for s, _ in seen[:-1]] == expected
            assert [length for _, length in seen[:-1]] == expected  # the model got cut inputs
            assert seen[-1] == (None, 16)


def test_set_custom_curriculum_learning_schedule_reaches_the_model() -> None:
    for seen in run_distributed(custom_schedule_reaches_the_model):
        assert seen == [4, 4, 4, 4, 12, 12, 12, 12]


def _index(tmp_path: Path) -> dict[str, str]:
    data = dataset()
    values = difficulty_of(data)
    DataAnalyzer(
        list(range(len(values))), {"first": lambda b: [values[i] for i in b]}, tmp_path, collate_fn=list
    ).run_map_reduce()
    return {k: str(v) for k, v in index_paths(tmp_path, "first").items()}


@pytest.mark.numeric
def test_resume_mid_curriculum_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    index = _index(tmp_path / "index")
    cases = [
        {"stage": 0, "dir": str(tmp_path / "legacy"), "ltd": False, "index": None},
        {"stage": 2, "dir": str(tmp_path / "ltd"), "ltd": True, "index": None},
        {"stage": 1, "dir": str(tmp_path / "sampling"), "ltd": True, "index": index},
        {"stage": 3, "dir": str(tmp_path / "stage3"), "ltd": True, "index": index},
    ]
    results = run_distributed_cases(resume_mid_curriculum, cases, timeout=600)
    for case, ranks in zip(cases, results):
        for result in ranks:
            where = f"stage {case['stage']} ltd={case['ltd']} sampling={case['index'] is not None}"
            assert result["resumed"] == result["reference"], where
            assert result["first"] != result["reference"], where
            assert result["hook_state_equal"], where
            # steps 4-6 of a 6-step curriculum from 4 to 16 by 4 (two micro batches each): the schedule continues
            assert result["seqlens_after_resume"] == [12, 12, 12, 12, 16, 16], where
            if case["ltd"]:
                assert result["kept_after_first"] == [8, 8], where  # step 2 of 6: 4 + 12 * 2 / 6
            assert result["curriculum_sampler"] == (case["index"] is not None), where
            if case["index"] is not None:
                # first token = the metric; the first global batch (step 1 of 8) admits values <= 16
                assert max(result["first_tokens"][0] + result["first_tokens"][1]) <= 16, where
