"""Block-wise int8 quantization for ZeRO++'s quantized collectives (qwZ, qgZ): pure functions.

A flat float tensor is cut into blocks of ``block`` elements (the last one zero-padded).
Each block gets one fp32 scale, ``absmax(block) / 127``, and its elements become
``round(x / scale)`` in int8 (symmetric, -127..127). Dequantizing multiplies back.

Error bound (stated, and tested): for every element ``x`` of a block with absolute maximum
``m``, ``|x - dequantize(quantize(x))| <= m / 254 + m * 2**-20``: half a quantization step,
plus an allowance for fp32 rounding of the scale, the product and the difference (each
within ``m * 2**-24``; together far below the step).
Summing ``W`` dequantized contributions (qgZ's reduce-scatter) therefore errs by at most
``sum_r m_r / 254`` per element, ``m_r`` being rank ``r``'s block maximum.

On the wire (:func:`pack`) the int8 values and the fp32 scales travel as one int8 buffer:
``[values (blocks x block) | scales as bytes (blocks x 4)]``, so one collective carries
both. For ``n`` fp32 elements that is ``n + 4n/block`` bytes instead of ``4n`` (3.94x less
at ``block=256``; 1.97x for bf16).

Example:
    >>> import torch
    >>> x = torch.linspace(-1, 1, 1000)
    >>> q, s = quantize_blocks(x, 256)
    >>> y = dequantize_blocks(q, s, x.numel(), torch.float32)
    >>> bool(((x - y).abs() <= error_bound(x, 256)).all())
    True
"""

from __future__ import annotations

import torch

DEFAULT_BLOCK = 256
"""Elements per quantization block (one fp32 scale each)."""

_QMAX = 127.0


def num_blocks(numel: int, block: int) -> int:
    """Blocks needed for ``numel`` elements (the last one padded)."""
    if block <= 0:
        raise ValueError(f"quantization block size must be positive, got {block}")
    return -(-numel // block)


def quantize_blocks(x: torch.Tensor, block: int = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float tensor (any shape, read flat) to int8 with one fp32 scale per block.

    Returns:
        ``(values, scales)``: int8 of ``num_blocks * block`` elements (padding is 0) and
        fp32 of ``num_blocks`` elements.
    """
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    blocks = num_blocks(n, block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=flat.device)
    padded[:n] = flat
    grid = padded.view(blocks, block)
    scales = grid.abs().amax(dim=1) / _QMAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(grid / safe[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return values.view(-1), scales


def dequantize_blocks(
    values: torch.Tensor, scales: torch.Tensor, numel: int, dtype: torch.dtype
) -> torch.Tensor:
    """The ``numel`` leading elements of ``values * scale`` per block, as ``dtype``."""
    blocks = scales.numel()
    grid = values.view(blocks, -1).to(torch.float32) * scales[:, None]
    return grid.view(-1)[:numel].to(dtype)


def error_bound(x: torch.Tensor, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """Per element of ``x`` (flat), the largest round-trip error allowed: its block's absmax ``m`` times
    ``1/254 + 2**-20`` (half a step plus the fp32 rounding allowance)."""
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    blocks = num_blocks(n, block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=flat.device)
    padded[:n] = flat.abs()
    per_block = padded.view(blocks, block).amax(dim=1) * (1 / (2 * _QMAX) + 2.0**-20)
    return per_block.repeat_interleave(block)[:n]


def packed_numel(numel: int, block: int = DEFAULT_BLOCK) -> int:
    """Bytes (int8 elements) of :func:`pack`'s buffer for ``numel`` quantized elements."""
    blocks = num_blocks(numel, block)
    return blocks * block + blocks * 4


def pack(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One int8 buffer holding the values, then the scales' bytes."""
    return torch.cat([values.view(-1), scales.contiguous().view(torch.int8)])


def unpack(buffer: torch.Tensor, numel: int, block: int = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack` for ``numel`` quantized elements: ``(values, scales)``."""
    blocks = num_blocks(numel, block)
    values = buffer[: blocks * block]
    scales = buffer[blocks * block : blocks * block + blocks * 4].clone().view(torch.float32)
    return values, scales


def quantize_packed(x: torch.Tensor, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """:func:`quantize_blocks` then :func:`pack`."""
    return pack(*quantize_blocks(x, block))


def dequantize_packed(
    buffer: torch.Tensor, numel: int, dtype: torch.dtype, block: int = DEFAULT_BLOCK
) -> torch.Tensor:
    """:func:`unpack` then :func:`dequantize_blocks`."""
    values, scales = unpack(buffer, numel, block)
    return dequantize_blocks(values, scales, numel, dtype)
