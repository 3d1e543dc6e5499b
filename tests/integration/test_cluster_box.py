"""Three "nodes" on loopback (127.0.0.1-3) under every runner's real code path.

The stand-ins for ssh, pdsh, srun and mpirun (``shardwise.testing.cluster_box``) go first on
PATH; the launcher builds and starts its real commands. A 3-node run must print losses bit
identical to a 3-rank single-node run (same ranks, same data, same reductions).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from launch_helpers import SCRIPTS, free_port, run

from shardwise.testing.cluster_box import SYSTEM_PATH, install_stand_ins, node_dir, write_hostfile

pytestmark = pytest.mark.integration

SCRIPT = SCRIPTS / "print_losses.py"
_LOSS = re.compile(r"^step \d+ loss \S+$", re.MULTILINE)


def _launch(cwd, *options: str, **env: str):
    argv = [sys.executable, "-m", "shardwise.launcher", *options, "--master_port", str(free_port()), str(SCRIPT), "3"]
    result = run(argv, cwd, timeout=240, OMP_NUM_THREADS="1", **env)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


@pytest.fixture(scope="module")
def single_node_losses(tmp_path_factory) -> list[str]:
    out = _launch(tmp_path_factory.mktemp("single"), "--num_gpus", "3")
    losses = _LOSS.findall(out)
    assert len(losses) == 3, out
    return losses


@pytest.mark.parametrize("runner", ["ssh", "pdsh", "slurm", "openmpi"])
def test_three_nodes_train_bit_identically_to_one_node(tmp_path, runner: str, single_node_losses) -> None:
    bin_dir = install_stand_ins(tmp_path / "box")
    hostfile = write_hostfile(tmp_path / "hostfile", 3)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    if runner == "slurm":  # srun runs inside an allocation of these nodes
        env["SLURM_JOB_NODELIST"] = "127.0.0.1,127.0.0.2,127.0.0.3"
    out = _launch(tmp_path, "-H", str(hostfile), "--launcher", runner, **env)
    for rank in range(3):
        assert f"rank {rank} of 3 on node 127.0.0.{rank + 1}" in out, out
    assert _LOSS.findall(out) == single_node_losses


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


def test_a_read_only_checkpoint_directory_on_one_node_is_named_on_every_rank(tmp_path) -> None:
    bin_dir = install_stand_ins(tmp_path / "box")
    hostfile = write_hostfile(tmp_path / "hostfile", 3)
    argv = [sys.executable, "-m", "shardwise.launcher", "-H", str(hostfile), "--launcher", "ssh"]
    argv += ["--master_port", str(free_port()), str(SCRIPTS / "read_only_node.py"), "127.0.0.3"]
    result = run(argv, tmp_path, timeout=240, OMP_NUM_THREADS="1", SHARDWISE_TIMEOUT_SECONDS="60",
                 PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    read_only = str(node_dir((tmp_path / "box").resolve(), "127.0.0.3") / "ckpt" / ".two.partial")
    # the nodes share stdout, so their lines may run into each other: search, do not split lines
    for rank in range(3):
        said = re.search(rf"node 127\.0\.0\.{rank + 1} rank {rank}: (RuntimeError: .*?Read-only file system: '[^']*')",
                         result.stdout)  # fmt: skip
        assert said is not None, result.stdout
        assert "saving checkpoint 'two' (nothing published, 'latest' unchanged) failed on 1 rank(s): rank 2" in said[1]
        assert said[1].endswith(f"Read-only file system: '{read_only}'")
        assert f"node 127.0.0.{rank + 1} latest=one" in result.stdout


@pytest.mark.drill  # three launches and a rendezvous round that waits for the lost node
def test_an_elastic_job_loses_a_node_and_carries_on_with_the_same_global_batch(tmp_path) -> None:
    """3 nodes, node 3's agent killed at step 3: the other two re-rendezvous and finish with
    the elasticity block's batch for 2 ranks (gas 3 instead of 2), bit-equal to a run that
    went from 3 ranks to 2 at the same step by hand."""
    script = str(SCRIPTS / "elastic_resume.py")
    bin_dir = install_stand_ins(tmp_path / "box")
    hostfile = write_hostfile(tmp_path / "hostfile", 3)
    argv = [sys.executable, "-m", "shardwise.launcher", "-H", str(hostfile), "--launcher", "ssh", "--elastic_training",
            "--min_elastic_nodes", "2", "--max_elastic_nodes", "3", "--master_port", str(free_port()),
            script, "scaled", "6", "3"]  # fmt: skip
    result = run(argv, tmp_path, timeout=280, OMP_NUM_THREADS="1", SHARDWISE_TIMEOUT_SECONDS="20",
                 PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} of 2 (gas 3) resumed at step 3" in result.stdout, result.stdout
    for steps, ranks in (("3", "3"), ("6", "2")):  # the reference: 3 ranks, then 2 from step 3
        by_hand = run([sys.executable, "-m", "shardwise.launcher", "--num_gpus", ranks, "--master_port",
                       str(free_port()), script, "by_hand", steps, "0"], tmp_path, OMP_NUM_THREADS="1")  # fmt: skip
        assert by_hand.returncode == 0, by_hand.stderr[-4000:]
    scaled, reference = torch.load(tmp_path / "scaled" / "final.pt"), torch.load(tmp_path / "by_hand" / "final.pt")
    assert torch.equal(scaled, reference)
