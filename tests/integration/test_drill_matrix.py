"""The fault-tolerance drill matrix: every drill under every runner, 3 "nodes" x 1 rank.

The nodes are the cluster in a box (``shardwise.testing.cluster_box``): hosts ``127.0.0.1``-``3``
in a hostfile, the stand-ins for ``ssh``, ``pdsh``, ``srun`` and ``mpirun`` first on ``PATH``, so
each runner's real code path runs (its command line, its exports, its process tree); ``local``
runs the three agents on this machine (``--launcher local`` with the hostfile).

============================  =====  ===  ====  =====  =======
drill                         local  ssh  pdsh  slurm  openmpi
============================  =====  ===  ====  =====  =======
kill -9 a node's agent        yes    yes  yes   yes    yes
kill -9 a rank mid-step       yes    yes  yes   yes    yes
kill -9 mid-save              yes    yes  yes   yes    yes
SIGSTOP a rank (a hang)       yes    yes  yes   yes    yes
read-only checkpoint dir      yes    yes  yes   yes    yes
scale-down 3 -> 2 nodes       yes    yes  yes   no     no
3 nodes == 3 ranks, bitwise   yes    yes  yes   yes    yes
============================  =====  ===  ====  =====  =======

A node's agent is torchrun's agent under local/ssh/pdsh and the node daemon under srun and
mpirun (``slurmstepd``, ``orted`` in the stand-ins). Scale-down needs torchrun's c10d
rendezvous; srun and mpirun start every rank themselves with a fixed world size, and the
launcher refuses ``--elastic_training`` with them (``plan_launch``), so those two cells do not
exist. Every recovery ends with final weights bit-equal to an uninterrupted 3-rank run (the
scale-down: to a run that went from 3 ranks to 2 at the same step).

All cells are ``drill`` (``make test-drills``) except three under ssh that ``make test`` keeps
as a smoke test of the box: a lost node, the read-only directory and the bit-identical losses.
"""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch
from launch_helpers import SCRIPTS, Result, free_port, run

from shardwise.testing.cluster_box import install_stand_ins, node_dir, write_hostfile

pytestmark = pytest.mark.integration

RUNNERS = ("local", "ssh", "pdsh", "slurm", "openmpi")
ELASTIC_RUNNERS = ("local", "ssh", "pdsh")  # srun/mpirun fix the world size: the launcher refuses elastic
HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
STEPS, KILL_AT = "6", "3"
_LOSS = re.compile(r"^step \d+ loss \S+$", re.MULTILINE)


def _cells(runners, cheap: tuple[str, ...] = ()) -> list:
    """One parameter per runner, marked ``drill`` unless it is among the ``cheap`` ones."""
    return [pytest.param(r, marks=() if r in cheap else pytest.mark.drill) for r in runners]


def _node(runner: str, index: int) -> str:
    """How the scripts name node ``index``: its box host, or ``local-node<i>`` under the local runner."""
    return f"local-node{index}" if runner == "local" else HOSTS[index]


def launch(tmp_path, runner: str, script: str, *args: str, options: tuple[str, ...] = (), **env: str) -> Result:
    """Launch ``script`` on 3 box nodes (1 rank each) through ``runner``; return the finished run."""
    bin_dir = install_stand_ins(tmp_path / "box")
    hostfile = write_hostfile(tmp_path / "hostfile", len(HOSTS))
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1", **env}
    if runner == "slurm":  # srun runs inside an allocation of these nodes
        env["SLURM_JOB_NODELIST"] = ",".join(HOSTS)
    argv = [sys.executable, "-m", "shardwise.launcher", "-H", str(hostfile), "--launcher", runner, *options]
    argv += ["--master_port", str(free_port()), str(SCRIPTS / script), *args]
    return run(argv, tmp_path, timeout=200, **env)


def _single_node(cwd, script: str, ranks: int, *args: str) -> Result:
    argv = [sys.executable, "-m", "shardwise.launcher", "--num_gpus", str(ranks), "--master_port", str(free_port())]
    result = run([*argv, str(SCRIPTS / script), *args], cwd, timeout=200, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> torch.Tensor:
    """The final weights of a 3-rank single-node run nothing happens to."""
    cwd = tmp_path_factory.mktemp("uninterrupted")
    _single_node(cwd, "kill_and_resume.py", 3, "ckpt", STEPS, KILL_AT, "none")
    return torch.load(cwd / "ckpt" / "final.pt")


@pytest.fixture(scope="module")
def single_node_losses(tmp_path_factory) -> list[str]:
    losses = _LOSS.findall(_single_node(tmp_path_factory.mktemp("single"), "print_losses.py", 3, "3").stdout)
    assert len(losses) == 3, losses
    return losses


@pytest.fixture(scope="module")
def scaled_by_hand(tmp_path_factory) -> torch.Tensor:
    """3 ranks for 3 steps, then 2 ranks from that checkpoint to step 6 (what an elastic job that
    lost a node at step 3 must reproduce)."""
    cwd = tmp_path_factory.mktemp("by_hand")
    for steps, ranks in (("3", 3), ("6", 2)):
        _single_node(cwd, "elastic_resume.py", ranks, "by_hand", steps, "0")
    return torch.load(cwd / "by_hand" / "final.pt")


# drill: (what the script does at step 3 on the first attempt, the step every rank resumes at)
KILLS = {
    "agent": ("kill -9 a node's agent", KILL_AT),
    "rank": ("kill -9 a rank mid-step", KILL_AT),
    "midsave": ("kill -9 mid-save", str(int(KILL_AT) - 1)),  # the interrupted save is not published
    "stop": ("SIGSTOP a rank", KILL_AT),
}


@pytest.mark.parametrize(
    ("drill", "runner"),
    [  # make test keeps one lost node (ssh) of these
        pytest.param(d, r, marks=() if (d, r) == ("agent", "ssh") else pytest.mark.drill, id=f"{d}-{r}")
        for d in KILLS
        for r in RUNNERS
    ],
)
def test_a_killed_or_hung_node_is_recovered_bit_exactly(tmp_path, uninterrupted, drill: str, runner: str) -> None:
    """Node 2 (rank 1) fails on the first attempt; ``--max_restarts 1`` restarts the job, which
    resumes from the last published checkpoint and ends bit-equal to the uninterrupted run."""
    result = launch(tmp_path, runner, "kill_and_resume.py", "ckpt", STEPS, KILL_AT, drill,
                    options=("--max_restarts", "1"), SHARDWISE_TIMEOUT_SECONDS="15")  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    if drill == "stop":  # the hang is named: the stopped rank and the collective it did not reach
        assert re.search(r"rank 1 did not (reach|arrive)", out), out[-6000:]
    resumed_at = KILLS[drill][1]
    for rank in range(3):
        assert re.search(rf"restart \d rank {rank} resumed at step {resumed_at}(?!\d)", out), out[-6000:]
    assert torch.equal(torch.load(tmp_path / "ckpt" / "final.pt"), uninterrupted)


@pytest.mark.parametrize("runner", _cells(RUNNERS, cheap=("ssh",)))
def test_a_read_only_checkpoint_dir_on_one_node_is_named_and_latest_stays(tmp_path, runner: str) -> None:
    """Node 3's node-local checkpoint directory refuses writes: every rank raises the same error,
    which names rank 2 and its path on node 3; nothing is published and ``latest`` stays ``one``."""
    result = launch(tmp_path, runner, "read_only_node.py", "2", SHARDWISE_TIMEOUT_SECONDS="60")
    assert result.returncode == 0, result.stderr[-4000:]
    if runner == "local":
        read_only = tmp_path / "local-node2" / "ckpt" / ".two.partial"
    else:
        read_only = node_dir((tmp_path / "box").resolve(), HOSTS[2]) / "ckpt" / ".two.partial"
    # the nodes share stdout, so their lines may run into each other: search, do not split lines
    for rank in range(3):
        node = re.escape(_node(runner, rank))
        said = re.search(rf"node {node} rank {rank}: (RuntimeError: .*?Read-only file system: '[^']*')", result.stdout)
        assert said is not None, result.stdout
        assert "saving checkpoint 'two' (nothing published, 'latest' unchanged) failed on 1 rank(s): rank 2" in said[1]
        assert said[1].endswith(f"Read-only file system: '{read_only}'")
        assert f"node {_node(runner, rank)} latest=one" in result.stdout


@pytest.mark.parametrize("runner", _cells(ELASTIC_RUNNERS))
def test_an_elastic_job_loses_a_node_and_keeps_the_global_batch(tmp_path, scaled_by_hand, runner: str) -> None:
    """3 nodes, node 3's agent killed at step 3: the other two re-rendezvous and finish with the
    elasticity block's batch for 2 ranks (gas 3 instead of 2), bit-equal to the run scaled by hand."""
    options = ("--elastic_training", "--min_elastic_nodes", "2", "--max_elastic_nodes", "3")
    result = launch(tmp_path, runner, "elastic_resume.py", "scaled", STEPS, KILL_AT, options=options,
                    SHARDWISE_TIMEOUT_SECONDS="20")  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} of 2 (gas 3) resumed at step {KILL_AT}" in result.stdout, result.stdout
    assert torch.equal(torch.load(tmp_path / "scaled" / "final.pt"), scaled_by_hand)


@pytest.mark.parametrize("runner", _cells(RUNNERS, cheap=("ssh",)))
def test_three_nodes_train_bit_identically_to_three_ranks_on_one_node(tmp_path, runner: str, single_node_losses) -> None:
    result = launch(tmp_path, runner, "print_losses.py", "3")
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in range(3):
        assert f"rank {rank} of 3 on node {_node(runner, rank)}" in result.stdout, result.stdout
    assert _LOSS.findall(result.stdout) == single_node_losses
