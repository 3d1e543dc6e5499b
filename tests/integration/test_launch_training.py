"""Acceptance: the demo trains through ``shardwise`` on CPU, and two "nodes" x 1 process on
127.0.0.1 (the local runner, static rendezvous, node ranks 0 and 1) train exactly like one
node x 2 processes."""

from __future__ import annotations

import re
import sys

import pytest
from launch_helpers import EXAMPLE, EXAMPLE_CONFIG, free_port, run, shardwise_command

pytestmark = pytest.mark.integration

_FINAL = re.compile(r"^loss [\d.]+ -> [\d.]+ after 2 steps .*$", re.MULTILINE)


def test_two_nodes_of_one_process_train_like_one_node_of_two(tmp_path) -> None:
    script = [str(EXAMPLE), "--deepspeed", "--deepspeed_config", str(EXAMPLE_CONFIG), "--steps", "2"]
    one_node = run(
        [*shardwise_command(), "--num_gpus", "2", "--master_port", str(free_port()), *script], tmp_path
    )
    assert one_node.returncode == 0, one_node.stderr[-4000:]
    assert "| 2 ranks | ZeRO stage 2 | bf16 |" in one_node.stdout

    two_nodes = run(
        [sys.executable, "-m", "shardwise.launcher", "--launcher", "local", "--num_nodes", "2", "--num_gpus", "1",
         "--master_port", str(free_port()), *script],
        tmp_path,
    )  # fmt: skip
    assert two_nodes.returncode == 0, two_nodes.stderr[-4000:]
    assert "node 1 local-1: ranks 1" in two_nodes.stderr  # really two node agents

    final_one, final_two = _FINAL.findall(one_node.stdout), _FINAL.findall(two_nodes.stdout)
    assert len(final_one) == 1, one_node.stdout
    # Same ranks, same data, same maths: the loss and gradient norm agree to the printed digit.
    assert final_one == final_two
