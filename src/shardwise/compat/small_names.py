"""Small DeepSpeed names with no other home: ``deepspeed.utils.torch.required_torch_version``,
``deepspeed.utils.numa.parse_range_list``, ``deepspeed.OnDevice``,
``deepspeed.runtime.zero.utils.ZeRORuntimeException``, ``deepspeed.sequence.layer._torchembed_available``,
``deepspeed.utils.DeprecatedException``."""

from __future__ import annotations

import re
from typing import Any

import torch

from shardwise.config.errors import ZeRORuntimeException
from shardwise.launcher.worker import parse_core_list

__all__ = ["FUSED_ROTARY_AVAILABLE", "DeprecatedException", "OnDevice", "ZeRORuntimeException", "parse_range_list", "required_torch_version"]

FUSED_ROTARY_AVAILABLE = False
"""Whether ``apply_rotary_pos_emb`` runs a fused kernel (DeepSpeed's ``_torchembed_available``, true when
its optional ``torchembed`` package is installed). Always false: shardwise's rotary embedding
(:func:`shardwise.sequence.layer.apply_rotary_pos_emb`) is plain PyTorch, with no compiled kernels."""


def required_torch_version(min_version: str | None = None, max_version: str | None = None) -> bool:
    """Whether the installed torch (release part) is within ``[min_version, max_version]``."""
    installed = _release(torch.__version__)
    if min_version is not None and installed < _release(min_version):
        return False
    return not (max_version is not None and installed > _release(max_version))


def _release(text: object) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``; ``1.8`` -> ``(1, 8)`` (missing parts compare as 0)."""
    parts = [int(p) for p in re.findall(r"\d+", str(text).split("+")[0])[:3]]
    return tuple(parts + [0] * (3 - len(parts)))


def parse_range_list(range_str: str) -> list[int]:
    """Core ids from ``"0,2-4,6"``; parts must ascend without overlapping (``"8,2-6"`` and ``"1,6-2"`` raise).

    Example:
        >>> parse_range_list("0,2-4,6,8-9")
        [0, 2, 3, 4, 6, 8, 9]
    """
    cores: list[int] = []
    for part in range_str.split(","):
        run = parse_core_list(part)
        if cores and run[0] <= cores[-1]:
            raise ValueError(f"{range_str!r}: {part!r} overlaps or comes before {cores[-1]}; list cores in ascending order")
        cores.extend(run)
    return cores


class OnDevice:
    """Build modules' parameters directly on ``device`` (``"meta"`` for no storage) and in ``dtype``.

    ``with OnDevice(dtype=torch.half, device="meta"): model = Net()`` -- torch's device context plus
    the default dtype for floating-point tensors; ``enabled=False`` does nothing.
    """

    def __init__(self, dtype: torch.dtype | None, device: Any = "meta", enabled: bool = True) -> None:
        self.dtype, self.device, self.enabled = dtype, torch.device(device), enabled
        self._device_context: Any = None
        self._saved_dtype: torch.dtype | None = None

    def __enter__(self) -> OnDevice:
        if self.enabled:
            self._device_context = torch.device(self.device)
            self._device_context.__enter__()
            if self.dtype is not None:
                self._saved_dtype = torch.get_default_dtype()
                torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        if self._saved_dtype is not None:
            torch.set_default_dtype(self._saved_dtype)
            self._saved_dtype = None
        self._device_context.__exit__(*exc)


class DeprecatedException(Exception):
    """DeepSpeed's exception for an API it retired (``deepspeed.utils.exceptions``), importable so scripts
    that catch it load."""
