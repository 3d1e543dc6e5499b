"""deepspeed.launcher.runner / multinode_runner with DeepSpeed's signatures over shardwise's launcher."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shardwise.compat import launcher_runner as runner


def test_parse_resource_filter() -> None:
    hosts = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    assert runner.parse_resource_filter(hosts) == hosts
    assert runner.parse_resource_filter(hosts, include_str="worker-1:0,3") == {"worker-1": [0, 3]}
    assert runner.parse_resource_filter(hosts, exclude_str="worker-0:0,1@worker-1:3") == {
        "worker-0": [2, 3], "worker-1": [0, 1, 2]}
    assert runner.parse_resource_filter({"w": [0, 1]}, exclude_str="w") == {}
    with pytest.raises(ValueError, match="mutually exclusive"):
        runner.parse_resource_filter(hosts, include_str="worker-0", exclude_str="worker-1")
    with pytest.raises(ValueError, match="jeff"):
        runner.parse_resource_filter(hosts, include_str="jeff")


def test_parse_hostfile_lines() -> None:
    assert runner._parse_hostfile(["worker-1 slots=2", "", "# c", "localhost slots=1"]) == {"worker-1": 2, "localhost": 1}
    for bad in (["w slots=2", "w slots=1"], ["this is bad slots=1"], [""]):
        with pytest.raises(ValueError):
            runner._parse_hostfile(bad)


def test_main_raises_on_conflicting_options() -> None:
    with pytest.raises(ValueError, match="num_nodes/gpus with include/exclude"):
        runner.main(args=["--num_gpus", "1", "-i", "localhost", "foo.py"])


def test_multinode_runner_exports() -> None:
    class Runner(runner.MultiNodeRunner):
        def backend_exists(self) -> bool:
            return True

        def get_cmd(self, environment: dict[str, str], active_resources: object) -> list[str]:
            return []

    r = Runner(SimpleNamespace(user_args=["--prompt", "I'm tall"], user_script="s.py"), "info")
    r.add_export("SLURM_JOB_CPUS_PER_NODE", "64(x2)")
    r.add_export("PYTHONPATH", "/usr/lib/python3/site-packages")
    assert r.exports == {"SLURM_JOB_CPUS_PER_NODE": '"64(x2)"', "PYTHONPATH": "/usr/lib/python3/site-packages"}
    assert r.user_arguments == ["--prompt", "'I'\"'\"'m tall'"] and r.name == "Runner"
