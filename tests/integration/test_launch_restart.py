"""Automatic restart: a rank killed mid-run, torch elastic restarts the job, it resumes bit-exactly.

Before attempts had key spaces of their own (``comm.init._attempt_store``) the restarted
ranks raced the previous attempt's keys in torchrun's agent store: on a loaded machine 2 of 5
restarts failed ("Gloo connectFullMesh failed ... Connection refused") or hung.
"""

from __future__ import annotations

import pytest
import torch
from launch_helpers import SCRIPTS, free_port, run, shardwise_command

pytestmark = pytest.mark.integration

SCRIPT = SCRIPTS / "kill_and_resume.py"


def _launch(tmp_path, ckpt: str, kill_at: int, restarts: int) -> str:
    argv = [*shardwise_command(), "--num_gpus", "2", "--master_port", str(free_port())]
    argv += ["--max_restarts", str(restarts), str(SCRIPT), ckpt, "8", str(kill_at)]
    result = run(argv, tmp_path, timeout=240, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def test_a_killed_rank_is_restarted_from_the_last_checkpoint_bit_exactly(tmp_path) -> None:
    out = _launch(tmp_path, "killed", kill_at=3, restarts=1)
    assert "attempt 1 rank 0 resumed at step 3" in out and "attempt 1 rank 1 resumed at step 3" in out, out
    _launch(tmp_path, "uninterrupted", kill_at=0, restarts=0)
    killed = torch.load(tmp_path / "killed" / "final.pt")
    uninterrupted = torch.load(tmp_path / "uninterrupted" / "final.pt")
    assert torch.equal(killed, uninterrupted)
