"""The ``offload_optimizer`` and ``offload_param`` config blocks, decided once as an :class:`OffloadSpec`
(read by :class:`~shardwise.zero.offload.OffloadStore` and stage 3's NVMe parameters)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardwise.config.sections.zero import AioConfig, ZeroConfig
from shardwise.zero.nvme import AioSettings

__all__ = ["OffloadSpec", "optimizer_offload_spec", "param_offload_spec"]


@dataclass(frozen=True)
class OffloadSpec:
    """One offload block, decided once from the config.

    Attributes:
        device: ``"cpu"`` or ``"nvme"``.
        nvme_path: directory for swap files (nvme only).
        pin_memory: pin host buffers (only honoured when a GPU exists).
        ratio: fraction of the optimizer's elements offloaded (stage 3 may use < 1).
        buffer_count: sub-groups resident at once while streaming.
        sub_group_size: elements per sub-group.
        pipeline_read: read the next sub-groups while one steps.
        pipeline_write: write a sub-group back while the next steps.
        aio: file I/O settings.
        masters_on_host: the masters handed in are host tensors already (stage 3 with
            ``offload_param``): no staging copies are made.
        buffer_size: bytes per parameter-file request (``offload_param.buffer_size``).
    """

    device: str
    nvme_path: Path | None = None
    pin_memory: bool = False
    ratio: float = 1.0
    buffer_count: int = 4
    sub_group_size: int = 1_000_000_000
    pipeline_read: bool = False
    pipeline_write: bool = False
    aio: AioSettings = field(default_factory=AioSettings)
    masters_on_host: bool = False
    buffer_size: int = 100_000_000

    @property
    def pin(self) -> bool:
        """Whether host buffers are really pinned (pinning needs a GPU)."""
        return self.pin_memory and torch.cuda.is_available()


def _aio(cfg_aio: AioConfig) -> AioSettings:
    return AioSettings(
        block_size=int(cfg_aio.block_size),
        queue_depth=int(cfg_aio.queue_depth),
        intra_op_parallelism=int(cfg_aio.intra_op_parallelism),
        single_submit=bool(cfg_aio.single_submit),
        overlap_events=bool(cfg_aio.overlap_events),
    )


def optimizer_offload_spec(zero: ZeroConfig, aio: AioConfig, *, masters_on_host: bool = False) -> OffloadSpec | None:
    """The ``offload_optimizer`` block as an :class:`OffloadSpec` (None when off)."""
    block = zero.offload_optimizer
    if block is None or block.device == "none":
        return None
    return OffloadSpec(
        device=block.device,
        nvme_path=block.nvme_path,
        pin_memory=bool(block.pin_memory),
        ratio=float(block.ratio),
        buffer_count=max(1, int(block.buffer_count)),
        sub_group_size=max(1, int(zero.sub_group_size)),
        pipeline_read=bool(block.pipeline_read),
        pipeline_write=bool(block.pipeline_write),
        aio=_aio(aio),
        masters_on_host=masters_on_host,
    )


def param_offload_spec(zero: ZeroConfig, aio: AioConfig) -> OffloadSpec | None:
    """The ``offload_param`` block as an :class:`OffloadSpec` (None when off)."""
    block = zero.offload_param
    if block is None or block.device == "none":
        return None
    return OffloadSpec(
        device=block.device,
        nvme_path=block.nvme_path,
        pin_memory=bool(block.pin_memory),
        buffer_count=max(1, int(block.buffer_count)),
        aio=_aio(aio),
        buffer_size=max(1, int(block.buffer_size)),
    )
