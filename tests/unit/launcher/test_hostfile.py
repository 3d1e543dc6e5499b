"""Launcher planning: hostfile parsing, include/exclude selection, world info, ranks and env (spec 9.2-9.4)."""

from __future__ import annotations

import logging
import re

import pytest

from shardwise.launcher.hostfile import parse_hostfile, read_hostfile
from shardwise.launcher.resources import (
    NodePlan,
    assign_ranks,
    child_env,
    decode_world_info,
    encode_world_info,
    include_from_visible_devices,
    parse_env_file,
    parse_node_spec,
    select_resources,
)
from shardwise.utils.logging import logger

POOL4 = {"worker-0": 4, "worker-1": 4}
POOL3 = {"worker-0": 4, "worker-1": 4, "worker-2": 4}


# ---------------------------------------------------------------- hostfile


def test_hostfile_parses_entries_in_order_skipping_comments_and_blanks() -> None:
    text = "# cluster\n\nworker-1 slots=2\n   \n  worker-0 slots=8\n#worker-9 slots=1\nworker-2 slots=4 # rack B\n"
    hosts = parse_hostfile(text)
    assert hosts == {"worker-1": 2, "worker-0": 8, "worker-2": 4}
    assert list(hosts) == ["worker-1", "worker-0", "worker-2"]


def test_hostfile_ignores_trailing_text_after_slot_count() -> None:
    assert parse_hostfile("node slots=4 max_slots=8 extra\n") == {"node": 4}
    assert parse_hostfile("node slots=4# was slots=2\n") == {"node": 4}  # a comment may say anything


@pytest.mark.parametrize(
    ("line", "second"), [("worker-0 slots=2 slots=3", "slots=3"), ("worker-0 slots=2 x slots = 8", "slots=8")]
)
def test_hostfile_repeated_slots_key_names_the_line_the_key_and_the_fix(line: str, second: str) -> None:
    with pytest.raises(ValueError, match="gives the key 'slots' twice") as info:
        parse_hostfile(f"ok slots=1\n{line}\n", source="hosts.txt")
    message = str(info.value)
    assert "hosts.txt:2" in message and repr(line) in message
    assert f"(slots=2 and {second})" in message
    assert "Give it once, with the host's total slot count: 'worker-0 slots=<N>'" in message


@pytest.mark.parametrize(
    "line", ["worker-0", "worker-0 slots=", "worker-0 slots=x", "slots=4", "worker-0 4", "worker-0 slots=4x"]
)
def test_hostfile_bad_line_names_line_number_text_and_form(line: str) -> None:
    with pytest.raises(ValueError, match="bad entry") as info:
        parse_hostfile(f"ok slots=1\n# c\n{line}\n", source="hosts.txt")
    message = str(info.value)
    assert "hosts.txt:3" in message
    assert repr(line) in message
    assert "slots=<N>" in message


def test_hostfile_duplicate_host_names_both_lines() -> None:
    with pytest.raises(ValueError, match="multiple entries for worker-0") as info:
        parse_hostfile("worker-0 slots=2\nworker-1 slots=2\nworker-0 slots=4\n", source="hf")
    assert "hf:1" in str(info.value) and "hf:3" in str(info.value)


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n   \n"])
def test_hostfile_without_entries_is_an_error(text: str) -> None:
    with pytest.raises(ValueError, match="empty or not formatted correctly"):
        parse_hostfile(text)


def test_hostfile_zero_slots_is_an_error() -> None:
    with pytest.raises(ValueError, match="slots=0") as info:
        parse_hostfile("a slots=1\nb slots=0\n", source="hf")
    assert "hf:2" in str(info.value)


def test_read_hostfile_from_disk(tmp_path) -> None:
    path = tmp_path / "hostfile"
    path.write_text("a slots=2\nb slots=2\n")
    assert read_hostfile(path) == {"a": 2, "b": 2}
    bad = tmp_path / "bad"
    bad.write_text("a slots=2\nnonsense\n")
    with pytest.raises(ValueError, match=re.escape(f"{bad}:2")):
        read_hostfile(bad)


def test_read_hostfile_missing(tmp_path, monkeypatch) -> None:
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = _Keep()
    logger.addHandler(handler)
    try:
        assert read_hostfile(tmp_path / "nope", missing_ok=True) is None
    finally:
        logger.removeHandler(handler)
    assert any("Unable to find hostfile" in r.getMessage() for r in records)
    with pytest.raises(FileNotFoundError, match="nope"):
        read_hostfile(tmp_path / "nope")


# ---------------------------------------------------------------- node specs and selection


def test_parse_node_spec_bare_host_means_all_slots_and_repeats_merge() -> None:
    assert parse_node_spec("worker-0:0,2@worker-1") == {"worker-0": [0, 2], "worker-1": None}
    assert parse_node_spec("a:1@a:0") == {"a": [1, 0]}
    assert parse_node_spec("a:1@a") == {"a": None}
    assert parse_node_spec(" a : 1, 2 ") == {"a": [1, 2]}


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [("a@@b", "empty node spec"), ("@a", "empty node spec"), (":0", "no host name"), ("a:x", "'x'"), ("a:", "''"),
     ("a:-1", "'-1'"), ("a:0,,1", "''")],
)  # fmt: skip
def test_parse_node_spec_errors(spec: str, fragment: str) -> None:
    with pytest.raises(ValueError, match="--exclude") as info:
        parse_node_spec(spec, option="--exclude")
    assert fragment in str(info.value)


def test_include_example_from_spec() -> None:
    assert select_resources(POOL4, include="worker-0:0,2@worker-1") == {
        "worker-0": [0, 2],
        "worker-1": [0, 1, 2, 3],
    }


def test_include_keeps_hostfile_order_and_removes_duplicate_slots() -> None:
    result = select_resources(POOL3, include="worker-2:3,1,3@worker-0:2,2")
    assert result == {"worker-0": [2], "worker-2": [1, 3]}
    assert list(result) == ["worker-0", "worker-2"]


def test_exclude_examples_from_spec() -> None:
    assert select_resources(POOL4, exclude="worker-1:0") == {"worker-0": [0, 1, 2, 3], "worker-1": [1, 2, 3]}
    assert select_resources(POOL3, exclude="worker-0@worker-2:1") == {
        "worker-1": [0, 1, 2, 3],
        "worker-2": [0, 2, 3],
    }


def test_exclude_dropping_every_slot_drops_the_host() -> None:
    assert select_resources({"a": 2, "b": 2}, exclude="a:0,1") == {"b": [0, 1]}


def test_no_filters_returns_the_whole_pool() -> None:
    assert select_resources({"b": 1, "a": 2}) == {"b": [0], "a": [0, 1]}


def test_pool_may_be_given_as_slot_lists() -> None:
    assert select_resources({"a": [3, 1, 1], "b": []}) == {"a": [1, 3]}
    assert select_resources({"a": [1, 3]}, exclude="a:3") == {"a": [1]}


def test_unknown_host_and_slot_errors() -> None:
    with pytest.raises(ValueError, match="Hostname 'worker-7' not found in hostfile"):
        select_resources(POOL4, include="worker-7")
    with pytest.raises(ValueError, match="Hostname 'worker-7' not found in hostfile"):
        select_resources(POOL4, exclude="worker-7:0")
    with pytest.raises(ValueError, match="No slot '4' specified on host 'worker-1'"):
        select_resources(POOL4, include="worker-1:4")
    with pytest.raises(ValueError, match="No slot '9' specified on host 'worker-0'"):
        select_resources(POOL4, exclude="worker-0:1,9")


def test_mutual_exclusions() -> None:
    with pytest.raises(ValueError, match="mutually exclusive"):
        select_resources(POOL4, include="worker-0", exclude="worker-1")
    with pytest.raises(ValueError, match="Cannot specify num_nodes/gpus with include/exclude"):
        select_resources(POOL4, include="worker-0", num_nodes=1)
    with pytest.raises(ValueError, match="Cannot specify num_nodes/gpus with include/exclude"):
        select_resources(POOL4, exclude="worker-0", num_gpus=1)


def test_num_nodes_keeps_first_hosts() -> None:
    assert select_resources(POOL3, num_nodes=2) == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    assert select_resources({"z": 1, "a": 1}, num_nodes=1) == {"z": [0]}


def test_num_gpus_example_from_spec() -> None:
    assert select_resources(POOL4, num_gpus=2) == {"worker-0": [0, 1], "worker-1": [0, 1]}
    assert select_resources(POOL3, num_nodes=1, num_gpus=3) == {"worker-0": [0, 1, 2]}


def test_counts_beyond_the_pool_and_invalid_counts_are_errors() -> None:
    with pytest.raises(ValueError, match="num_nodes=3 but only 2 host"):
        select_resources(POOL4, num_nodes=3)
    with pytest.raises(ValueError, match=r"num_gpus=2 needs slots 0\.\.1 on every host, but host 'b'"):
        select_resources({"a": 4, "b": 1}, num_gpus=2)
    for kwargs in ({"num_nodes": 0}, {"num_gpus": -2}, {"num_gpus": True}):
        with pytest.raises(ValueError, match="positive integer"):
            select_resources(POOL4, **kwargs)


def test_empty_pool_and_empty_result_are_errors() -> None:
    with pytest.raises(ValueError, match="no GPU resources available"):
        select_resources({"localhost": 0})
    with pytest.raises(ValueError, match="No resources left"):
        select_resources({"a": 1}, exclude="a")
    with pytest.raises(ValueError, match="slot count or a list"):
        select_resources({"a": "4"})  # type: ignore[arg-type]


def test_visible_devices_become_a_localhost_include() -> None:
    include = include_from_visible_devices("1,3")
    assert include == "localhost:1,3"
    assert select_resources({"localhost": 4}, include=include) == {"localhost": [1, 3]}


# ---------------------------------------------------------------- world info


def test_world_info_base64_example_and_round_trip() -> None:
    assert encode_world_info({"localhost": [0, 1]}) == "eyJsb2NhbGhvc3QiOiBbMCwgMV19"
    assert decode_world_info("eyJsb2NhbGhvc3QiOiBbMCwgMV19") == {"localhost": [0, 1]}
    world = {"worker-0": [0, 2], "worker-1": [1]}
    encoded = encode_world_info(world)
    assert "+" not in encoded and "/" not in encoded
    assert decode_world_info(encoded) == world


@pytest.mark.parametrize(
    "bad", ["%%%", "bm90IGpzb24=", "WzEsIDJd", "eyJhIjogWy0xXX0="]
)  # junk, 'not json', [1, 2], {"a": [-1]}
def test_decode_world_info_rejects_bad_input(bad: str) -> None:
    with pytest.raises(ValueError, match="World info"):
        decode_world_info(bad)


# ---------------------------------------------------------------- ranks and child env


def test_assign_ranks_two_hosts_two_slots() -> None:
    plans = assign_ranks({"worker-0": [0, 1], "worker-1": [0, 1]})
    assert plans == [
        NodePlan(
            node_rank=0, host="worker-0", local_slots=(0, 1), global_ranks=(0, 1), num_nodes=2, world_size=4
        ),
        NodePlan(
            node_rank=1, host="worker-1", local_slots=(0, 1), global_ranks=(2, 3), num_nodes=2, world_size=4
        ),
    ]
    assert plans[1].local_size == 2
    assert plans[1].visible_devices == "0,1"


def test_child_env_for_two_by_two_plan() -> None:
    plans = assign_ranks({"worker-0": [0, 1], "worker-1": [0, 1]})
    env = child_env(plans[1], 1, "10.0.0.1", 29500)
    assert env == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_SIZE": "2",
        "CROSS_RANK": "1",
        "CROSS_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    all_envs = [child_env(p, i, "h", "29501") for p in plans for i in range(p.local_size)]
    assert [e["RANK"] for e in all_envs] == ["0", "1", "2", "3"]
    assert [e["LOCAL_RANK"] for e in all_envs] == ["0", "1", "0", "1"]
    assert {e["MASTER_PORT"] for e in all_envs} == {"29501"}


def test_uneven_hosts_get_contiguous_ranks_and_true_local_ranks() -> None:
    plans = assign_ranks({"a": [0, 2, 3], "b": [1, 2]})
    assert [p.global_ranks for p in plans] == [(0, 1, 2), (3, 4)]
    assert plans[1].visible_devices == "1,2"
    # RANK % LOCAL_SIZE would give 1 for rank 3; the index on the node is 0.
    assert child_env(plans[1], 0, "a", 1)["LOCAL_RANK"] == "0"
    assert child_env(plans[1], 0, "a", 1)["RANK"] == "3"


def test_assign_ranks_and_child_env_errors() -> None:
    with pytest.raises(ValueError, match="no host has any slot"):
        assign_ranks({"a": []})
    plan = assign_ranks({"a": [0, 1]})[0]
    with pytest.raises(ValueError, match=r"local_index must be in \[0, 2\)"):
        child_env(plan, 2, "h", 29500)
    for port in (0, 70000, "http"):
        with pytest.raises(ValueError, match="master_port"):
            child_env(plan, 0, "h", port)
    with pytest.raises(ValueError, match="master_addr"):
        child_env(plan, 0, "", 29500)


# ---------------------------------------------------------------- env file


def test_parse_env_file() -> None:
    text = (
        "# comment\n\nNCCL_IB_DISABLE=1\n  PYTHONPATH=/a:/b  \nOPTS=--x=1 --y=2\nEMPTY=\nNCCL_IB_DISABLE=0\n"
    )
    assert parse_env_file(text) == {
        "NCCL_IB_DISABLE": "0",
        "PYTHONPATH": "/a:/b",
        "OPTS": "--x=1 --y=2",
        "EMPTY": "",
    }


@pytest.mark.parametrize("line", ["JUST_A_NAME", "export A=1", "=value", "1BAD=x"])
def test_parse_env_file_bad_line_names_the_line(line: str) -> None:
    with pytest.raises(ValueError, match="KEY=VALUE") as info:
        parse_env_file(f"A=1\n{line}\n", source=".shardwise_env")
    assert ".shardwise_env:2" in str(info.value)
    assert repr(line) in str(info.value)
