"""The error-compensated 1-bit all-reduce of 1-bit Adam (Tang et al., 2021), on torch.distributed.

An average over the ranks of a flat fp32 tensor ``x`` of ``n`` elements, in two stages, each
sending one bit per element plus one scale per rank:

1. **worker**: ``w = x + worker_error`` (padded with zeros to ``n_pad``, a multiple of
   ``8 x world``); its scale ``s = ||w|| / sqrt(n_pad)``, its signs ``sign(w)`` (``>= 0`` is
   ``+1``: 1-bit has no zero), ``worker_error = w - s * sign(w)``. The signs are packed 8 per
   byte; chunk ``j`` of the packed bytes goes to rank ``j`` (``all_to_all_single``), the scales
   to everyone (``all_gather``).
2. **server** (rank ``j`` for chunk ``j``): ``m = mean_r(s_r * sign_r) + server_error``,
   compressed the same way (``server_error = m - s_j * sign(m)``); the packed server signs and
   scales are all-gathered, and every rank decompresses the same result.

The errors carry what compression dropped into the next call (error feedback), so over steps
the compressed averages track the true ones. Both buffers are per rank (each holds different
values) and part of the training state: :meth:`CompressedAllReduce.state_dict`.

Bytes one rank sends per call, for ``n`` fp32 elements: ``n_pad/8`` (stage 1) plus
``n_pad/(8 world)`` (stage 2) plus two scales, against ``4n`` for the fp32 all-reduce: at most
1/16 of it when ``n`` is a multiple of ``8 x world``. Both collectives work on gloo (CPU) and
NCCL; they are recorded by the comms logger as ``all_to_all_single`` and
``all_gather_into_tensor`` (message size: what one rank contributes).

Example:
    >>> packed = pack_signs(torch.tensor([1.0, -2.0, 0.0, -0.5, 3.0, 1.0, -1.0, 2.0, -4.0]))
    >>> packed.tolist(), unpack_signs(packed, 9).tolist()
    ([181, 0], [1.0, -1.0, 1.0, -1.0, 1.0, 1.0, -1.0, 1.0, -1.0])
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from shardwise.comm.comms_logger import COMMS_LOGGER as _COMMS
from shardwise.comm.group_type import Group

__all__ = ["CompressedAllReduce", "compressed_bytes", "pack_signs", "padded_numel", "unpack_signs"]


def _pack_bits(positive: torch.Tensor) -> torch.Tensor:
    bits = positive.reshape(-1)
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    columns = bits.view(torch.uint8).view(-1, 8)  # bool is one byte of 0/1: a free view
    packed = columns[:, 0].clone()
    for i in range(1, 8):  # 7 passes over n/8 bytes: cheaper than a reduction over 8-wide rows
        packed |= columns[:, i] << i
    return packed


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """One bit per element of ``x`` (1 where ``x >= 0``), 8 per byte, element ``i`` at bit ``i % 8``.

    The last byte is zero-padded. Returns a uint8 tensor of ``ceil(numel / 8)`` elements.
    """
    return _pack_bits(x >= 0)


_SIGN_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _sign_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Row ``b``: the 8 signs (+1/-1) byte ``b`` encodes."""
    key = (device, dtype)
    if key not in _SIGN_TABLES:
        byte = torch.arange(256).unsqueeze(1)
        bits = (byte >> torch.arange(8)) & 1
        _SIGN_TABLES[key] = (bits * 2 - 1).to(device=device, dtype=dtype)
    return _SIGN_TABLES[key]


def unpack_signs(
    packed: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """The first ``numel`` signs of ``packed`` (from :func:`pack_signs`) as ``+1`` / ``-1``, times
    ``scale`` when given (a one-element tensor), in one table look-up per byte."""
    table = _sign_table(packed.device, dtype)
    if scale is not None:
        table = table * scale
    return table.index_select(0, packed.reshape(-1).long()).view(-1)[:numel]


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``8 x world_size`` (whole bytes per server chunk)."""
    unit = 8 * world_size
    return max(unit, -(-numel // unit) * unit)


def compressed_bytes(numel: int, world_size: int) -> int:
    """Bytes one rank contributes per :class:`CompressedAllReduce` call (both stages, both scales)."""
    n_pad = padded_numel(numel, world_size)
    return n_pad // 8 + n_pad // (8 * world_size) + 2 * 4


def _compress(buffer: torch.Tensor, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Add ``error`` to ``buffer`` (in place), compress it, write the new error: (scale, packed signs)."""
    buffer.add_(error)
    scale = torch.linalg.vector_norm(buffer) / math.sqrt(buffer.numel())
    positive = buffer >= 0
    torch.sub(buffer, torch.where(positive, scale, -scale), out=error)  # = buffer - scale * sign
    return scale.reshape(1), _pack_bits(positive)


_all_gather_native = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _start(op: str, tensor: torch.Tensor, world: int) -> Any:
    if not _COMMS.enabled:
        return None
    return _COMMS.start(op, tensor.numel() * tensor.element_size(), world, tensor.is_cuda)


def _all_gather(tensor: torch.Tensor, world: int, group: Group) -> torch.Tensor:
    out = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    record = _start("all_gather_into_tensor", tensor, world)
    _all_gather_native(out, tensor, group=group)
    if record is not None:
        record.complete()
    return out


def _all_to_all(tensor: torch.Tensor, world: int, group: Group) -> torch.Tensor:
    out = torch.empty_like(tensor)
    record = _start("all_to_all_single", tensor, world)
    dist.all_to_all_single(out, tensor, group=group)
    if record is not None:
        record.complete()
    return out


class CompressedAllReduce:
    """Error-compensated 1-bit averaging of one flat tensor size across a process group.

    Args:
        numel: elements of the tensors :meth:`average` receives.
        device: where the error buffers live (the tensors' device).
        group: process group (None: the world).

    Attributes:
        worker_error: this rank's stage-1 error, ``padded_numel`` elements.
        server_error: this rank's stage-2 error, for the chunk it serves.
    """

    def __init__(self, numel: int, device: torch.device | str = "cpu", group: Group = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.numel = numel
        self.padded = padded_numel(numel, self.world_size)
        self.chunk = self.padded // self.world_size
        self.worker_error = torch.zeros(self.padded, dtype=torch.float32, device=device)
        self.server_error = torch.zeros(self.chunk, dtype=torch.float32, device=device)

    def average(self, tensor: torch.Tensor) -> None:
        """Replace ``tensor`` (``numel`` elements) by the compressed average over the group, in place.

        Collective: every rank calls it with a tensor of the same size. Every rank ends with the
        same values; the error buffers are updated.
        """
        if tensor.numel() != self.numel:
            raise ValueError(f"compressed all-reduce built for {self.numel} elements got {tensor.numel()}")
        world = self.world_size
        buffer = torch.zeros(self.padded, dtype=torch.float32, device=tensor.device)
        buffer[: self.numel].copy_(tensor.reshape(-1))
        scale, packed = _compress(buffer, self.worker_error)
        received = _all_to_all(packed, world, self.group).view(world, -1)  # row r: rank r's bits of my chunk
        scales = _all_gather(scale, world, self.group)
        server = torch.zeros(self.chunk, dtype=torch.float32, device=tensor.device)
        for r in range(world):
            server.add_(unpack_signs(received[r], self.chunk, scale=scales[r]))
        server.div_(world)
        server_scale, server_packed = _compress(server, self.server_error)
        all_packed = _all_gather(server_packed, world, self.group).view(world, -1)
        server_scales = _all_gather(server_scale, world, self.group)
        result = torch.cat(
            [unpack_signs(all_packed[j], self.chunk, scale=server_scales[j]) for j in range(world)]
        )
        tensor.view(-1).copy_(result[: self.numel])

    def state_dict(self) -> dict[str, Any]:
        """This rank's error buffers (copies) and the shape they were built for."""
        return {
            "numel": self.numel,
            "world_size": self.world_size,
            "worker_error": self.worker_error.clone(),
            "server_error": self.server_error.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Restore the error buffers; False (errors reset to zero) when the saved run's size or world differs."""
        if int(state.get("numel", -1)) != self.numel or int(state.get("world_size", -1)) != self.world_size:
            self.worker_error.zero_()
            self.server_error.zero_()
            return False
        self.worker_error.copy_(state["worker_error"])
        self.server_error.copy_(state["server_error"])
        return True
