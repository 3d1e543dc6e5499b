"""Memory reports: device and host usage, and what this rank's model states take.

``memory_breakdown: true`` in the config logs :func:`memory_report` once at start-up
(rank 0). :func:`see_memory_usage` is DeepSpeed's helper of the same name for user code:
one line with the accelerator's allocated/reserved memory (current and peak) and the
process's resident host memory.

Host numbers come from ``/proc`` on Linux (``VmRSS``/``VmHWM`` of this process,
``MemTotal``/``MemAvailable`` of the machine) and fall back to ``resource`` elsewhere.
"""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass

import torch

from shardwise.comm.init import get_rank, is_initialized
from shardwise.utils.report import report_logger

__all__ = [
    "ModelStateBytes",
    "device_memory",
    "format_bytes",
    "host_memory",
    "memory_report",
    "model_state_bytes",
    "see_memory_usage",
]


def format_bytes(nbytes: float) -> str:
    """Bytes in binary units: ``format_bytes(3 * 2**20)`` -> ``"3.00 MiB"``.

    Example:
        >>> format_bytes(512), format_bytes(1536), format_bytes(5 * 2**30)
        ('512 B', '1.50 KiB', '5.00 GiB')
    """
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _proc_kib(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(path) as handle:
            for line in handle:
                name, _, rest = line.partition(":")
                if name in keys:
                    out[name] = int(rest.split()[0]) * 1024
    except OSError:
        return {}
    return out


def host_memory() -> dict[str, int]:
    """``rss``, ``peak_rss`` of this process and ``total``, ``available`` of the machine, in bytes.

    Keys that cannot be read on this platform are left out.

    Example:
        >>> host_memory()["rss"] > 0
        True
    """
    out: dict[str, int] = {}
    status = _proc_kib("/proc/self/status", ("VmRSS", "VmHWM"))
    if status:
        out["rss"] = status.get("VmRSS", 0)
        out["peak_rss"] = status.get("VmHWM", 0)
    else:
        # ru_maxrss is KiB on Linux, bytes on macOS
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["peak_rss"] = out["rss"] = peak if sys.platform == "darwin" else peak * 1024
    meminfo = _proc_kib("/proc/meminfo", ("MemTotal", "MemAvailable"))
    if "MemTotal" in meminfo and "MemAvailable" in meminfo:
        out["total"] = meminfo["MemTotal"]
        out["available"] = meminfo["MemAvailable"]
    return out


def device_memory(device: torch.device | None = None) -> dict[str, int]:
    """Allocated/reserved bytes (current and peak) on a CUDA device; empty elsewhere."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    if device is None or device.type != "cuda":
        return {}
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "max_allocated": torch.cuda.max_memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "max_reserved": torch.cuda.max_memory_reserved(device),
    }


def _usage_line(device: torch.device | None) -> str:
    parts = []
    dev = device_memory(device)
    if dev:
        parts.append(
            f"MA {format_bytes(dev['allocated'])} Max_MA {format_bytes(dev['max_allocated'])} "
            f"CA {format_bytes(dev['reserved'])} Max_CA {format_bytes(dev['max_reserved'])}"
        )
    host = host_memory()
    text = f"host RSS {format_bytes(host['rss'])} (peak {format_bytes(host['peak_rss'])})"
    if "total" in host:
        used = host["total"] - host["available"]
        text += f", machine {format_bytes(used)} / {format_bytes(host['total'])} used ({100 * used / host['total']:.0f}%)"
    parts.append(text)
    return " | ".join(parts)


def see_memory_usage(message: str, force: bool = False, device: torch.device | None = None) -> None:
    """Log one line of memory usage on rank 0, when ``force`` (DeepSpeed's signature).

    Example:
        >>> # see_memory_usage("after model init", force=True)
        >>> # -> [shardwise] [INFO] [rank0] after model init | host RSS 512.00 MiB (peak 530.00 MiB), ...
    """
    if not force or _rank() != 0:
        return
    report_logger().info("%s | %s", message, _usage_line(device))


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of the model states one rank holds."""

    params: int
    grads: int
    masters: int
    optimizer_state: int

    @property
    def total(self) -> int:
        """All model states."""
        return self.params + self.grads + self.masters + self.optimizer_state


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def model_state_bytes(model: torch.nn.Module, optimizer: object = None) -> ModelStateBytes:
    """What this rank's parameters, gradients, fp32 masters and optimizer state take.

    With a ZeRO optimizer the flat buffers are measured (gradients and masters are
    shards at stages 1-2); otherwise the module's parameters and ``.grad`` tensors.
    Optimizer state counts tensors with at least one dimension (not step counters);
    Adam-style state appears only after the first step.
    """
    groups = getattr(optimizer, "groups", None)
    if groups:
        params = sum(_nbytes(g.param_buffer) for g in groups)
        grads = sum(
            _nbytes(g.grad_buffer) if g.grad_buffer is not None else sum(_nbytes(t) for t in g.grad)
            for g in groups
        )
        masters = sum(sum(_nbytes(m) for m in g.master) for g in groups if g.dtype != torch.float32)
    else:
        params = sum(_nbytes(p) for p in model.parameters())
        grads = sum(_nbytes(p.grad) for p in model.parameters() if p.grad is not None)
        masters = 0
    inner = getattr(optimizer, "optimizer", optimizer)
    state = 0
    for entry in getattr(inner, "state", {}).values():
        for value in entry.values():
            if torch.is_tensor(value) and value.dim() > 0:
                state += _nbytes(value)
    return ModelStateBytes(params, grads, masters, state)


def memory_report(model: torch.nn.Module, optimizer: object = None, device: torch.device | None = None) -> str:
    """A few lines: this rank's model states by kind, then device and host usage.

    Example:
        >>> print(memory_report(torch.nn.Linear(256, 256)).splitlines()[0])  # doctest: +ELLIPSIS
        model states on this rank: 257.00 KiB = params 257.00 KiB + grads 0 B + fp32 masters 0 B + optimizer state 0 B
    """
    states = model_state_bytes(model, optimizer)
    lines = [
        f"model states on this rank: {format_bytes(states.total)} = params {format_bytes(states.params)} + "
        f"grads {format_bytes(states.grads)} + fp32 masters {format_bytes(states.masters)} + "
        f"optimizer state {format_bytes(states.optimizer_state)}"
    ]
    lines.append(_usage_line(device))
    return "\n".join(lines)


def _rank() -> int:
    if is_initialized():
        return get_rank()
    return int(os.environ.get("RANK", "0"))
