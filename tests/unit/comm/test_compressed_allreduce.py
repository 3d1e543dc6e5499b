"""The pure parts of the 1-bit all-reduce: sign packing, padding and the byte count."""

from __future__ import annotations

import pytest
import torch

from shardwise.comm.compressed_allreduce import compressed_bytes, pack_signs, padded_numel, unpack_signs


def test_pack_signs_puts_element_i_at_bit_i_mod_8() -> None:
    x = torch.tensor([1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 2.0])
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [0b00000001, 0b00000010]


def test_zero_and_negative_zero_count_as_plus_one() -> None:
    assert unpack_signs(pack_signs(torch.tensor([0.0, -0.0, -1e-30])), 3).tolist() == [1.0, 1.0, -1.0]


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 64, 1001])
def test_unpack_inverts_pack(numel: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    packed = pack_signs(x)
    assert packed.numel() == -(-numel // 8)
    expected = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(unpack_signs(packed, numel), expected)


def test_padding_gives_every_server_whole_bytes() -> None:
    assert padded_numel(1, 2) == 16
    assert padded_numel(16, 2) == 16
    assert padded_numel(17, 3) == 24
    assert padded_numel(1000, 3) == 1008
    for numel in (5, 1000, 4097):
        for world in (2, 3, 5):
            assert padded_numel(numel, world) % (8 * world) == 0


def test_bytes_are_a_sixteenth_of_fp32_plus_scales_when_aligned() -> None:
    numel = 8 * 2 * 1000
    # stage 1: numel/8; stage 2: numel/16 (one of two chunks); two fp32 scales
    assert compressed_bytes(numel, 2) == numel // 8 + numel // 16 + 8
    assert compressed_bytes(numel, 2) <= (4 * numel) / 16 * 0.75 + 8
