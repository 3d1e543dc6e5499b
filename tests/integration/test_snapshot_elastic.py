"""An elastic job resumes from the engine's snapshot on the nodes that remain (a drill)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from launch_helpers import SCRIPTS, free_port, run

from shardwise.testing.cluster_box import install_stand_ins, write_hostfile

pytestmark = pytest.mark.integration

SCRIPT = str(SCRIPTS / "snapshot_elastic.py")


@pytest.mark.drill  # three launches and a rendezvous round that waits for the lost node
def test_an_elastic_job_loses_a_node_and_resumes_from_the_snapshot_with_the_unconsumed_samples(tmp_path) -> None:
    """3 nodes snapshot every 2 steps; node 3's agent is killed after step 3: the other two
    re-rendezvous, ``load_checkpoint`` at start picks the step-2 snapshot, and they finish with the
    elastic batch for 2 ranks (gas 3), within 1e-6 of a run that went from 3 ranks to 2 at step 2."""
    bin_dir = install_stand_ins(tmp_path / "box")
    hostfile = write_hostfile(tmp_path / "hostfile", 3)
    snap = tmp_path / "snap"
    argv = [sys.executable, "-m", "shardwise.launcher", "-H", str(hostfile), "--launcher", "ssh", "--elastic_training",
            "--min_elastic_nodes", "2", "--max_elastic_nodes", "3", "--master_port", str(free_port()),
            SCRIPT, str(snap), "6", "snap"]  # fmt: skip
    result = run(argv, tmp_path, timeout=280, OMP_NUM_THREADS="1", SHARDWISE_TIMEOUT_SECONDS="20",
                 PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} of 2 (gas 3) resumed at step 2" in out, out[-4000:]
    assert (
        f"resumed at step 2 from snapshot {snap / 'snaps' / 'snapshot_step2'}; the previous run reached step 3: "
        "1 step(s) redone; world size 3 -> 2" in out
    ), out[-4000:]
    by_hand = tmp_path / "by_hand"
    for steps, ranks in (("2", "3"), ("6", "2")):  # the reference: 3 ranks, then 2 from step 2
        done = run([sys.executable, "-m", "shardwise.launcher", "--num_gpus", ranks, "--master_port", str(free_port()),
                    SCRIPT, str(by_hand), steps, "save"], tmp_path, OMP_NUM_THREADS="1")  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
    assert torch.allclose(torch.load(snap / "final.pt"), torch.load(by_hand / "final.pt"), rtol=1e-6, atol=0)
