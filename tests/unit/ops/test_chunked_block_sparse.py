"""The chunked, recomputing block-sparse attention equals dense attention with the element mask."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from shardwise.ops.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    FixedSparsityConfig,
    SparseSelfAttention,
    SparsityConfig,
    VariableSparsityConfig,
    chunked_block_sparse,
)
from shardwise.ops.sparse_attention.block_plan import build_block_plan
from shardwise.ops.sparse_attention.block_sparse import block_sparse_attention
from shardwise.ops.sparse_attention.chunked_block_sparse import TILE_KEYS, rows_per_chunk, sparse_attention

HEADS, BLOCK, SEQ, DIM = 2, 4, 52, 8  # 13 query-block rows: chunks of 2, 3, 5 never divide them

CONFIGS: dict[str, SparsityConfig] = {
    "fixed": FixedSparsityConfig(HEADS, block=BLOCK, num_local_blocks=3),
    "fixed_uni_patterns": FixedSparsityConfig(
        HEADS,
        block=BLOCK,
        different_layout_per_head=True,
        num_local_blocks=4,
        num_different_global_patterns=2,
        attention="unidirectional",
    ),
    "variable_horizontal": VariableSparsityConfig(
        HEADS,
        block=BLOCK,
        num_random_blocks=1,
        local_window_blocks=[1, 2, 3],
        global_block_indices=[1, 5],
        horizontal_global_attention=True,
    ),
    "bigbird_per_head": BigBirdSparsityConfig(
        HEADS, block=BLOCK, different_layout_per_head=True, num_random_blocks=2
    ),
    "bigbird_uni": BigBirdSparsityConfig(HEADS, block=BLOCK, num_random_blocks=1, attention="unidirectional"),
    "bslongformer": BSLongformerSparsityConfig(
        HEADS, block=BLOCK, global_block_indices=[2], global_block_end_indices=[4]
    ),
}


def element_mask(layout: torch.Tensor, causal: bool) -> torch.Tensor:
    """The ``(heads, L, L)`` bool mask of a block layout (plus the causal triangle)."""
    mask = layout.bool().repeat_interleave(BLOCK, -1).repeat_interleave(BLOCK, -2)
    if causal:
        mask = mask & torch.ones(mask.shape[-2:], dtype=torch.bool).tril()
    return mask


def dense_reference(q, k, v, mask, key_bias=None, pair_bias=None):
    """Dense attention with the element mask as -inf and the biases added."""
    bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    if key_bias is not None:
        bias = bias + key_bias[:, None, None, :]
    if pair_bias is not None:
        bias = bias + pair_bias
    return scaled_dot_product_attention(q, k, v, attn_mask=bias)


def _inputs(batch: int = 2):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(batch, HEADS, SEQ, DIM, generator=gen).requires_grad_() for _ in range(3)]


def _grads(out, tensors):
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    return torch.autograd.grad((out * weights).sum(), tensors)


def _assert_equal_with_grads(out, ref, tensors) -> None:
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(_grads(out, tensors), _grads(ref, tensors), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _chunked(attn: SparseSelfAttention, q, k, v, chunk_rows: int, key_bias=None, pair_bias=None):
    plan = attn.plan(SEQ, q.device)
    scale = DIM**-0.5
    return sparse_attention(
        q, k, v, plan, BLOCK, scale, key_bias, pair_bias, attn.causal, chunk_rows=chunk_rows
    )


@pytest.mark.parametrize(("chunk_rows", "tile_keys"), [(1, TILE_KEYS), (3, 12), (5, 8), (13, 4)])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_chunks_and_key_tiles_that_do_not_divide_equal_dense_fp32(
    name: str, chunk_rows: int, tile_keys: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row chunks of 1, 3, 5 and 13 of 13 block rows; key tiles of 64 (one tile), 3, 2 and 1 blocks."""
    monkeypatch.setattr(chunked_block_sparse, "TILE_KEYS", tile_keys)
    attn = SparseSelfAttention(CONFIGS[name], max_seq_length=SEQ)
    q, k, v = _inputs()
    out = _chunked(attn, q, k, v, chunk_rows)
    ref = dense_reference(q, k, v, element_mask(attn.get_layout(SEQ), attn.causal))
    _assert_equal_with_grads(out, ref, (q, k, v))


@pytest.mark.parametrize("name", ["bigbird_per_head", "fixed_uni_patterns"])
def test_chunked_equals_the_gathered_autograd_path(name: str) -> None:
    attn = SparseSelfAttention(CONFIGS[name], max_seq_length=SEQ)
    q, k, v = _inputs()
    plan = attn.plan(SEQ, q.device)
    gathered = block_sparse_attention(q, k, v, plan, BLOCK, DIM**-0.5, causal=attn.causal)
    _assert_equal_with_grads(_chunked(attn, q, k, v, 2), gathered, (q, k, v))


@pytest.mark.parametrize("mode", ["add", "mul"])
def test_key_padding_and_attention_masks_in_chunks(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunked_block_sparse, "TILE_KEYS", 8)
    attn = SparseSelfAttention(
        CONFIGS["bigbird_per_head"], key_padding_mask_mode=mode, attn_mask_mode=mode, max_seq_length=SEQ
    )
    q, k, v = _inputs()
    keep = torch.ones(2, SEQ)
    keep[0, -10:] = 0
    keep[1, 5:7] = 0
    pair = (torch.rand(SEQ, SEQ, generator=torch.Generator().manual_seed(1)) > 0.3).float()
    pair.fill_diagonal_(1)
    if mode == "add":
        key_bias, pair_bias = (keep - 1) * 10000.0, torch.randn(SEQ, SEQ)
    else:
        inf = torch.tensor(float("-inf"))
        key_bias = torch.where(keep == 0, inf, torch.tensor(0.0))
        pair_bias = torch.where(pair == 0, inf, torch.tensor(0.0))
    out = _chunked(attn, q, k, v, 3, key_bias, pair_bias)
    ref = dense_reference(q, k, v, element_mask(attn.get_layout(SEQ), False), key_bias, pair_bias)
    _assert_equal_with_grads(out, ref, (q, k, v))


def test_causal_with_relative_position_bias_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunked_block_sparse, "TILE_KEYS", 12)
    attn = SparseSelfAttention(CONFIGS["bigbird_uni"], max_seq_length=SEQ)
    q, k, v = _inputs()
    rpe = torch.randn(SEQ, SEQ)
    out = _chunked(attn, q, k, v, 5, pair_bias=rpe)
    ref = dense_reference(q, k, v, element_mask(attn.get_layout(SEQ), True), pair_bias=rpe)
    _assert_equal_with_grads(out, ref, (q, k, v))


def test_a_learned_relative_position_bias_gets_its_gradient() -> None:
    attn = SparseSelfAttention(CONFIGS["fixed"], max_seq_length=SEQ, chunk_bytes=1)
    q, k, v = _inputs()
    rpe = torch.randn(SEQ, SEQ, requires_grad=True)
    out = attn(q, k, v, rpe=rpe)
    ref = dense_reference(q, k, v, element_mask(attn.get_layout(SEQ), False), pair_bias=rpe)
    _assert_equal_with_grads(out, ref, (q, k, v, rpe))


def test_the_module_default_budget_and_a_tiny_budget_agree() -> None:
    q, k, v = _inputs()
    whole = SparseSelfAttention(CONFIGS["variable_horizontal"], max_seq_length=SEQ)
    tiny = SparseSelfAttention(CONFIGS["variable_horizontal"], max_seq_length=SEQ, chunk_bytes=1)
    _assert_equal_with_grads(tiny(q, k, v), whole(q, k, v), (q, k, v))


def test_backward_keeps_only_q_k_v_the_output_and_the_log_sum_exp() -> None:
    """The autograd graph holds the inputs, the output and one fp32 number per query row; the
    gathered path holds the gathered blocks and the sparse score/probability tensors as well."""
    cfg = BigBirdSparsityConfig(HEADS, block=16, num_random_blocks=1)
    length = 16 * 32
    attn = SparseSelfAttention(cfg, max_seq_length=length)
    q, k, v = (torch.randn(1, HEADS, length, 32, requires_grad=True) for _ in range(3))
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attn(q, k, v)
    io_bytes = 4 * q.numel() * q.element_size()  # q, k, v, output
    assert sum(saved.values()) <= io_bytes + HEADS * length * 4  # + the log-sum-exp
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block_sparse_attention(q, k, v, attn.plan(length, q.device), 16, 32**-0.5)
    assert sum(saved.values()) > 2 * io_bytes  # what the chunked path saves


def test_rows_per_chunk_follows_the_byte_budget() -> None:
    plan = build_block_plan(CONFIGS["fixed"].make_layout(SEQ))
    group = next(g for g in plan.groups if not g.dense)
    one_row = rows_per_chunk(group, plan, 4, BLOCK, DIM, 4, 1)
    assert one_row == 1  # at least one row, whatever the budget
    keys = max(group.width, plan.shared.numel()) * BLOCK  # both under one tile of TILE_KEYS keys
    per_row = 4 * (16 * BLOCK * keys + 4 * group.width * BLOCK * DIM * 4 + 20 * BLOCK * DIM)
    assert rows_per_chunk(group, plan, 4, BLOCK, DIM, 4, 3 * per_row + 1) == 3
    with pytest.raises(ValueError, match="chunk_rows=0"):
        q, k, v = _inputs()
        sparse_attention(q, k, v, plan, BLOCK, 1.0, chunk_rows=0)
    with pytest.raises(ValueError, match="chunk_bytes=0"):
        SparseSelfAttention(CONFIGS["fixed"], max_seq_length=SEQ, chunk_bytes=0)


def test_non_contiguous_inputs_with_per_head_layouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Projections reshaped the BERT way, ``(B, L, H, D)`` permuted, are read without a copy."""
    monkeypatch.setattr(chunked_block_sparse, "TILE_KEYS", 8)
    attn = SparseSelfAttention(CONFIGS["bigbird_per_head"], max_seq_length=SEQ)
    gen = torch.Generator().manual_seed(2)
    base = [torch.randn(2, SEQ, HEADS, DIM, generator=gen).requires_grad_() for _ in range(3)]
    q, k, v = (t.permute(0, 2, 1, 3) for t in base)
    assert not q.is_contiguous()
    out = _chunked(attn, q, k, v, 3)
    ref = dense_reference(q, k, v, element_mask(attn.get_layout(SEQ), False))
    _assert_equal_with_grads(out, ref, base)


def test_bf16_chunks_stay_within_the_bf16_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the module's bf16 test: 4 roundings of 2**-9 on O(1) outputs and gradients, softmax and the
    accumulators in fp32 (the tiles' partial outputs are rounded once more: 2e-2 still holds)."""
    monkeypatch.setattr(chunked_block_sparse, "TILE_KEYS", 8)
    attn = SparseSelfAttention(CONFIGS["variable_horizontal"], max_seq_length=SEQ)
    q, k, v = _inputs()
    ref = dense_reference(q, k, v, element_mask(attn.get_layout(SEQ), False))
    low = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    out = _chunked(attn, *low, 5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for got, want in zip(_grads(out.float(), low), _grads(ref, (q, k, v)), strict=True):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
