"""Periodic snapshots across a scale-down: 2 ranks snapshot every 2 steps and die at step 3; one
rank resumes from the step-2 snapshot with the elastic batch kept (gas 2 -> 4) and continues with
exactly the samples the two ranks had not consumed. The reference is an uninterrupted run that
changed size at step 2 (a save at two ranks, a load at one). The same two ranks also check that a
pipeline engine's ``train_batch`` snapshots and its ``load_checkpoint`` resumes from one."""

from __future__ import annotations

import pytest
import snapshot_cases as cases
import torch

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed


def test_a_run_killed_after_a_snapshot_resumes_on_fewer_ranks_with_the_unconsumed_samples(tmp_path) -> None:
    ref, snap = str(tmp_path / "reference"), str(tmp_path / "snapshots")
    two = run_distributed_cases(cases.run, [
        {"op": "save", "root": ref, "steps": 2},
        {"op": "snapshots", "root": snap, "steps": 3, "interval": 2},  # killed after step 3
        {"op": "pipeline", "root": str(tmp_path / "pipeline")},
        {"op": "agree"},
    ], world_size=2)  # fmt: skip
    one = run_distributed_cases(cases.run, [
        {"op": "resume", "root": ref, "steps": 5},
        {"op": "resume", "root": snap, "steps": 5, "interval": 2},
    ], world_size=1)  # fmt: skip
    (saved, killed, pipelined, agreed), (reference, resumed) = two, [results[0] for results in one]
    assert saved[0]["gas"] == 2 and reference["gas"] == 4  # the elastic batch: 8 = 2 x 2 x 2 = 2 x 4 x 1
    assert reference["resumed_at"] == resumed["resumed_at"] == 2
    assert resumed["report"].startswith("resumed at step 2 from snapshot ")
    assert resumed["report"].endswith("the previous run reached step 3: 1 step(s) redone; world size 2 -> 1")

    # the data position: the one rank goes on with exactly the samples two ranks had not consumed
    before = sorted(i for rank in saved for step in rank["seen"] for i in step)
    assert len(before) == len(set(before)) == 16
    after = [i for step in resumed["seen"] for i in step]
    assert after == [i for step in reference["seen"] for i in step] and len(after) == 24
    assert not set(after) & set(before) and len(set(after)) == 24
    # the step the killed run trained (its 3rd) is the resumed run's 3rd, sample for sample
    assert sorted(killed[0]["seen"][2] + killed[1]["seen"][2]) == sorted(resumed["seen"][0])

    # within 1e-6 of the run that changed size at the same step (the snapshot is the same state)
    assert torch.allclose(resumed["weights"], reference["weights"], rtol=1e-6, atol=0)

    # node-local storage that differs by node: every rank tries the same candidates, those all nodes hold
    assert [rank["agreed"] for rank in agreed] == [["global_step5", "snapshot_step4"]] * 2

    # a pipeline engine's train_batch snapshots too, and its load_checkpoint resumes from the snapshot
    for rank in pipelined:
        assert rank["resumed_at"] == 2 and rank["redone"] == rank["losses"][2:]  # step 3 again, bit-exactly

