"""The ``shardwise`` launcher without launching: plans, backend commands, the worker's contract,
failure summaries, hang-diagnosis text, and the ``report`` / ``elastic`` sub-commands.

Everything here is pure or runs in this process (plus two ``python -c`` children for the
process runner); real launches are in ``tests/integration``.
"""

from __future__ import annotations

import faulthandler
import json
import shlex
import sys
import time
from pathlib import Path

import pytest

from shardwise.cli import main as cli_main
from shardwise.cli.report_cmd import collect_report, format_report
from shardwise.comm.diagnostics import (
    Frame,
    _last_words,
    _not_arrived_error,
    describe_status,
    enable_flight_recorder,
    format_hang_report,
    parse_faulthandler_dump,
    rank_ranges,
    short_error,
    summarize_flight_record,
    summarize_frames,
    why_cannot_arrive,
)
from shardwise.launcher.exports import collect_exports, env_file_paths
from shardwise.launcher.failures import (
    FailureRecord,
    format_failure_summary,
    read_records,
    read_stopped_locations,
    write_record,
)
from shardwise.launcher.node import node_command
from shardwise.launcher.planner import (
    LaunchOptions,
    find_deepspeed_config,
    plan_launch,
    resolve_resources,
)
from shardwise.launcher.resources import decode_world_info
from shardwise.launcher.runners import MVAPICH_HOSTFILE, RunnerCommand, build_commands, run_commands
from shardwise.launcher.worker import (
    _parse,
    cores_for_rank,
    parse_core_list,
    script_argv,
    worker_environment,
)

PY = "python"


def opts(script: str = "train.py", *args: str, **kw) -> LaunchOptions:
    return LaunchOptions(script, tuple(args), python=PY, **kw)


def plan(options: LaunchOptions, pool=None, devices: int = 0, environ=None, env_files=None, cwd: str = "/w"):
    return plan_launch(
        options, pool=pool, device_count=devices, environ=environ or {}, cwd=cwd, env_files=env_files
    )


# ---------------------------------------------------------------- planning


def test_cpu_machine_num_gpus_means_cpu_processes_on_one_local_node() -> None:
    p = plan(opts("train.py", "--deepspeed_config", "ds.json", num_gpus=2))
    assert p.runner == "local" and p.world_size == 2 and p.master_addr == "127.0.0.1"
    (node,) = p.nodes
    assert list(node.argv) == [
        PY, "-u", "-m", "shardwise.launcher.agent", "--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=static",
        "--master-addr=127.0.0.1", "--master-port=29500", "--node-rank=0", "--max-restarts=0",
        "-m", "shardwise.launcher.worker", "--", "train.py", "--deepspeed_config", "ds.json",
    ]  # fmt: skip
    assert "CUDA_VISIBLE_DEVICES" not in node.env  # no GPUs: nothing to restrict
    assert plan(opts()).world_size == 1  # without --num_gpus on a CPU machine: one process


def test_gpu_machine_uses_every_gpu_and_visible_devices_become_slots() -> None:
    p = plan(opts(), devices=4)
    assert p.resources == {"localhost": [0, 1, 2, 3]} and p.nodes[0].env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    # CUDA_VISIBLE_DEVICES=2,3: this process sees 2 GPUs, the ranks get physical 2 and 3.
    p = plan(opts(), devices=2, environ={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert p.resources == {"localhost": [2, 3]} and p.nodes[0].env["CUDA_VISIBLE_DEVICES"] == "2,3"
    p = plan(opts(num_gpus=1), devices=2, environ={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert p.resources == {"localhost": [2]}  # the first visible GPU, not GPU 0
    with pytest.raises(ValueError, match="num_gpus=8"):
        plan(opts(num_gpus=8), devices=4)
    with pytest.raises(ValueError, match="shows 2 GPU"):
        plan(opts(num_gpus=3), devices=2, environ={"CUDA_VISIBLE_DEVICES": "2,3"})


def test_several_nodes_need_a_hostfile_except_for_the_local_runner() -> None:
    with pytest.raises(ValueError, match=r"needs a hostfile.*--launcher local"):
        plan(opts(num_nodes=2))
    p = plan(opts(num_nodes=2, num_gpus=1, launcher="local"))
    assert p.runner == "local" and list(p.resources) == ["local-0", "local-1"]
    assert [n.argv[9] for n in p.nodes] == ["--node-rank=0", "--node-rank=1"]
    assert all("--nnodes=2" in n.argv and "--master-addr=127.0.0.1" in n.argv for n in p.nodes)


def test_hostfile_plan_keeps_hostfile_order_and_targets_the_first_host() -> None:
    pool = {"worker-1": 4, "worker-0": 4, "worker-2": 2}
    p = plan(opts(include="worker-2@worker-1:0,2"), pool=pool)
    assert p.resources == {"worker-1": [0, 2], "worker-2": [0, 1]}
    assert p.runner == "pdsh" and p.master_addr == "worker-1" and p.world_size == 4
    assert [(n.node.host, n.node.global_ranks) for n in p.nodes] == [
        ("worker-1", (0, 1)),
        ("worker-2", (2, 3)),
    ]
    assert p.nodes[0].env["CUDA_VISIBLE_DEVICES"] == "0,2"
    assert decode_world_info(p.world_info) == p.resources
    # one host without --force_multi runs locally (DeepSpeed's single-node path)
    assert plan(opts(include="worker-0"), pool=pool).runner == "local"
    assert plan(opts(include="worker-0", force_multi=True), pool=pool).runner == "pdsh"


def test_elastic_plan_uses_c10d_with_a_node_range() -> None:
    pool = {"a": 2, "b": 2, "c": 2}
    p = plan(opts(elastic_training=True, min_elastic_nodes=2), pool=pool)
    assert p.rendezvous == "c10d" and p.nnodes == "2:3"
    argv = p.nodes[0].argv
    assert (
        "--rdzv-backend=c10d" in argv
        and "--rdzv-endpoint=a:29500" in argv
        and "--rdzv-id=shardwise-29500" in argv
    )
    assert "--max-restarts=3" in argv and not any(a.startswith("--node-rank") for a in argv)
    # only the first node's agent hosts the rendezvous store (not whichever agent binds first)
    hosts = [next(a for a in n.argv if a.startswith("--rdzv-conf=")) for n in p.nodes]
    assert hosts == ["--rdzv-conf=is_host=true"] + ["--rdzv-conf=is_host=false"] * 2
    assert plan(opts(rdzv_backend="c10d"), pool=pool).nnodes == "3"
    for runner in ("slurm", "openmpi"):  # srun/mpirun fix the world size: no silent non-elastic run
        with pytest.raises(ValueError, match=f"--elastic_training cannot be honoured by --launcher {runner}"):
            plan(opts(elastic_training=True, launcher=runner), pool=pool)


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [
        ({"elastic_training": True, "min_elastic_nodes": 3, "max_elastic_nodes": 2}, "min <= max"),
        ({"elastic_training": True, "no_local_rank": True}, "--no_local_rank"),
        ({"elastic_training": True, "rdzv_backend": "static"}, "c10d"),
        ({"no_python": True, "module": True}, "exclude each other"),
        ({"no_ssh": True}, "--node_rank"),
        ({"no_ssh": True, "node_rank": 5}, "out of range"),
        ({"launcher": "openmpi", "include": "a@b"}, "mpirun"),
        ({"launcher": "bogus"}, "not one of"),
        ({"master_port": 0}, "1..65535"),
    ],
)
def test_plan_errors_name_the_option(kw: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        plan(opts(**kw), pool={"a": 1, "b": 1})


def test_no_ssh_launches_only_this_node_with_its_hostfile_rank() -> None:
    p = plan(opts(no_ssh=True, node_rank=1), pool={"a": 2, "b": 3})
    assert p.runner == "local" and p.master_addr == "a"
    (node,) = p.nodes
    assert node.node.host == "b" and "--node-rank=1" in node.argv and "--nproc-per-node=3" in node.argv


def test_worker_flags_and_each_rank_log() -> None:
    p = plan(opts("mod.name", "x", module=True, no_local_rank=True, bind_cores_to_rank=True,
                  bind_core_list="0-3", each_rank_log="/logs"))  # fmt: skip
    argv = list(p.nodes[0].argv)
    assert argv[argv.index("--log-dir=/logs") + 1] == "--redirects=3"
    worker = argv[argv.index("shardwise.launcher.worker") + 1 :]
    assert worker == ["--no_local_rank", "--module", "--bind_cores_to_rank", "--bind_core_list=0-3", "--", "mod.name",
                      "x"]  # fmt: skip


def test_resolve_resources_examples() -> None:
    assert resolve_resources(opts(num_gpus=3), None, 0, {}) == {"localhost": [0, 1, 2]}
    assert resolve_resources(opts(exclude="localhost:1"), None, 4, {}) == {"localhost": [0, 2, 3]}


# ---------------------------------------------------------------- exports and env files


def test_exports_forward_deepspeed_prefixes_and_ours_to_remote_nodes_only() -> None:
    environ = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/lib", "HOME": "/h", "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
               "UCX_TLS": "tcp", "MLFLOW_X": "1", "SHARDWISE_TIMEOUT": "5", "PYTHONHOME": "/x", "OTHER": "no"}  # fmt: skip
    remote = collect_exports(environ, {}, remote=True, cwd="/w")
    assert remote == {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/w:/lib", "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
                      "UCX_TLS": "tcp", "MLFLOW_X": "1", "SHARDWISE_TIMEOUT": "5"}  # fmt: skip
    assert collect_exports(environ, {}, remote=False, cwd="/w") == {}
    aisc = collect_exports(
        {"AISC_JOB_NAME": "j", "NCCL_IB_HCA": "mlx", "NCCL_X": "1"}, {}, remote=True, cwd="/w"
    )
    assert "NCCL_IB_HCA" not in aisc and aisc["NCCL_X"] == "1"


def test_env_files_apply_on_every_node_later_files_win() -> None:
    files = {
        "/h/.deepspeed_env": "A=home\nB=keep",
        "/w/.deepspeed_env": "A=cwd",
        "/w/.shardwise_env": "C=x=y",
    }
    p = plan(opts(num_gpus=1), env_files=files)
    assert p.exports == {"A": "cwd", "B": "keep", "C": "x=y"}
    assert p.nodes[0].env == p.exports
    remote = plan(opts(), pool={"a": 1, "b": 1}, env_files=files)
    assert all(n.env["A"] == "cwd" and n.env["CUDA_VISIBLE_DEVICES"] == "0" for n in remote.nodes)
    with pytest.raises(ValueError, match=r"/w/.deepspeed_env:2"):
        plan(opts(), env_files={"/w/.deepspeed_env": "OK=1\nexport BAD=1"})


def test_env_file_paths_and_ds_env_file_override() -> None:
    assert env_file_paths({"DS_ENV_FILE": "custom.env"}, "/w", "/h")[:2] == ["/h/custom.env", "/w/custom.env"]
    assert env_file_paths({"DS_ENV_FILE": "/abs/e"}, "/w", "/h")[0] == "/abs/e"


def test_find_deepspeed_config() -> None:
    assert find_deepspeed_config(["--deepspeed", "--deepspeed_config", "a.json", "--x"]) == "a.json"
    assert find_deepspeed_config(["--deepspeed-config=b.json"]) == "b.json"
    assert find_deepspeed_config(["--deepspeed_config"]) is None


# ---------------------------------------------------------------- backend commands


POOL = {"w0": 2, "w1": 2}


def test_local_runner_runs_one_agent_per_node() -> None:
    p = plan(opts(num_nodes=2, num_gpus=2, launcher="local"))
    commands = build_commands(p, "/w")
    assert [c.label for c in commands] == ["node 0 (local-0)", "node 1 (local-1)"]
    assert all(c.argv == n.argv for c, n in zip(commands, p.nodes))


def test_pdsh_command_runs_the_node_entry_with_percent_n() -> None:
    p = plan(
        opts("t.py", "--a", "1 2", launcher_args="-l root"), pool=POOL, environ={"NCCL_X": "1"}, cwd="/my dir"
    )
    (cmd,) = build_commands(p, "/my dir")
    assert cmd.argv[:8] == ("pdsh", "-S", "-f", "1024", "-w", "w0,w1", "-l", "root") and cmd.env == {
        "PDSH_RCMD_TYPE": "ssh"
    }
    remote = cmd.argv[8]
    assert remote.startswith("export NCCL_X=1; export PYTHONPATH='/my dir'; cd '/my dir'; ")
    words = shlex.split(remote.split("; ")[-1])
    assert words[:4] == [PY, "-u", "-m", "shardwise.launcher.node"] and "--node_rank=%n" in words
    assert words[-3:] == ["t.py", "--a", "1 2"]  # an argument with a space survives the remote shell
    # what a node does with it: its own slots and rank
    entry = words[4:]
    node_argv, node_env = node_command([a.replace("%n", "1") for a in entry], python=PY)
    assert node_env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert (
        "--node-rank=1" in node_argv and "--nproc-per-node=2" in node_argv and "--master-addr=w0" in node_argv
    )


def test_node_entry_uses_each_nodes_own_slot_count() -> None:
    p = plan(opts(), pool={"a": 2, "b": 3}, devices=0)
    (cmd,) = build_commands(p, "/w")
    entry = shlex.split(cmd.argv[-1].split("; ")[-1])[4:]
    counts = [node_command([a.replace("%n", str(i)) for a in entry], python=PY)[0][5] for i in range(2)]
    assert counts == ["--nproc-per-node=2", "--nproc-per-node=3"]
    with pytest.raises(ValueError, match="outside"):
        node_command([a.replace("%n", "2") for a in entry], python=PY)


def test_ssh_runner_sends_each_node_its_own_torchrun() -> None:
    p = plan(opts(launcher="ssh", ssh_port=2222, venv_script="/env/bin/activate"), pool=POOL)
    commands = build_commands(p, "/w")
    assert [c.argv[:4] for c in commands] == [("ssh", "-p", "2222", "w0"), ("ssh", "-p", "2222", "w1")]
    assert (
        "export CUDA_VISIBLE_DEVICES=0,1; source /env/bin/activate; cd /w; python -u -m"
        in commands[1].argv[4]
    )
    assert "--node-rank=1" in commands[1].argv[4]


def test_openmpi_command() -> None:
    p = plan(opts("t.py", launcher="openmpi", hostfile="/hf"), pool=POOL)
    (cmd,) = build_commands(p, "/w")
    argv = list(cmd.argv)
    assert argv[:10] == ["mpirun", "-n", "4", "-hostfile", "/hf", "--mca", "btl", "^openib", "--mca",
                         "btl_tcp_if_include"]  # fmt: skip
    assert "MASTER_ADDR=w0" in argv and "MASTER_PORT=29500" in argv and "UCX_TLS=tcp" in argv
    assert argv[-6:] == [PY, "-u", "-m", "shardwise.launcher.worker", "--", "t.py"]
    custom = plan(opts(launcher="openmpi", launcher_args="--mca btl_tcp_if_include ib0"), pool=POOL)
    assert build_commands(custom, "/w")[0].argv.count("btl_tcp_if_include") == 1  # the user's value only
    assert "ib0" in build_commands(custom, "/w")[0].argv


def test_mpich_impi_mvapich_commands() -> None:
    mpich = build_commands(plan(opts(launcher="mpich"), pool=POOL), "/w")[0].argv
    assert mpich[:7] == ("mpirun", "-n", "4", "-ppn", "2", "-hosts", "w0,w1") and "I_MPI_PIN" not in mpich
    i = mpich.index("MASTER_ADDR")
    assert mpich[i - 1 : i + 2] == ("-genv", "MASTER_ADDR", "w0")
    impi = build_commands(plan(opts(launcher="impi"), pool=POOL), "/w")[0].argv
    assert impi[7:10] == ("-genv", "I_MPI_PIN", "0")
    (mv,) = build_commands(plan(opts(launcher="mvapich"), pool=POOL), "/w")
    assert mv.argv[:7] == ("mpirun", "-np", "4", "-ppn", "2", "--hostfile", MVAPICH_HOSTFILE)
    assert mv.files == {MVAPICH_HOSTFILE: "w0\nw1\n"} and "MV2_SUPPORT_DL" in mv.argv
    with pytest.raises(ValueError, match="same number of processes"):
        build_commands(plan(opts(launcher="mpich"), pool={"a": 1, "b": 2}), "/w")


def test_slurm_command_and_its_limits() -> None:
    (cmd,) = build_commands(plan(opts(launcher="slurm", num_gpus=2), pool={"a": 4, "b": 4}), "/w")
    assert cmd.argv[:5] == ("srun", "-n", "4", "--gpus-per-node", "2")
    export = next(a for a in cmd.argv if a.startswith("--export="))
    assert export.startswith("--export=ALL,") and "MASTER_ADDR=a" in export
    assert cmd.argv.index("--kill-on-bad-exit=1") == cmd.argv.index(export) - 1  # a failed rank ends the step
    (own,) = build_commands(plan(opts(launcher="slurm", launcher_args="-K0"), pool={"a": 1, "b": 1}), "/w")
    assert "-K0" in own.argv and "--kill-on-bad-exit=1" not in own.argv  # the user's choice stands
    (sub,) = build_commands(
        plan(
            opts(launcher="slurm", include="b@c"),
            pool={"a": 2, "b": 2, "c": 2},
        ),
        "/w",
    )
    assert sub.argv[3:7] == ("--nodelist", "b,c", "--nodes", "2")
    with pytest.raises(ValueError, match="specific device ids"):
        build_commands(plan(opts(launcher="slurm", include="w0:1@w1:1"), pool=POOL), "/w")
    with pytest.raises(ValueError, match="same number of processes"):
        build_commands(plan(opts(launcher="slurm"), pool={"a": 1, "b": 2}), "/w")


# ---------------------------------------------------------------- the CLI without launching


def test_dry_run_prints_every_nodes_command(capsys) -> None:
    code = cli_main.main(["--launcher", "local", "--num_nodes", "2", "--num_gpus", "1", "--master_port", "29999",
                          "--dry_run", "train.py", "--deepspeed", "--deepspeed_config", "ds.json"])  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert out[0] == "# node 0 (local-0)" and out[2] == "# node 1 (local-1)"
    assert "--node-rank=1" in out[3] and "--master-port=29999" in out[3]
    assert out[3].endswith("-m shardwise.launcher.worker -- train.py --deepspeed --deepspeed_config ds.json")


def test_dry_run_with_a_hostfile_prints_the_pdsh_line(tmp_path, capsys) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two nodes\nworker-0 slots=2\nworker-1 slots=2\n")
    code = cli_main.main(["-H", str(hostfile), "-e", "worker-1:1", "--dry_run", "train.py"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith(
        "# all nodes\nPDSH_RCMD_TYPE=ssh pdsh -S -f 1024 -w worker-0,worker-1"
    )


def test_cli_errors_exit_2_with_the_reason(tmp_path, caplog) -> None:
    bad = tmp_path / "hosts"
    bad.write_text("worker-0 slots=2\nworker-1 slts=2\n")
    assert cli_main.main(["-H", str(bad), "--dry_run", "train.py"]) == 2
    assert f"{bad}:2" in caplog.text
    assert cli_main.main(["-H", str(tmp_path / "missing"), "--dry_run", "train.py"]) == 2
    assert "does not exist" in caplog.text
    assert cli_main.main(["--autotuning", "tune", "train.py"]) == 2
    with pytest.raises(SystemExit):
        cli_main.main(["--launcher", "nope", "train.py"])


@pytest.mark.parametrize("argv", [["-i", ""], ["--include="], ["-e", " "]])
def test_an_empty_include_or_exclude_is_an_error_not_ignored(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli_main.main([*argv, "--dry_run", "train.py"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    option = "-e/--exclude" if argv[0] == "-e" else "-i/--include"
    value = argv[1] if len(argv) == 2 else argv[0].partition("=")[2]
    assert f"argument {option}: {value!r} is empty, so it names no host or slot" in err
    assert "for example 'worker-0:0,2@worker-1', or leave the option out" in err


def test_script_arguments_are_passed_untouched(capsys) -> None:
    # Launcher-looking flags after the script belong to the script.
    assert cli_main.main(["--dry_run", "train.py", "--num_gpus", "7", "--dry_run"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert "--nproc-per-node=1" in line and line.endswith("-- train.py --num_gpus 7 --dry_run")


def test_config_subcommand_still_dispatches(tmp_path, capsys) -> None:
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4}))
    assert cli_main.main(["config", "check", str(cfg), "--world-size", "2"]) == 0
    assert capsys.readouterr().out.startswith(f"OK   {cfg}: batch 8 = 4 x 1 x 2")


# ---------------------------------------------------------------- elastic and report sub-commands


def test_elastic_v01_matches_the_spec(tmp_path, capsys) -> None:
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"elasticity": {"enabled": True, "max_train_batch_size": 2000,
                                              "micro_batch_sizes": [2, 4, 6], "version": 0.1}}))  # fmt: skip
    assert cli_main.main(["elastic", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "final_batch_size .... 1680" in out
    valid = json.loads(out.split("valid_gpus .......... ")[1].splitlines()[0])
    assert valid == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 15, 20, 21, 24, 28, 30, 35, 40, 42, 56, 60, 70, 84, 105,
                     120, 140, 168, 210, 280, 420, 840]  # fmt: skip
    assert cli_main.main(["elastic", "-c", str(cfg), "-w", "8"]) == 0
    out = capsys.readouterr().out
    assert "micro_batch_size .... 6" in out and "gradient_accumulation_steps .... 35" in out


def test_elastic_v02_matches_the_spec_and_reports_errors(tmp_path, capsys) -> None:
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"elasticity": {"enabled": True, "max_train_batch_size": 1000,
        "micro_batch_sizes": [8, 12], "min_gpus": 32, "max_gpus": 1500, "num_gpus_per_node": 8,
        "version": 0.2}}))  # fmt: skip
    assert cli_main.main(["elastic", str(cfg), "--world-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "final_batch_size .... 768" in out and "valid_gpus .......... [32, 48, 64, 96]" in out
    assert "micro_batch_size .... 12" in out
    assert cli_main.main(["elastic", str(cfg)]) == 1  # v0.2 needs a world size
    assert "world size" in capsys.readouterr().err.lower()


def test_report_collects_versions_backends_and_features(capsys) -> None:
    report = collect_report()
    assert report["versions"]["python"] == sys.version.split()[0]
    assert report["versions"]["torch"] and report["backends"]["gloo"] is True
    assert report["cpu"]["logical_cores"] >= 1 and report["memory"]["total"] > 0
    features = {f["feature"]: f for f in report["features"]}
    assert features["CPU training (gloo)"]["available"] is True
    assert "tensorboard" in features["tensorboard monitor"]["needs"]
    text = format_report(report)
    assert "[OK] CPU training (gloo)" in text and "communication backends" in text
    assert cli_main.main(["report", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backends"]["gloo"] is True


# ---------------------------------------------------------------- the worker's contract


def test_worker_environment_under_torchrun_mpi_slurm_and_alone() -> None:
    torchrun = {"TORCHELASTIC_RUN_ID": "r", "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "6",
                "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}  # fmt: skip
    assert worker_environment(torchrun) == {"LOCAL_SIZE": "3", "CROSS_RANK": "1", "CROSS_SIZE": "2"}
    mpich = worker_environment({"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4",
                                "MASTER_ADDR": "h0"})  # fmt: skip
    assert mpich["RANK"] == "5" and mpich["LOCAL_RANK"] == "1" and mpich["LOCAL_SIZE"] == "4"
    assert (mpich["CROSS_RANK"], mpich["CROSS_SIZE"], mpich["MASTER_ADDR"]) == ("1", "2", "h0")
    slurm = worker_environment({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
                                "SLURM_STEP_ID": "0", "SLURM_TASKS_PER_NODE": "2(x2)",
                                "SLURM_STEP_NODELIST": "n[1-2]"})  # fmt: skip
    assert (slurm["RANK"], slurm["WORLD_SIZE"], slurm["CROSS_RANK"], slurm["MASTER_ADDR"]) == (
        "3",
        "4",
        "1",
        "n1",
    )
    assert worker_environment({})["WORLD_SIZE"] == "1"


def test_local_rank_goes_before_the_users_arguments() -> None:
    assert script_argv("t.py", ["--x", "1"], 3, False) == ["t.py", "--local_rank=3", "--x", "1"]
    assert script_argv("t.py", ["--x"], 3, True) == ["t.py", "--x"]
    parsed = _parse(["--no_local_rank", "--", "t.py", "--module", "--", "y"])
    assert parsed.no_local_rank and not parsed.module and parsed.script_args == ["--module", "--", "y"]


def test_core_binding_maths() -> None:
    assert parse_core_list("0, 2-4,3,9") == [0, 2, 3, 4, 9]
    for bad in ("a", "4-2", "1,,2"):
        with pytest.raises(ValueError, match="--bind_core_list"):
            parse_core_list(bad)
    assert [cores_for_rank(range(10), r, 3) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(ValueError, match="cannot be shared"):
        cores_for_rank([0, 1], 0, 3)


# ---------------------------------------------------------------- failure records and the summary


def test_records_are_read_earliest_first_and_the_summary_leads_with_the_first(tmp_path) -> None:
    later = {"rank": 0, "exitcode": 1, "time": 20.0, "error": "RuntimeError: Connection closed by peer",
             "traceback": "tb0", "diagnosis": "DIAG-OF-A-LATER-RANK", "local_rank": 0, "node_rank": 0, "host": "h"}  # fmt: skip
    first = {"rank": 3, "exitcode": 7, "time": 10.0, "error": "ValueError: boom",
             "traceback": "Traceback (most recent call last):\nValueError: boom\n", "diagnosis": None,
             "local_rank": 1, "node_rank": 1, "host": "h2"}  # fmt: skip
    write_record(str(tmp_path), later)
    write_record(str(tmp_path), first)
    (tmp_path / "rank-9.json").write_text("{broken")
    records = read_records(str(tmp_path))
    assert [r.rank for r in records] == [3, 0]
    text = format_failure_summary(
        records, {0: "in barrier at t.py:5 in main", 2: "in barrier at t.py:5 in main"}
    )
    lines = text.splitlines()
    assert (
        lines[0] == "======== shardwise: rank 3 (node 1 h2, local rank 1) failed first (exit code 7) ========"
    )
    assert lines[1:3] == ["Traceback (most recent call last):", "ValueError: boom"]
    assert "DIAG-OF-A-LATER-RANK" not in text  # only the first failure's diagnosis is shown
    assert "Failed afterwards" in lines[3] and "rank 0 (node 0 h, local rank 0)" in lines[3]
    assert lines[4] == "Stopped by the launcher after that failure: rank 2 in barrier at t.py:5 in main."


def test_summary_without_records_names_the_failed_nodes() -> None:
    text = format_failure_summary([], None, {"node 0 (a)": 0, "node 1 (b)": 1})
    assert "no rank left an error record" in text and "node node 1 (b) exit code 1" in text


def test_stack_dumps_from_faulthandler_give_the_stopped_location(tmp_path) -> None:
    def waiting_in_barrier() -> None:
        with open(tmp_path / "rank-4.stack", "w") as handle:
            faulthandler.dump_traceback(handle, all_threads=True)

    waiting_in_barrier()
    (tmp_path / "rank-5.stack").write_text("")  # a rank that finished normally leaves an empty file
    where = read_stopped_locations(str(tmp_path))
    assert list(where) == [4]
    assert "waiting_in_barrier" in where[4] and Path(__file__).name in where[4]
    frames = parse_faulthandler_dump((tmp_path / "rank-4.stack").read_text())
    assert frames[-1].func == "waiting_in_barrier"


def test_run_commands_stops_the_others_when_one_fails() -> None:
    start = time.monotonic()
    codes, received = run_commands(
        [
            RunnerCommand("sleeper", (sys.executable, "-c", "import time; time.sleep(60)")),
            RunnerCommand("failer", (sys.executable, "-c", "import sys, time; time.sleep(0.3); sys.exit(3)")),
        ],
        {},
        stop_grace=5.0,
    )
    assert codes["failer"] == 3 and codes["sleeper"] != 0 and received is None
    assert time.monotonic() - start < 10


# ---------------------------------------------------------------- hang diagnosis (pure parts)

TORCH = "/venv/lib/python3.11/site-packages/torch/distributed"
SW = "/src/shardwise"


def test_summarize_frames_finds_the_call_the_users_line_and_the_library_line() -> None:
    stack = [
        Frame("<frozen runpy>", 88, "_run_code"),
        Frame(f"{SW}/launcher/worker.py", 271, "_run_script"),
        Frame("/home/u/train.py", 80, "main"),
        Frame(f"{SW}/engine.py", 300, "step"),
        Frame(f"{SW}/zero/reducer.py", 120, "flush"),
        Frame(f"{TORCH}/c10d_logger.py", 83, "wrapper"),
        Frame(f"{TORCH}/distributed_c10d.py", 3252, "all_reduce"),
    ]
    assert summarize_frames(stack) == ("all_reduce", "u/train.py:80 in main", "zero/reducer.py:120 in flush")
    assert summarize_frames(stack[:3]) == (None, "u/train.py:80 in main", None)


def test_flight_record_summary_and_status_lines() -> None:
    fr = {"entries": [
        {"process_group": ["0", "default_pg"], "collective_seq_id": 1, "profiling_name": "gloo:barrier",
         "retired": True, "state": "scheduled"},
        {"process_group": ["0", "default_pg"], "collective_seq_id": 2, "profiling_name": "gloo:all_reduce",
         "retired": False, "state": "scheduled"},
        {"process_group": ["0", "default_pg"], "collective_seq_id": 0, "profiling_name": "gloo:send", "is_p2p": True},
    ], "pg_status": {"0": {"last_enqueued_collective": "2", "last_completed_collective": "1"}}}  # fmt: skip
    summary = summarize_flight_record(fr)
    assert summary["active"] == [{"pg": "0", "seq": 2, "op": "all_reduce"}]
    assert summary["enqueued"] == {"0": 2} and summary["recent"]["0"][0] == {"seq": 1, "op": "barrier"}
    assert summarize_flight_record({}) == {"active": [], "last": {}, "enqueued": {}, "recent": {}}
    running = {"state": "running", "call": "all_reduce", "where": "t.py:8 in main", "fr": summary}
    assert describe_status(running) == "waiting in all_reduce #2 (group 0) at t.py:8 in main"
    # asked just as its own all_reduce timed out: the record is retired, the main thread still in the call
    retired = {**fr, "entries": [{**e, "retired": True} for e in fr["entries"]]}
    timed_out = {**running, "fr": summarize_flight_record(retired)}
    assert summarize_flight_record(retired)["active"] == []
    assert describe_status(timed_out) == "waiting in all_reduce #2 (group 0) at t.py:8 in main"
    assert describe_status({"state": "running", "where": "t.py:3 in load"}) == (
        "running outside any collective at t.py:3 in load"
    )
    assert describe_status(None).startswith("did not answer")
    assert describe_status({"state": "exited"}) == "had already exited"


def test_why_a_missing_rank_can_never_arrive() -> None:
    me = {"op": "save_checkpoint", "seq": 1}
    blocked = {
        "state": "running",
        "fr": {"active": [{"pg": "0", "seq": 9, "op": "all_reduce"}], "enqueued": {"0": 9}},
    }
    assert "all_reduce #9" in (why_cannot_arrive(blocked, {"0": 8}, me) or "")
    assert why_cannot_arrive(blocked, {"0": 9}, me) is None  # that collective includes this rank's last call
    assert why_cannot_arrive(blocked, {"1": 3}, me) is None  # a group this rank is not in
    assert (
        why_cannot_arrive({"state": "running", "where": "t.py:1"}, {"0": 8}, me) is None
    )  # busy: may still come
    assert why_cannot_arrive(None, {}, me) is None
    assert why_cannot_arrive({"state": "exited"}, {}, me) == "it had already exited"
    other_point = {"state": "running", "arrival": {"op": "load_checkpoint", "seq": 1}}
    assert "load_checkpoint #1" in (why_cannot_arrive(other_point, {}, me) or "")
    no_recorder = {"state": "running", "call": "broadcast", "fr": {}}
    assert "broadcast" in (why_cannot_arrive(no_recorder, {}, me) or "")


def test_hang_report_names_missing_ranks_and_groups_identical_ones() -> None:
    def waiting(op: str, seq: int, where: str) -> dict:
        return {"state": "running", "call": op, "where": where,
                "fr": {"active": [{"pg": "0", "seq": seq, "op": op}], "enqueued": {"0": seq},
                       "recent": {"0": [{"seq": seq, "op": op}]}}}  # fmt: skip

    statuses = {r: waiting("all_reduce", 5, "t.py:8 in main") for r in range(4)}
    statuses[0]["state"] = "failed"
    statuses[0]["error"] = "RuntimeError: Timed out"
    statuses[2] = {
        "state": "running",
        "where": "t.py:20 in load",
        "fr": {"enqueued": {"0": 4}, "recent": {"0": []}},
    }
    statuses[3] = None
    text = format_hang_report(
        "all_reduce failed on rank 0", 0, statuses, {"pg": "0", "seq": 5, "op": "all_reduce"}
    )
    lines = text.splitlines()
    assert lines[0] == "all_reduce failed on rank 0."
    assert "  rank 1: waiting in all_reduce #5 (group 0) at t.py:8 in main" in lines
    assert "  rank 2: running outside any collective at t.py:20 in load" in lines
    assert lines[-1] == (
        "Did not arrive at all_reduce #5 (group 0): rank 2 (it has not called it; it is at t.py:20 in load); "
        "rank 3 (no answer)."
    )
    # rank 1 failed and exited before it was asked: its last words still say where it failed
    # and which collective it had called at #5
    gone = {**waiting("barrier", 5, "t.py:9 in main"), "state": "exited", "error": "RuntimeError: Timed out"}
    gone["fr"].update(active=[], last={"0": {"seq": 5, "op": "barrier"}})  # retired by its error
    text = format_hang_report("x", 0, {0: statuses[0], 1: gone}, {"pg": "0", "seq": 5, "op": "all_reduce"})
    assert (
        "  rank 1: had already exited after it failed in barrier #5 (group 0) at t.py:9 in main: "
        "RuntimeError: Timed out" in text.splitlines()
    )
    assert "rank 1 (it called barrier as collective #5: the ranks called different collectives" in text
    gone_early = {"state": "exited", "fr": {"enqueued": {"0": 4}, "recent": {"0": []}}}
    assert format_hang_report("x", 0, {1: gone_early}, {"pg": "0", "seq": 5, "op": "all_reduce"}).endswith(
        "rank 1 (it had already exited)."
    )
    assert describe_status(gone_early) == "had already exited"
    assert _last_words(b"1", 3) == {"rank": 3, "state": "exited"}
    assert _last_words(json.dumps(gone).encode(), 1) == gone
    same = {r: waiting("barrier", 3, "t.py:9 in main") for r in range(1, 5)}
    assert "  ranks 1-4: waiting in barrier #3" in format_hang_report("x", 0, same)
    assert rank_ranges([4, 0, 1, 2, 9]) == "0-2, 4, 9"


def test_errors_from_waits_on_shardwise_communication_count_as_collective_failures() -> None:
    from shardwise.comm.diagnostics import _is_collective_failure

    def raised_in(path: str) -> BaseException:
        # a frame from that file, as when an exchange's Work.wait() times out in C++
        code = compile(
            "def wait():\n    raise RuntimeError('Timed out waiting 3000ms for recv')\n", path, "exec"
        )
        namespace: dict = {}
        exec(code, namespace)
        try:
            namespace["wait"]()
        except RuntimeError as exc:
            return exc
        raise AssertionError("unreachable")

    assert _is_collective_failure(raised_in("/site/shardwise/comm/exchange.py"))
    assert _is_collective_failure(raised_in("/site/shardwise/comm/collectives.py"))
    assert _is_collective_failure(raised_in("/site/torch/distributed/distributed_c10d.py"))
    assert not _is_collective_failure(raised_in("/site/shardwise/comm/diagnostics.py"))
    assert not _is_collective_failure(raised_in("/home/me/train.py"))


def test_not_arrived_error_and_helpers() -> None:
    statuses = {1: {"state": "running", "where": "t.py:63 in main",
                    "fr": {"active": [{"pg": "0", "seq": 2, "op": "all_reduce"}]}}}  # fmt: skip
    err = _not_arrived_error(
        "save_checkpoint", 1, 0, [1], statuses, {1: "it is waiting in all_reduce #2"}, None
    )
    assert err.missing == [1] and err.op_name == "save_checkpoint"
    assert str(err).splitlines()[:2] == [
        "save_checkpoint (#1) was called on rank 0 but rank 1 will never call it.",
        "  rank 1: it is waiting in all_reduce #2, at t.py:63 in main.",
    ]
    slow = _not_arrived_error("save_checkpoint", 2, 0, [1, 2], {1: None, 2: None}, {}, 30.0)
    assert str(slow).startswith("save_checkpoint (#2): ranks 1-2 did not arrive within 30s.")
    assert short_error("[/x/pair.cc:553] Connection closed by peer [127.0.0.1]:1.\nmore") == (
        "Connection closed by peer [127.0.0.1]:1."
    )
    env: dict[str, str] = {}
    assert enable_flight_recorder(env) and env == {"TORCH_FR_BUFFER_SIZE": "2000"}
    assert not enable_flight_recorder({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"})
    assert not enable_flight_recorder({"SHARDWISE_FLIGHT_RECORDER": "0"})


def test_failure_record_label() -> None:
    assert FailureRecord(rank=2, exitcode=1, time=0.0, error="e").label() == "rank 2"


# ---------------------------------------------------------------- the worker, in this process


@pytest.fixture
def isolated_worker(tmp_path, monkeypatch):
    """Run worker.main here: a private environment, sys.argv and sys.path, and a run directory."""
    import os

    from shardwise.launcher import worker

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")
    }
    env["SHARDWISE_RUN_DIR"] = str(tmp_path / "run")
    monkeypatch.setattr(os, "environ", env)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    return worker.main


def test_worker_runs_the_script_with_local_rank_first(tmp_path, isolated_worker) -> None:
    script = tmp_path / "ok.py"
    script.write_text(
        "import json, os, sys\nopen(sys.argv[-1], 'w').write(json.dumps([sys.argv, __name__]))\n"
    )
    out = tmp_path / "argv.json"
    assert isolated_worker(["--", str(script), "--lr", "1", str(out)]) == 0
    argv, name = json.loads(out.read_text())
    assert argv == [str(script), "--local_rank=0", "--lr", "1", str(out)] and name == "__main__"
    assert read_records(str(tmp_path / "run")) == []


def test_worker_records_an_exception_with_the_users_traceback(tmp_path, isolated_worker, capsys) -> None:
    script = tmp_path / "bad.py"
    script.write_text("def f():\n    raise KeyError('missing')\n\nf()\n")
    assert isolated_worker(["--no_local_rank", "--", str(script)]) == 1
    (record,) = read_records(str(tmp_path / "run"))
    assert record.rank == 0 and record.exitcode == 1 and record.error == "KeyError: 'missing'"
    assert record.traceback.splitlines()[1] == f'  File "{script}", line 4, in <module>'
    assert "runpy" not in record.traceback and "worker.py" not in record.traceback
    assert record.traceback in capsys.readouterr().err  # also printed, as Python would


def test_worker_keeps_a_scripts_exit_code(tmp_path, isolated_worker) -> None:
    script = tmp_path / "exit7.py"
    script.write_text("import sys\nsys.exit(7)\n")
    with pytest.raises(SystemExit) as info:
        isolated_worker(["--", str(script)])
    assert info.value.code == 7
    (record,) = read_records(str(tmp_path / "run"))
    assert record.exitcode == 7 and record.error == "exited with code 7"
