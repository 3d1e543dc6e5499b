"""Automatic recovery from the engine's own snapshots: a rank killed at step 5 of 6, torch elastic
restarts the ranks (``--max_restarts 1``), ``load_checkpoint`` at start picks the newest snapshot
(step 4), one step is redone, and the final weights are bit-equal to an uninterrupted run."""

from __future__ import annotations

import pytest
import torch
from launch_helpers import SCRIPTS, free_port, run, shardwise_command

pytestmark = pytest.mark.integration


@pytest.mark.drill  # two attempts of two ranks under the launcher: 35 s on the loaded 2-core machine
def test_a_killed_rank_resumes_from_the_newest_snapshot_bit_exactly(tmp_path) -> None:
    argv = [*shardwise_command(), "--num_gpus", "2", "--max_restarts", "1", "--master_port", str(free_port()),
            str(SCRIPTS / "snapshot_restart.py"), str(tmp_path), "6", "5"]  # fmt: skip
    result = run(argv, tmp_path, timeout=240, OMP_NUM_THREADS="1")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    for rank in (0, 1):
        assert f"restart 0 rank {rank} resumed at step 0" in out, out[-4000:]
        assert f"restart 1 rank {rank} resumed at step 4" in out, out[-4000:]
    snapshot = tmp_path / "snaps" / "snapshot_step4"
    assert (
        f"restart 1: resumed at step 4 from snapshot {snapshot}; the previous run reached step 5: 1 step(s) redone"
        in out
    ), out[-4000:]
    assert torch.equal(torch.load(tmp_path / "final.pt"), torch.load(tmp_path / "reference.pt"))
