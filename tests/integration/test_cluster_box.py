"""The cluster in a box itself: what its ssh, pdsh, srun and mpirun stand-ins do.

The runs through every runner (3 "nodes" bit-identical to 3 ranks on one node, and the
fault-tolerance drills) are in ``test_drill_matrix.py``.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from shardwise.testing.cluster_box import SYSTEM_PATH, install_stand_ins, node_dir, write_hostfile

pytestmark = pytest.mark.integration

def test_a_remote_shell_has_only_what_the_runner_exports(tmp_path) -> None:
    bin_dir = install_stand_ins(tmp_path)
    env = {**os.environ, "FORGOTTEN": "set on the launching machine only"}
    line = "echo HOME=$HOME PATH=$PATH FORGOTTEN=$FORGOTTEN; pwd; export SENT=yes; echo SENT=$SENT"
    out = subprocess.run(
        [str(bin_dir / "ssh"), "-p", "22", "127.0.0.2", line], env=env, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    home = str(node_dir(tmp_path.resolve(), "127.0.0.2"))
    assert out[0] == f"HOME={home} PATH={SYSTEM_PATH} FORGOTTEN="
    assert out[1:3] == [home, "SENT=yes"]
    pdsh = subprocess.run(
        [str(bin_dir / "pdsh"), "-S", "-w", "127.0.0.1,127.0.0.3", "echo %n on %h; exit %n"],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert sorted(pdsh.stdout.split("\n")[:2]) == ["0 on 127.0.0.1", "1 on 127.0.0.3"]
    assert pdsh.returncode == 1  # -S: the largest remote exit code


# rank 1 fails with exit code 3; the others would sleep for a minute
_RANK_1_FAILS = 'if [ "$R" = 1 ]; then exit 3; fi; sleep {sleep}'


def _timed(argv: list[str], env: dict[str, str]) -> tuple[int, float]:
    start = time.monotonic()
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    return result.returncode, time.monotonic() - start


def test_mpirun_and_srun_stand_ins_end_the_job_as_their_real_counterparts(tmp_path) -> None:
    """mpirun aborts the job when a rank fails (Open MPI's default); srun ends the step with
    ``--kill-on-bad-exit`` and otherwise lets the others run on (``KillOnBadExit=0``); a node
    daemon killed with ``kill -9`` (a lost node) ends the step either way."""
    bin_dir = install_stand_ins(tmp_path)
    hostfile = write_hostfile(tmp_path / "hostfile", 3)
    env = {**os.environ, "SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.2,127.0.0.3"}
    mpirun = [str(bin_dir / "mpirun"), "-n", "3", "-hostfile", str(hostfile), "/bin/bash", "-c"]
    code, seconds = _timed([*mpirun, "R=$OMPI_COMM_WORLD_RANK; " + _RANK_1_FAILS.format(sleep=60)], env)
    assert (code, seconds < 30) == (3, True)
    srun = [str(bin_dir / "srun"), "-n", "3"]
    code, seconds = _timed([*srun, "--kill-on-bad-exit=1", "/bin/bash", "-c",
                            "R=$SLURM_PROCID; " + _RANK_1_FAILS.format(sleep=60)], env)  # fmt: skip
    assert (code, seconds < 30) == (3, True)
    code, seconds = _timed([*srun, "/bin/bash", "-c", "R=$SLURM_PROCID; " + _RANK_1_FAILS.format(sleep=2)], env)
    assert (code, seconds >= 2) == (3, True)  # without -K the others finish their sleep
    lost_node = 'if [ "$SLURM_PROCID" = 1 ]; then kill -9 $PPID; fi; sleep 60'
    code, seconds = _timed([*srun, "/bin/bash", "-c", lost_node], env)
    assert (code, seconds < 30) == (137, True)
