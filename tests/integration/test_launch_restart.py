"""Restarts on one node (2 ranks, torch elastic's in-node restarts): a rank dies (or hangs)
mid-run, the job restarts and resumes bit-exactly.

Every test kills at step 3 of 6 on the first attempt only, restarts, resumes from the last
published checkpoint, and must end with weights bit-equal to an uninterrupted run of the same
world size. The multi-node drills (3 nodes under every runner) are in ``test_drill_matrix.py``.

Before attempts had key spaces of their own (``comm.init._attempt_store``) the restarted
ranks raced the previous attempt's keys in torchrun's agent store: on a loaded machine 2 of 5
restarts failed ("Gloo connectFullMesh failed ... Connection refused") or hung.
"""

from __future__ import annotations

import re

import pytest
import torch
from launch_helpers import SCRIPTS, free_port, run, shardwise_command

pytestmark = pytest.mark.integration

SCRIPT = SCRIPTS / "kill_and_resume.py"
STEPS, KILL_AT = "6", "3"


def _launch(cwd, ckpt: str, mode: str, *options: str, **env: str) -> str:
    argv = [*shardwise_command(), *options, "--master_port", str(free_port())]
    argv += [str(SCRIPT), ckpt, STEPS, KILL_AT, mode]
    result = run(argv, cwd, timeout=280, OMP_NUM_THREADS="1", **env)
    assert result.returncode == 0, result.stderr[-6000:]
    return result.stdout + result.stderr


def _final(cwd, ckpt: str) -> torch.Tensor:
    return torch.load(cwd / ckpt / "final.pt")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, torch.Tensor]:
    """The final weights of a 2-rank run nothing happens to."""
    cwd = tmp_path_factory.mktemp("reference")
    _launch(cwd, "two", "none", "--num_gpus", "2")
    return {2: _final(cwd, "two")}


@pytest.mark.parametrize(
    ("mode", "resumed_at"),
    [("rank", 3), ("midsave", 2)],
    ids=["kill -9 a rank mid-step", "kill -9 the publishing rank mid-save"],
)
def test_a_killed_rank_is_restarted_from_the_last_published_checkpoint(
    tmp_path, uninterrupted, mode: str, resumed_at: int
) -> None:
    out = _launch(tmp_path, "ckpt", mode, "--num_gpus", "2", "--max_restarts", "1")
    for rank in (0, 1):
        assert f"restart 1 rank {rank} resumed at step {resumed_at}" in out, out[-4000:]
    assert torch.equal(_final(tmp_path, "ckpt"), uninterrupted[2])


@pytest.mark.drill  # waits out the collective timeout and torch elastic's 30 s stop grace
def test_a_hung_rank_is_named_then_the_job_recovers(tmp_path, uninterrupted) -> None:
    out = _launch(
        tmp_path, "ckpt", "stop", "--num_gpus", "2", "--max_restarts", "1", SHARDWISE_TIMEOUT_SECONDS="15"
    )
    assert re.search(r"rank 1 did not (reach|arrive)", out), out[-4000:]  # the hung rank, named
    assert "restart 1 rank 0 resumed at step 3" in out, out[-4000:]
    assert torch.equal(_final(tmp_path, "ckpt"), uninterrupted[2])
