"""Acceptance: a failing rank ends the whole launch quickly with its traceback first; a rank
that skips a collective ends with a diagnosis, not a hang; a sync point (save_checkpoint's
guard) reached by a subset of ranks fails fast naming the missing rank and where it is."""

from __future__ import annotations

import pytest
from launch_helpers import DIST_MODES, free_port, run, shardwise_command, summary

pytestmark = pytest.mark.integration


def launch(tmp_path, mode: str, timeout_seconds: int):
    argv = [*shardwise_command(), "--num_gpus", "2", "--master_port", str(free_port()), str(DIST_MODES), mode]
    return run(argv, tmp_path, SHARDWISE_TIMEOUT_SECONDS=str(timeout_seconds))


def test_one_rank_raising_ends_the_launch_with_its_traceback_first(tmp_path) -> None:
    result = launch(tmp_path, "raise", timeout_seconds=300)
    assert result.returncode == 1
    assert result.seconds < 150  # rank 0 was waiting in a barrier: it is stopped, not left to time out
    text = summary(result).splitlines()
    assert (
        text[0].startswith("======== shardwise: rank 1 (node 0") and "failed first (exit code 1)" in text[0]
    )
    traceback_end = next(i for i, line in enumerate(text) if line.startswith("ValueError"))
    assert text[traceback_end] == "ValueError: rank 1 exploded on purpose"
    assert any('dist_modes.py", line' in line for line in text[1:traceback_end])
    assert "shardwise/launcher" not in "\n".join(text[1:traceback_end])  # the user's frames only
    assert "rank 0" in "\n".join(text[traceback_end:])  # what happened to the other rank


def test_a_skipped_collective_ends_with_a_diagnosis(tmp_path) -> None:
    result = launch(tmp_path, "skip", timeout_seconds=3)
    assert result.returncode != 0
    text = summary(result)
    assert "---- hang diagnosis ----" in text
    # Rank 0 is in all_reduce #2 while rank 1 called barrier as its collective #2.
    assert "all_reduce #2 (group 0)" in text and "barrier" in text
    assert "the ranks called different collectives" in text
    assert "dist_modes.py:" in text  # where each rank was


def test_a_sync_point_on_a_subset_of_ranks_fails_fast(tmp_path) -> None:
    result = launch(tmp_path, "subset", timeout_seconds=300)
    assert result.returncode != 0
    assert result.seconds < 150  # far below the 300 s timeout: the deadlock is detected, not waited out
    text = summary(result)
    assert "save_checkpoint (#1) was called on rank 0 but rank 1 will never call it." in text
    assert "all_reduce #2 (group 0), a collective this rank has not called" in text
    assert "`if rank == 0:`" in text
