"""``shardwise report``: what this machine offers a training run (DeepSpeed's ``ds_report``).

Versions (python, torch, shardwise, optional packages), communication backends (gloo,
nccl, mpi, ucc), devices, CPU cores and memory, the launch backends found on ``PATH``, and
for each optional feature what it needs and whether that is present. ``--json`` prints the
same as JSON. Optional packages are looked up by their metadata, never imported, so the
report is fast and has no side effects.

Example:
    shardwise report
    shardwise report --json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["OPTIONAL_PACKAGES", "add_parser", "collect_report", "ds_report", "format_report"]

OPTIONAL_PACKAGES = (
    "pydantic",
    "hjson",
    "numpy",
    "tqdm",
    "tensorboard",
    "wandb",
    "comet_ml",
    "mpi4py",
    "psutil",
    "safetensors",
)
_PROGRAMS = ("pdsh", "ssh", "mpirun", "srun", "numactl")


def add_parser(subparsers: Any) -> None:
    """Register ``report``."""
    parser = subparsers.add_parser("report", help="versions, backends, devices and what each feature needs")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=_run)


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _memory() -> dict[str, int]:
    """Total and available memory in bytes, from /proc/meminfo (Linux) or sysconf."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            for line in handle:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    out["total" if key == "MemTotal" else "available"] = int(rest.split()[0]) * 1024
    except OSError:  # not Linux: total memory only
        with contextlib.suppress(ValueError, OSError, AttributeError):
            out["total"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return out


def _cpu() -> dict[str, Any]:
    info: dict[str, object] = {"logical_cores": os.cpu_count()}
    if hasattr(os, "sched_getaffinity"):
        info["usable_cores"] = len(os.sched_getaffinity(0))
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    info["model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    nodes = "/sys/devices/system/node"
    if os.path.isdir(nodes):
        info["numa_nodes"] = len([n for n in os.listdir(nodes) if n.startswith("node") and n[4:].isdigit()])
    return info


def _torch_part() -> dict[str, Any]:
    """torch's version, backends and devices; empty values when torch cannot be imported."""
    try:
        import torch

        from shardwise.comm.diagnostics import flight_recorder_available
        from shardwise.comm.init import available_backends
    except Exception as exc:  # a broken torch install is exactly what a report must show
        return {"error": f"{type(exc).__name__}: {exc}"}
    part: dict[str, object] = {"version": torch.__version__, "cuda_build": torch.version.cuda}
    part["hip_build"] = getattr(torch.version, "hip", None)
    backends = available_backends()
    part["backends"] = backends
    if backends["nccl"]:
        try:
            part["nccl_version"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # the NCCL library is not loadable on this machine
            part["nccl_version"] = None
    devices: list[dict[str, object]] = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append({"index": index, "name": props.name, "memory": int(props.total_memory)})
        part["bf16_supported"] = bool(torch.cuda.is_bf16_supported())
    part["cuda_devices"] = devices
    mps = getattr(torch.backends, "mps", None)
    part["mps"] = bool(mps is not None and mps.is_available())
    part["flight_recorder"] = flight_recorder_available()
    part["fsdp2"] = importlib.util.find_spec("torch.distributed.fsdp") is not None and _has_fully_shard()
    part["dcp"] = importlib.util.find_spec("torch.distributed.checkpoint") is not None
    return part


def _has_fully_shard() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except Exception:
        return False
    return True


def collect_report() -> dict[str, Any]:
    """Everything ``shardwise report`` shows, as a JSON-able dict."""
    import shardwise

    packages = {name: _package_version(name) for name in OPTIONAL_PACKAGES}
    torch_part = _torch_part()
    programs = {name: shutil.which(name) for name in _PROGRAMS}
    backends = torch_part.get("backends", {})
    gpus = torch_part.get("cuda_devices", [])
    features = [
        ("CPU training (gloo)", "torch with gloo", bool(backends.get("gloo"))),
        ("GPU training (nccl)", "CUDA GPUs and torch with NCCL", bool(gpus) and bool(backends.get("nccl"))),
        ("bf16 on GPU", "a GPU with bf16 (Ampere or newer)", bool(torch_part.get("bf16_supported"))),
        ("ZeRO stage 3", "torch.distributed.fsdp.fully_shard (torch >= 2.4)", bool(torch_part.get("fsdp2"))),
        ("distributed checkpoints", "torch.distributed.checkpoint", bool(torch_part.get("dcp"))),
        (
            "hang diagnosis details",
            "torch's flight recorder (torch >= 2.6)",
            bool(torch_part.get("flight_recorder")),
        ),
        ("tensorboard monitor", "pip install tensorboard", packages["tensorboard"] is not None),
        ("wandb monitor", "pip install wandb", packages["wandb"] is not None),
        ("comet monitor", "pip install comet_ml", packages["comet_ml"] is not None),
        ("csv monitor", "nothing", True),
        ("launcher pdsh", "pdsh on PATH and passwordless ssh", programs["pdsh"] is not None),
        ("launcher ssh", "ssh on PATH and passwordless ssh", programs["ssh"] is not None),
        ("launcher openmpi/mpich/impi/mvapich", "mpirun on PATH", programs["mpirun"] is not None),
        ("launcher slurm", "srun on PATH (inside an allocation)", programs["srun"] is not None),
        ("core binding (--bind_cores_to_rank)", "Linux sched_setaffinity", hasattr(os, "sched_setaffinity")),
        ("torch MPI backend", "torch built with MPI", bool(backends.get("mpi"))),
    ]
    return {
        "versions": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "shardwise": shardwise.__version__,
            "torch": torch_part.get("version"),
            "cuda_build": torch_part.get("cuda_build"),
            "nccl": torch_part.get("nccl_version"),
        },
        "packages": packages,
        "torch": torch_part,
        "backends": backends,
        "devices": {"cuda": gpus, "mps": torch_part.get("mps", False)},
        "cpu": _cpu(),
        "memory": _memory(),
        "programs": programs,
        "features": [{"feature": f, "needs": n, "available": a} for f, n, a in features],
    }


def _gib(value: int | None) -> str:
    return "unknown" if value is None else f"{value / 2**30:.1f} GiB"


def format_report(report: Mapping[str, Any]) -> str:
    """The report as aligned text sections.

    Example:
        >>> text = format_report({"versions": {"python": "3.11"}, "features": [
        ...     {"feature": "csv monitor", "needs": "nothing", "available": True}]})
        >>> "python ..." in text and "[OK]" in text
        True
    """
    width = 36
    lines: list[str] = []

    def section(title: str) -> None:
        lines.extend(["-" * 72, title, "-" * 72])

    def row(name: str, value: object) -> None:
        lines.append(f"{name} {'.' * max(width - len(name), 3)} {value}")

    section("versions")
    for key, value in (report.get("versions") or {}).items():
        row(key, value if value is not None else "not installed")
    if report.get("torch", {}).get("error"):
        row("torch import error", report["torch"]["error"])
    if report.get("packages"):
        section("optional packages")
        for name, version in report["packages"].items():
            row(name, version or "not installed")
    if report.get("backends"):
        section("communication backends")
        for name, ok in report["backends"].items():
            row(name, "available" if ok else "not available")
    if report.get("devices") is not None or report.get("cpu") or report.get("memory"):
        section("hardware")
        devices = report.get("devices") or {}
        cuda = devices.get("cuda") or []
        row("cuda devices", len(cuda) if cuda else "none (CPU processes: --num_gpus N runs N of them)")
        for device in cuda:
            row(f"  cuda:{device['index']}", f"{device['name']}, {_gib(device.get('memory'))}")
        if devices.get("mps"):
            row("mps", "available")
        cpu = report.get("cpu") or {}
        if cpu:
            row("cpu", cpu.get("model", "unknown model"))
            row(
                "cpu cores (logical / usable)", f"{cpu.get('logical_cores')} / {cpu.get('usable_cores', '?')}"
            )
            if "numa_nodes" in cpu:
                row("numa nodes", cpu["numa_nodes"])
        memory = report.get("memory") or {}
        if memory:
            row(
                "memory (total / available)", f"{_gib(memory.get('total'))} / {_gib(memory.get('available'))}"
            )
    if report.get("programs"):
        section("launch programs on PATH")
        for name, where in report["programs"].items():
            row(name, where or "not found")
    if report.get("features"):
        section("features: what each needs")
        for item in report["features"]:
            mark = "[OK]" if item["available"] else "[--]"
            lines.append(f"{mark} {item['feature']:<40} needs: {item['needs']}")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    report = collect_report()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def ds_report(hide_operator_status: bool = False, hide_errors_and_warnings: bool = False) -> None:
    """Print the report (DeepSpeed's ``deepspeed.env_report.main``, the function behind ``ds_report``).

    DeepSpeed's operator table is the list of compiled ops and whether each can be built; shardwise
    builds none, and its counterpart is the *features* section (what each feature needs and whether
    it is present), which ``hide_operator_status`` leaves out. ``hide_errors_and_warnings`` is
    accepted for the signature: the report has no separate error or warning lines to hide.
    """
    report = collect_report()
    if hide_operator_status:
        report = {key: value for key, value in report.items() if key != "features"}
    print(format_report(report))
