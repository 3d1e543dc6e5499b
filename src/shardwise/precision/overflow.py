"""Gradient overflow detection: a local inf/NaN test and its agreement across ranks.

Every rank must take the same decision (skip or step), so the local flag is all-reduced with
MAX: one rank's inf skips the step everywhere (spec 5.3). The local test is built to cost one
read of each gradient and a single device-to-host sync, however many tensors are passed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from shardwise.comm.init import get_backend, is_initialized

__all__ = ["all_reduce_overflow", "has_inf_or_nan", "overflow_flag"]


def _extremes(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensor's min and max in one pass; either is non-finite iff the tensor holds inf/NaN.

    min/max propagate NaN, and an inf is its own extreme, so two scalars summarise the tensor.
    """
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    return torch.aminmax(tensor.detach())


def overflow_flag(tensors: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """Return a 0-dim bool tensor, True when any of ``tensors`` holds inf or NaN, without syncing.

    The flag stays on the tensors' device so that the caller can feed it to a collective before
    the one host sync. Non-floating and empty tensors are skipped (they cannot hold inf/NaN).

    Method: ``torch.aminmax`` per tensor (one read pass, nothing of the gradient's size
    allocated), the 0-dim extremes stacked per (device, dtype), then one ``isfinite().all()``.
    Measured on this project's CPU box, one thread, 4-8 MB of gradients laid out as 200 x 10k
    fp32/fp16, 4 x 1M fp16 and one flat 2M fp32 / 4M fp16 buffer (medians of 15): this took
    0.7-3 ms and was the fastest layout-for-layout except that a float32 ``sum`` per tensor was
    as fast or faster on fp32 (but 2-3x slower on fp16, and it can report a false overflow when
    finite values sum past the float32 range). Separate ``amax``/``amin`` were 1.1-2x slower,
    ``torch._foreach_norm(ord=inf)`` 2.5-23x slower and ``isfinite().all()`` per tensor 8-45x
    slower (it writes a full bool mask). On CUDA, ``_foreach_norm`` fuses many small tensors
    into one launch and might win for hundreds of unflattened gradients; that was not measured
    (no GPU here), and the ZeRO path passes a few flat buffers anyway.

    Returns:
        The flag on the device of the first checked tensor, or None when nothing was checked.
    """
    # Grouped by (device, dtype) because torch.stack wants one of each; casting the scalars
    # instead would cost two extra kernel launches per tensor.
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.numel() == 0 or not (tensor.is_floating_point() or tensor.is_complex()):
            continue
        extremes = _extremes(tensor)
        groups.setdefault((extremes[0].device, extremes[0].dtype), []).extend(extremes)
    if not groups:
        return None
    flags = [~torch.stack(values).isfinite().all() for values in groups.values()]
    first = flags[0]
    for other in flags[1:]:
        first = first | other.to(first.device)
    return first


def has_inf_or_nan(tensors: Iterable[torch.Tensor]) -> bool:
    """Return True when any of ``tensors`` holds an inf or a NaN (one host sync).

    Example:
        >>> has_inf_or_nan([torch.ones(3), torch.tensor([1.0, float("inf")])])
        True
        >>> has_inf_or_nan([torch.ones(3, dtype=torch.float16)])
        False
    """
    flag = overflow_flag(tensors)
    return bool(flag.item()) if flag is not None else False


def _device_for_group(group: dist.ProcessGroup | None, hint: torch.device | None) -> torch.device:
    """Pick a device the group's backend can reduce on (nccl needs CUDA, gloo takes CPU)."""
    backend = get_backend(group).lower()
    if "nccl" in backend and torch.cuda.is_available():
        if hint is not None and hint.type == "cuda":
            return hint
        return torch.device("cuda", torch.cuda.current_device())
    if hint is not None and (hint.type == "cpu" or ":" in backend):
        # A multi-device backend ("cpu:gloo,cuda:nccl") reduces wherever the flag already is.
        return hint
    return torch.device("cpu")


def all_reduce_overflow(
    overflow: bool | torch.Tensor | None,
    group: dist.ProcessGroup | None = None,
) -> bool:
    """Agree on an overflow across the ranks of ``group`` (MAX: any rank's overflow counts).

    Args:
        overflow: this rank's flag, as a bool or as the tensor from :func:`overflow_flag`
            (which saves a host sync before the collective). None means "nothing checked".
        group: the process group; None is the default (world) group.

    Returns:
        True when any rank overflowed. Without an initialised ``torch.distributed`` the local
        flag is returned as is.

    Example:
        >>> all_reduce_overflow(False)  # no process group: the local flag
        False
    """
    if not is_initialized():
        if isinstance(overflow, torch.Tensor):
            return bool(overflow.item())
        return bool(overflow)
    hint = overflow.device if isinstance(overflow, torch.Tensor) else None
    device = _device_for_group(group, hint)
    # float32 rather than bool: MAX over bool is not supported by every backend.
    if isinstance(overflow, torch.Tensor):
        flag = overflow.detach().to(device=device, dtype=torch.float32).reshape(())
        if flag.data_ptr() == overflow.data_ptr():
            flag = flag.clone()  # never reduce into the caller's tensor
    else:
        flag = torch.tensor(1.0 if overflow else 0.0, dtype=torch.float32, device=device)
    from shardwise.comm import collectives  # the one door to torch.distributed (and its logger)

    collectives.all_reduce(flag, op="max", group=group)
    return bool(flag.item() > 0)
