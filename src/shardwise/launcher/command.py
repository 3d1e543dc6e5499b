"""``shardwise [launcher options] script.py [script args]``: the ``deepspeed`` command, on torchrun.

Takes DeepSpeed's launcher options (spec 9.1) so ``deepspeed`` can be replaced by
``shardwise`` in a command line with nothing else changed; also reachable as
``python -m shardwise.launcher``. Planning is in :mod:`shardwise.launcher.planner`, the
processes in :mod:`shardwise.launcher.runners`; this module parses, logs, and prints the
failure summary.

Options of ours on top of DeepSpeed's: ``--dry_run`` (print every node's command and exit),
``--rdzv_backend static|c10d``, ``--rdzv_id``, ``--max_restarts``, and for ``--autotuning``
(:mod:`shardwise.autotuning`) ``--autotuning_memory_per_rank`` and ``--autotuning_timeout``.

Example:
    shardwise --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json
    shardwise --hostfile hosts --include "worker-0:0,1@worker-1" train.py --deepspeed_config ds.json
    shardwise --launcher local --num_nodes 2 --num_gpus 1 train.py ...   # two "nodes" on 127.0.0.1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence

from shardwise.launcher.exports import env_file_paths
from shardwise.launcher.failures import (
    RUN_DIR_VAR,
    format_failure_summary,
    read_records,
    read_stopped_locations,
)
from shardwise.launcher.planner import (
    LAUNCHERS,
    LOCAL,
    LaunchOptions,
    LaunchPlan,
    describe_plan,
    find_deepspeed_config,
    load_pool,
    plan_launch,
)
from shardwise.launcher.runners import RunnerCommand, build_commands, check_backend, run_commands
from shardwise.launcher.torchrun_command import max_restarts
from shardwise.utils.logging import logger, set_log_level

__all__ = ["build_parser", "main", "options_from_args"]


def _node_spec(text: str) -> str:
    """``--include``/``--exclude``: an empty value is an error, not "no filter" (DeepSpeed ignores it)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is empty, so it names no host or slot. Give NODE_SPEC[@NODE_SPEC...], for example "
            "'worker-0:0,2@worker-1', or leave the option out to use every host and slot."
        )
    return text


_BYTE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
AUTOTUNING_FLAGS = ("--autotuning", "--autotuning_memory_per_rank", "--autotuning_timeout")
"""Launcher options that an autotuning experiment's own launch does not get."""


def _byte_count(text: str) -> int:
    """``"2G"``, ``"512M"`` (binary units) or a number of bytes."""
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = value[-1:] if value[-1:] in _BYTE_UNITS else ""
    try:
        count = float(value[: len(value) - len(unit)]) * _BYTE_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (write 2G, 512M or 1000000)") from None
    if count <= 0:
        raise argparse.ArgumentTypeError(f"the byte count must be > 0, got {text!r}")
    return int(count)


def build_parser(prog: str = "shardwise") -> argparse.ArgumentParser:
    """The launcher's parser: DeepSpeed's options, then the script and its arguments."""
    usage = f"{prog} [launcher options] user_script [user_args ...]"
    if prog == "shardwise":
        usage += f"\n       {prog} {{config,report,elastic,checkpoint,compat}} ..."
    parser = argparse.ArgumentParser(
        prog=prog,
        usage=usage,
        description="Launch a training script on one or many nodes (torchrun's elastic agent on every node). "
        "Sub-commands: 'config' (check/explain a ds_config), 'report' (environment), "
        "'elastic' (elastic batch sizes), 'checkpoint' (inspect/export checkpoints), 'compat' (the deepspeed package for HF clients).",
        allow_abbrev=False,
    )
    add = parser.add_argument
    add(
        "-H",
        "--hostfile",
        default=None,
        help="MPI-style hostfile of 'host slots=N' lines (default /job/hostfile)",
    )
    add(
        "-i",
        "--include",
        type=_node_spec,
        default=None,
        help="NODE_SPEC[@NODE_SPEC...], NODE_SPEC=host[:slot[,slot...]]",
    )
    add(
        "-e",
        "--exclude",
        type=_node_spec,
        default=None,
        help="same syntax as --include; the slots to leave out",
    )
    add("--num_nodes", type=int, default=-1, help="use the first N hosts of the hostfile")
    add(
        "--num_gpus",
        "--num_accelerators",
        type=int,
        default=-1,
        help="processes per node (CPU processes without GPUs)",
    )
    add("--master_port", type=int, default=29500, help="rendezvous port (default 29500)")
    add(
        "--master_addr",
        default="",
        help="rendezvous host (default 127.0.0.1 on one node, else the first host)",
    )
    add("--node_rank", type=int, default=-1, help="this node's position in the hostfile, with --no_ssh")
    add(
        "--launcher",
        default="pdsh",
        type=str.lower,
        choices=LAUNCHERS,
        help="multi-node backend (default pdsh)",
    )
    add("--launcher_args", default="", help="one quoted string appended to the backend's command")
    add("--module", action="store_true", help="run user_script as a module (python -m)")
    add("--no_python", action="store_true", help="run user_script directly, not with python")
    add("--no_local_rank", action="store_true", help="do not pass --local_rank to the script")
    add(
        "--no_ssh",
        action="store_true",
        help="launch this node only (each node runs the command; needs --node_rank)",
    )
    add("--no_ssh_check", action="store_true", help="skip the passwordless-ssh check")
    add("--force_multi", action="store_true", help="use the multi-node backend even for one host")
    add("--save_pid", action="store_true", help="write this launcher's pid to /tmp/<pid>.shardwise")
    add("--enable_each_rank_log", default=None, metavar="DIR", help="per-rank stdout/stderr files under DIR")
    add(
        "--autotuning",
        default="",
        choices=["", "tune", "run"],
        help="tune: search the config's autotuning space and write the best config; run: then train with it",
    )
    add(
        "--autotuning_memory_per_rank",
        type=_byte_count,
        default=None,
        metavar="BYTES",
        help="autotuning: memory one rank may use (e.g. 2G; default the GPU's, or host memory / ranks per node)",
    )
    add(
        "--autotuning_timeout",
        type=float,
        default=900.0,
        help="autotuning: seconds per experiment (default 900)",
    )
    add("--elastic_training", action="store_true", help="elastic run: torchrun with --nnodes=min:max (c10d)")
    add("--min_elastic_nodes", type=int, default=-1, help="elastic: fewest nodes to run with (default 1)")
    add("--max_elastic_nodes", type=int, default=-1, help="elastic: most nodes (default: all hosts)")
    add("--max_restarts", type=int, default=None, help="torchrun restarts (default 0; 3 when elastic)")
    add(
        "--rdzv_backend",
        default=None,
        choices=["static", "c10d"],
        help="rendezvous (default static; c10d if elastic)",
    )
    add("--rdzv_id", default=None, help="rendezvous id shared by the nodes (default shardwise-<port>)")
    add("--bind_cores_to_rank", action="store_true", help="pin each rank to its share of the cores")
    add("--bind_core_list", default=None, help="cores to share out, e.g. 0,2-5")
    add("--ssh_port", type=int, default=None, help="ssh port for pdsh/ssh")
    add("--venv_script", default=None, help="remote nodes source this script before launching")
    add("--log_level", default="info", help="launcher log level (default info)")
    add("-q", "--quiet", action="store_true", help="same as --log_level error")
    add("--dry_run", action="store_true", help="print every node's command and exit")
    add("user_script", help="the training script (or module with --module)")
    add("user_args", nargs=argparse.REMAINDER, help="the script's arguments")
    return parser


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    """The planner's options from parsed arguments."""
    return LaunchOptions(
        user_script=args.user_script,
        user_args=tuple(args.user_args),
        hostfile=args.hostfile,
        include=args.include or "",
        exclude=args.exclude or "",
        num_nodes=args.num_nodes,
        num_gpus=args.num_gpus,
        master_addr=args.master_addr,
        master_port=args.master_port,
        launcher=args.launcher,
        launcher_args=args.launcher_args,
        force_multi=args.force_multi,
        no_local_rank=args.no_local_rank,
        module=args.module,
        no_python=args.no_python,
        no_ssh=args.no_ssh,
        node_rank=args.node_rank,
        bind_cores_to_rank=args.bind_cores_to_rank,
        bind_core_list=args.bind_core_list,
        elastic_training=args.elastic_training,
        min_elastic_nodes=args.min_elastic_nodes,
        max_elastic_nodes=args.max_elastic_nodes,
        max_restarts=args.max_restarts,
        rdzv_backend=args.rdzv_backend,
        rdzv_id=args.rdzv_id,
        each_rank_log=args.enable_each_rank_log,
        ssh_port=args.ssh_port,
        venv_script=args.venv_script,
    )


def _device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # no torch build with CUDA: CPU processes
        return 0


def _read_env_files(paths: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for path in paths:
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as handle:
                out[path] = handle.read()
    return out


def _check_elastic(plan: LaunchPlan) -> None:
    """With --elastic_training, the config's elasticity block must allow the node range."""
    config_path = find_deepspeed_config(plan.options.user_args)
    if config_path is None or not os.path.isfile(config_path):
        logger.warning(
            "--elastic_training: no --deepspeed_config file among the script's arguments; the batch size cannot be "
            "checked against the node range here."
        )
        return
    from shardwise.config.loading import read_config_source
    from shardwise.elasticity import ElasticityError, ElasticityIncompatibleWorldSize, compute_elastic_config

    raw, _ = read_config_source(config_path)
    block = raw.get("elasticity") if isinstance(raw, dict) else None
    if not isinstance(block, dict) or not block.get("enabled"):
        logger.warning(
            "--elastic_training: %s has no enabled 'elasticity' block, so the global batch size will change "
            "with the number of nodes. Add one (see `shardwise elastic`).",
            config_path,
        )
        return
    low, high = (int(x) for x in plan.nnodes.split(":"))
    per_node = max(len(slots) for slots in plan.resources.values())
    sizes = [n * per_node for n in range(low, high + 1)]
    usable: dict[int, int] = {}
    for size in sizes:
        try:
            usable[size] = compute_elastic_config(raw, world_size=size)[0]
        except ElasticityIncompatibleWorldSize:
            continue
        except ElasticityError as exc:
            raise ValueError(f"--elastic_training with {config_path}: {exc}") from exc
    if not usable:
        raise ValueError(
            f"--elastic_training: none of the world sizes {sizes} (nodes {low}..{high} x {per_node} processes) is "
            f"valid for the elasticity block of {config_path}; see `shardwise elastic {config_path}` for the valid "
            "sizes, and change the node range or the block."
        )
    skipped = [size for size in sizes if size not in usable]
    if skipped:
        logger.warning(
            "--elastic_training: world sizes %s are not valid for the elastic batch and would fail", skipped
        )
    logger.info("elastic batch size per world size: %s", usable)


def main(argv: Sequence[str] | None = None, prog: str = "shardwise", raise_errors: bool = False) -> int:
    """Parse, plan, and run a launch; returns the exit code (the first failing rank's).

    A bad launch (conflicting options, unknown host...) is logged and gives exit code 2, or with
    ``raise_errors`` raises its ``ValueError``/``FileNotFoundError``/``RuntimeError`` (DeepSpeed's
    ``runner.main(args=...)`` raises)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
    set_log_level("ERROR" if args.quiet else args.log_level)
    options = options_from_args(args)
    try:
        pool = load_pool(options.hostfile)
        environ = dict(os.environ)
        if environ.get("CUDA_VISIBLE_DEVICES") and (options.include or options.exclude or pool is not None):
            logger.info("ignoring CUDA_VISIBLE_DEVICES=%s: hosts and slots come from the hostfile/filters",
                        environ["CUDA_VISIBLE_DEVICES"])  # fmt: skip
        cwd = os.getcwd()
        env_files = _read_env_files(env_file_paths(environ, cwd, os.path.expanduser("~")))
        plan = plan_launch(options, pool=pool, device_count=_device_count(), environ=environ, cwd=cwd,
                           env_files=env_files)  # fmt: skip
        if args.autotuning and not args.dry_run:
            tuned = _autotune(args, argv, plan)
            if tuned is None or args.autotuning == "tune":
                return 0 if tuned is not None else 1
            options = dataclasses.replace(options, user_args=tuple(tuned))
            plan = plan_launch(options, pool=pool, device_count=_device_count(), environ=environ, cwd=cwd,
                               env_files=env_files)  # fmt: skip
        commands = build_commands(plan, cwd)
        if options.elastic_training:
            _check_elastic(plan)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        if raise_errors:
            raise
        logger.error("%s", exc)
        return 2
    for line in describe_plan(plan).splitlines():
        logger.info("%s", line)
    if args.dry_run:
        for command in commands:
            print(f"# {command.label}")
            for path, text in command.files.items():
                print(f"# writes {path}:\n" + "".join(f"#   {line}\n" for line in text.splitlines()))
            print(command.display())
        return 0
    if plan.runner != LOCAL:
        try:
            check_backend(plan, ssh_check=not args.no_ssh_check)
        except RuntimeError as exc:
            logger.error("%s", exc)
            return 2
    if args.save_pid:
        with open(f"/tmp/{os.getpid()}.shardwise", "w", encoding="utf-8") as handle:
            handle.write(str(os.getpid()))
    return _run(plan, commands)


def _launcher_args(argv: Sequence[str], args: argparse.Namespace) -> list[str]:
    """The launcher options of ``argv`` (before the script) without the autotuning ones."""
    options = list(argv[: len(argv) - len(args.user_args) - 1])
    out: list[str] = []
    skip = False
    for item in options:
        if skip:
            skip = False
            continue
        name = item.split("=", 1)[0]
        if name in AUTOTUNING_FLAGS:
            skip = "=" not in item
            continue
        out.append(item)
    return out


def _autotune(args: argparse.Namespace, argv: Sequence[str], plan: LaunchPlan) -> list[str] | None:
    """Run the tuning; the script's arguments for the best config (None: nothing succeeded)."""
    from shardwise.autotuning.autotuner import Autotuner, TuneRequest
    from shardwise.autotuning.runner import ExperimentLaunch

    config_path = find_deepspeed_config(plan.options.user_args)
    if config_path is None or not os.path.isfile(config_path):
        raise ValueError(
            f"--autotuning {args.autotuning}: the script's arguments name no existing --deepspeed_config file "
            f"(got {config_path!r}); the tuning space and the autotuning section are read from it. Pass "
            "--deepspeed_config ds_config.json to the script."
        )
    launch = ExperimentLaunch(
        tuple(_launcher_args(argv, args)),
        args.user_script,
        tuple(args.user_args),
        timeout_s=args.autotuning_timeout,
    )
    request = TuneRequest(
        config_path=config_path,
        launch=launch,
        world_size=plan.world_size,
        ranks_per_node=max(len(slots) for slots in plan.resources.values()),
        on_gpu=_device_count() > 0,
        memory_per_rank=args.autotuning_memory_per_rank,
    )
    tuner = Autotuner(request)  # it adds the config's arg_mappings to the launch
    result = tuner.tune()
    if result.best_config_path is None:
        return None
    with open(result.best_config_path, encoding="utf-8") as handle:
        best_config = json.load(handle)
    return tuner.request.launch.script_args(result.best_config_path, best_config)


def _run(plan: LaunchPlan, commands: Sequence[RunnerCommand]) -> int:
    run_dir = tempfile.mkdtemp(prefix="shardwise-run-") if plan.runner == LOCAL else None
    base_env = dict(os.environ)
    base_env.setdefault("PYTHONUNBUFFERED", "1")
    if run_dir is not None:
        base_env[RUN_DIR_VAR] = run_dir
    try:
        elastic = plan.options.elastic_training
        # Job-level restarts (fixed-size runs): a node command that ends in failure -- its agent
        # killed, or out of torch elastic's own in-node restarts -- restarts every node, up to
        # --max_restarts times; the script resumes from its last checkpoint as after any restart.
        restarts_left = 0 if elastic else max_restarts(plan.options)
        while True:
            codes, received = run_commands(commands, base_env, stop_on_failure=not elastic)
            if received is None and (
                all(code == 0 for code in codes.values())
                or (elastic and any(code == 0 for code in codes.values()))
            ):
                # An elastic job is done when the nodes that stayed finished it.
                return 0
            if received is not None or restarts_left <= 0:
                break
            restarts_left -= 1
            failed = ", ".join(f"{label} (exit code {code})" for label, code in codes.items() if code != 0)
            logger.warning(
                "%s failed; restarting every node (%d job restart(s) left after this one)", failed, restarts_left
            )
            if run_dir is not None:  # the next attempt's failures are its own
                shutil.rmtree(run_dir, ignore_errors=True)
                os.makedirs(run_dir)
        records = read_records(run_dir) if run_dir else []
        if received is not None and not records:
            logger.warning("stopped by signal %d", received)
            return 128 + received
        stopped = read_stopped_locations(run_dir) if run_dir else {}
        sys.stderr.flush()
        print(format_failure_summary(records, stopped, codes), file=sys.stderr, flush=True)
        if records:
            return records[0].exitcode or 1
        return next((code for code in codes.values() if code > 0), 1)
    finally:
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
