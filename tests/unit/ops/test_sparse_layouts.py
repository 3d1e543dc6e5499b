"""The five sparsity layouts on small hand-checked cases (block 1: one row per block)."""

from __future__ import annotations

import pytest
import torch

from shardwise.ops.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    VariableSparsityConfig,
)


def _grid(*rows: str) -> torch.Tensor:
    return torch.tensor([[int(c) for c in row] for row in rows], dtype=torch.int64)


def test_dense_is_all_ones_with_deepspeeds_shape_and_dtype() -> None:
    layout = DenseSparsityConfig(num_heads=3, block=4).make_layout(16)
    assert layout.shape == (3, 4, 4) and layout.dtype == torch.int64
    assert bool((layout == 1).all())


def test_sequence_not_a_multiple_of_the_block_is_refused() -> None:
    with pytest.raises(ValueError, match="dividable by Block size 16"):
        FixedSparsityConfig(num_heads=1).make_layout(40)


def test_fixed_bidirectional_local_windows_and_last_block_of_each_window_global() -> None:
    layout = FixedSparsityConfig(1, block=1, num_local_blocks=4, num_global_blocks=1).make_layout(8)
    expected = _grid(*["11110001"] * 4, *["00011111"] * 4)
    assert torch.equal(layout[0], expected)


def test_fixed_unidirectional_is_lower_triangular_in_windows_and_global_from_its_row_on() -> None:
    cfg = FixedSparsityConfig(1, block=1, num_local_blocks=4, attention="unidirectional")
    expected = _grid(
        "10000000", "11000000", "11100000", "11110000", "00011000", "00011100", "00011110", "00011111"
    )
    assert torch.equal(cfg.make_layout(8)[0], expected)


def test_fixed_horizontal_global_and_a_short_last_window() -> None:
    cfg = FixedSparsityConfig(1, block=1, num_local_blocks=4, horizontal_global_attention=True)
    # windows {0..3}, {4, 5}; global blocks 3 and (short window) 5, as columns and rows
    expected = _grid("111101", "111101", "111101", "111111", "000111", "111111")
    assert torch.equal(cfg.make_layout(6)[0], expected)


def test_fixed_different_global_patterns_per_head() -> None:
    cfg = FixedSparsityConfig(
        2, block=1, different_layout_per_head=True, num_local_blocks=2, num_different_global_patterns=2
    )
    layout = cfg.make_layout(4)
    assert torch.equal(layout[0], _grid("1101", "1101", "0111", "0111"))  # last block of each window
    assert torch.equal(layout[1], _grid("1110", "1110", "1011", "1011"))  # first block of each window


def test_fixed_rejects_inconsistent_parameters() -> None:
    with pytest.raises(ValueError, match="dividable"):
        FixedSparsityConfig(1, num_local_blocks=4, num_global_blocks=3)
    with pytest.raises(ValueError, match="different_layout_per_head"):
        FixedSparsityConfig(2, num_different_global_patterns=2)
    with pytest.raises(ValueError, match="bidirectional"):
        FixedSparsityConfig(1, attention="unidirectional", horizontal_global_attention=True)


def test_variable_listed_windows_then_the_last_size_repeats_with_a_global_column() -> None:
    cfg = VariableSparsityConfig(1, block=1, local_window_blocks=[1, 2], global_block_indices=[0])
    # windows [0], [1, 2], [3, 4], [5]; column 0 global
    expected = _grid("100000", "111000", "111000", "100110", "100110", "100001")
    assert torch.equal(cfg.make_layout(6)[0], expected)


def test_variable_global_ranges_with_horizontal_attention() -> None:
    cfg = VariableSparsityConfig(
        1,
        block=1,
        local_window_blocks=[2],
        global_block_indices=[2],
        global_block_end_indices=[4],
        horizontal_global_attention=True,
    )
    # windows {0,1} {2,3} {4,5}; blocks 2 and 3 global both ways
    expected = _grid("111100", "111100", "111111", "111111", "001111", "001111")
    assert torch.equal(cfg.make_layout(6)[0], expected)


def test_variable_unidirectional_global_columns_start_at_their_block() -> None:
    cfg = VariableSparsityConfig(
        1, block=1, local_window_blocks=[3], global_block_indices=[1], attention="unidirectional"
    )
    expected = _grid("100000", "110000", "111000", "010100", "010110", "010111")
    assert torch.equal(cfg.make_layout(6)[0], expected)


def test_bigbird_sliding_window_and_global_first_block() -> None:
    cfg = BigBirdSparsityConfig(1, block=1, num_random_blocks=0, num_sliding_window_blocks=3)
    expected = _grid("111111", "111000", "111100", "101110", "100111", "100011")
    assert torch.equal(cfg.make_layout(6)[0], expected)
    uni = BigBirdSparsityConfig(1, block=1, num_random_blocks=0, attention="unidirectional")
    assert torch.equal(uni.make_layout(6)[0], expected.tril())


def test_random_blocks_are_reproducible_from_the_seed_and_differ_per_head() -> None:
    def make(seed: int, **kw: object) -> torch.Tensor:
        cfg = BigBirdSparsityConfig(
            4, block=1, num_random_blocks=2, num_sliding_window_blocks=1, num_global_blocks=0, seed=seed, **kw
        )
        return cfg.make_layout(32)

    first, again, other = make(7), make(7), make(8)
    assert torch.equal(first, again) and not torch.equal(first, other)
    eye = torch.eye(32, dtype=torch.int64)
    extra = (first[0] - eye).sum(-1)  # random blocks beside the diagonal: 2, or 1 when one hit it
    assert set(extra.tolist()) <= {1, 2} and 2 in extra.tolist()
    per_head = make(7, different_layout_per_head=True)
    assert not torch.equal(per_head[0], per_head[1])
    causal = BigBirdSparsityConfig(
        1,
        block=1,
        num_random_blocks=2,
        num_sliding_window_blocks=1,
        num_global_blocks=0,
        attention="unidirectional",
    ).make_layout(32)[0]
    assert torch.equal(causal, causal.tril())
    assert causal[0].sum() == 1 and bool((causal[2:].sum(-1) >= 2).all())  # drawn from columns 0..row


def test_variable_random_blocks_count_per_row() -> None:
    cfg = VariableSparsityConfig(
        1, block=1, num_random_blocks=3, local_window_blocks=[1], global_block_indices=[]
    )
    layout = cfg.make_layout(16)[0]
    assert bool(((layout - torch.eye(16, dtype=torch.int64)).sum(-1) >= 2).all())
    assert bool((layout.sum(-1) <= 4).all())


def test_bslongformer_sliding_window_and_global_ranges() -> None:
    cfg = BSLongformerSparsityConfig(1, block=1, global_block_indices=[1], global_block_end_indices=[3])
    expected = _grid("111000", "111111", "111111", "011110", "011111", "011011")
    assert torch.equal(cfg.make_layout(6)[0], expected)
    uni = BSLongformerSparsityConfig(
        1, block=1, global_block_indices=[1], global_block_end_indices=[3], attention="unidirectional"
    )
    assert torch.equal(uni.make_layout(6)[0], expected.tril())


def test_global_indices_past_the_sequence_are_ignored_and_windows_checked() -> None:
    with_far = BSLongformerSparsityConfig(1, block=1, global_block_indices=[0, 10]).make_layout(6)
    assert torch.equal(with_far, BSLongformerSparsityConfig(1, block=1).make_layout(6))
    with pytest.raises(ValueError, match="sliding window"):
        BSLongformerSparsityConfig(1, block=1, num_sliding_window_blocks=7).make_layout(6)
    with pytest.raises(ValueError, match="one end per start"):
        BSLongformerSparsityConfig(1, global_block_indices=[0, 2], global_block_end_indices=[1])


def test_layouts_are_cached_per_sequence_length_and_shared_heads_are_one_view() -> None:
    cfg = FixedSparsityConfig(num_heads=12, block=16)
    layout = cfg.make_layout(16384)
    assert cfg.make_layout(16384) is layout
    assert layout.shape == (12, 1024, 1024) and layout.stride(0) == 0  # one layout for every head
    assert cfg.make_layout(1024).shape == (12, 64, 64)
