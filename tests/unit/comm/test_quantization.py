"""Block int8 quantization (ZeRO++ qwZ/qgZ wire format): round trip within the stated bound."""

from __future__ import annotations

import pytest
import torch

from shardwise.comm import quantization as q


@pytest.mark.parametrize("numel", [1, 255, 256, 257, 1000, 4096 + 3])
@pytest.mark.parametrize("block", [16, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_within_half_a_step(numel: int, block: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(numel + block)
    x = (torch.randn(numel, generator=gen) * torch.logspace(-3, 2, numel)).to(dtype)
    y = q.dequantize_packed(q.quantize_packed(x, block), numel, torch.float32, block)
    err = (x.float() - y).abs()
    bound = q.error_bound(x, block)
    assert bool((err <= bound).all()), float((err - bound).max())
    # the bound is tight: some element of a large input uses most of its half step
    if numel >= 1000:
        assert float((err / bound.clamp_min(1e-30)).max()) > 0.5


def test_zero_block_and_packed_size() -> None:
    x = torch.zeros(300)
    x[280] = 3.0
    packed = q.quantize_packed(x, 256)
    assert packed.dtype == torch.int8 and packed.numel() == q.packed_numel(300, 256) == 512 + 8
    y = q.dequantize_packed(packed, 300, torch.float32, 256)
    assert torch.equal(y, x)  # zeros stay zero, an absmax element is exact


def test_bytes_cut_for_fp32() -> None:
    n = 1 << 16
    assert 4 * n / q.packed_numel(n, 256) == pytest.approx(4 / (1 + 4 / 256))


def test_bad_block_is_refused() -> None:
    with pytest.raises(ValueError, match="block size"):
        q.num_blocks(10, 0)
