"""The node agent's job-failure watch and the restart split between torchrun and the launcher."""

from __future__ import annotations

import signal
import socket
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from shardwise.launcher import agent
from shardwise.launcher.planner import LaunchOptions, assign_ranks
from shardwise.launcher.torchrun_command import agent_restarts, torchrun_args


def test_only_a_fixed_size_multi_node_job_is_watched() -> None:
    base = ["--rdzv-backend=static", "--master-addr=h0", "--master-port=29500", "--node-rank=1"]
    assert agent.static_job(["--nnodes=2", *base, "-m", "w", "--nnodes=1"]) == ("h0", 29500, 1)
    assert agent.static_job(["--nnodes=1", *base]) is None
    assert agent.static_job(["--nnodes=2:3", "--rdzv-backend=c10d", "--rdzv-endpoint=h0:1"]) is None


def test_several_static_nodes_leave_restarts_to_the_launcher() -> None:
    options = LaunchOptions("t.py", python="python", max_restarts=2)
    node = assign_ranks({"a": [0], "b": [0]})[1]
    argv = torchrun_args(options, node, master_addr="a", rendezvous="static", nnodes="2")
    assert "--max-restarts=0" in argv  # every node restarts together, from the launcher
    assert agent_restarts(options, "static", "1") == 2  # one node: torch elastic restarts it
    assert agent_restarts(options, "c10d", "2:3") == 2  # c10d agents restart together


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_announced_failure_stops_the_watching_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    port = _free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    monkeypatch.setattr(agent, "_WATCH_INTERVAL_S", 0.05)
    monkeypatch.setattr(agent, "_children", lambda: [1])  # the agent runs ranks: it watches
    sent: list[int] = []
    stopped = threading.Event()

    def fake_kill(pid: int, sig: int) -> None:
        sent.append(sig)
        stopped.set()

    monkeypatch.setattr(agent.os, "kill", fake_kill)
    watcher = threading.Thread(target=agent._watch, args=("127.0.0.1", port), daemon=True)
    watcher.start()
    assert not stopped.wait(0.5)  # nothing announced: the agent runs on
    server.set(agent.JOB_FAILED_KEY, "2")
    assert stopped.wait(10) and sent == [signal.SIGTERM]
    watcher.join(5)
    assert not watcher.is_alive()
