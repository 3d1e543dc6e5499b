"""SparseSelfAttention equals dense attention with the equivalent element mask (outputs and gradients)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from shardwise.ops.sparse_attention import (
    BertSparseSelfAttention,
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparseSelfAttention,
    SparsityConfig,
    VariableSparsityConfig,
)
from shardwise.ops.sparse_attention.block_plan import build_block_plan, padded_width

HEADS, BLOCK, SEQ, DIM = 2, 4, 48, 8

CONFIGS: dict[str, SparsityConfig] = {
    "dense": DenseSparsityConfig(HEADS, block=BLOCK),
    "fixed": FixedSparsityConfig(HEADS, block=BLOCK, num_local_blocks=2),
    "fixed_uni_patterns": FixedSparsityConfig(
        HEADS,
        block=BLOCK,
        different_layout_per_head=True,
        num_local_blocks=4,
        num_different_global_patterns=2,
        attention="unidirectional",
    ),
    "fixed_horizontal": FixedSparsityConfig(HEADS, block=BLOCK, horizontal_global_attention=True),
    "variable": VariableSparsityConfig(
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


def element_mask(layout: torch.Tensor, block: int, causal: bool) -> torch.Tensor:
    """The ``(heads, L, L)`` bool mask a block layout stands for (plus the causal triangle)."""
    mask = layout.bool().repeat_interleave(block, -1).repeat_interleave(block, -2)
    if causal:
        mask = mask & torch.ones(mask.shape[-2:], dtype=torch.bool).tril()
    return mask


def dense_reference(q, k, v, mask, key_bias=None, pair_bias=None):
    """Plain dense attention with the element mask as -inf and the biases added."""
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    if key_bias is not None:
        bias = bias + key_bias[:, None, None, :]
    if pair_bias is not None:
        bias = bias + pair_bias
    return scaled_dot_product_attention(q, k, v, attn_mask=bias)


def _inputs(dtype=torch.float32, batch=2, seq=SEQ):
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(batch, HEADS, seq, DIM, generator=gen, dtype=dtype).requires_grad_() for _ in range(3)
    ]


def _grads(out, tensors):
    weights = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)
    return torch.autograd.grad((out * weights).sum(), tensors)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_outputs_and_gradients_equal_dense_with_the_element_mask_fp32(name: str) -> None:
    attn = SparseSelfAttention(CONFIGS[name], max_seq_length=64)
    q, k, v = _inputs()
    mask = element_mask(attn.get_layout(SEQ), BLOCK, attn.causal)
    out = attn(q, k, v)
    ref = dense_reference(q, k, v, mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v)), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["add", "mul"])
def test_key_padding_and_attention_masks_in_both_modes(mode: str) -> None:
    cfg = CONFIGS["bigbird_per_head"]
    attn = SparseSelfAttention(cfg, key_padding_mask_mode=mode, attn_mask_mode=mode, max_seq_length=64)
    q, k, v = _inputs()
    keep = torch.ones(2, SEQ)
    keep[0, -10:] = 0  # padding at the end of the first sequence
    keep[1, 5:7] = 0
    pair = (torch.rand(SEQ, SEQ, generator=torch.Generator().manual_seed(1)) > 0.3).float()
    pair.fill_diagonal_(1)
    if mode == "add":
        key_bias, pair_bias = (keep - 1) * 10000.0, torch.randn(SEQ, SEQ)
        out = attn(q, k, v, key_padding_mask=key_bias, attn_mask=pair_bias)
    else:
        inf = torch.tensor(float("-inf"))
        key_bias = torch.where(keep == 0, inf, torch.tensor(0.0))
        pair_bias = torch.where(pair == 0, inf, torch.tensor(0.0))
        out = attn(q, k, v, key_padding_mask=keep.reshape(2, 1, 1, SEQ), attn_mask=pair)
    ref = dense_reference(q, k, v, element_mask(attn.get_layout(SEQ), BLOCK, False), key_bias, pair_bias)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v)), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_relative_position_bias_is_added_to_the_scores() -> None:
    attn = SparseSelfAttention(CONFIGS["fixed"], max_seq_length=SEQ)
    q, k, v = _inputs()
    rpe = torch.randn(SEQ, SEQ)
    ref = dense_reference(q, k, v, element_mask(attn.get_layout(SEQ), BLOCK, False), pair_bias=rpe)
    torch.testing.assert_close(attn(q, k, v, rpe=rpe), ref, atol=1e-5, rtol=1e-5)


def test_unidirectional_is_causal_inside_the_diagonal_blocks() -> None:
    attn = SparseSelfAttention(CONFIGS["bigbird_uni"], max_seq_length=SEQ)
    q, k, v = _inputs()
    out = attn(q, k, v)
    v2 = v.detach().clone()
    v2[:, :, 30:] += 100.0  # the future of position 29 changes; its output must not
    out2 = attn(q, k, v2)
    torch.testing.assert_close(out[:, :, :30], out2[:, :, :30])
    assert not torch.allclose(out[:, :, 30:], out2[:, :, 30:])


def test_bf16_stays_within_the_bf16_bound_of_the_fp32_dense_result() -> None:
    """bf16 keeps 8 significant bits (relative rounding 2**-9 ~ 0.002 per operation): inputs, scores,
    probabilities and the output are each rounded once, while softmax runs in fp32. With unit-scale
    inputs the outputs are O(1), so 4 roundings bound the error by about 4 * 2**-8 ~ 0.016; 2e-2 it is.
    """
    attn = SparseSelfAttention(CONFIGS["variable"], max_seq_length=64)
    q, k, v = _inputs()
    ref = dense_reference(q, k, v, element_mask(attn.get_layout(SEQ), BLOCK, False))
    out = attn(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_shorter_sequences_use_the_top_left_of_the_master_layout() -> None:
    cfg = FixedSparsityConfig(HEADS, block=BLOCK, num_local_blocks=4)
    attn = SparseSelfAttention(cfg, max_seq_length=64)
    assert torch.equal(attn.get_layout(24), cfg.make_layout(64)[:, :6, :6])
    q, k, v = _inputs(seq=24)
    ref = dense_reference(q, k, v, element_mask(attn.get_layout(24), BLOCK, False))
    torch.testing.assert_close(attn(q, k, v), ref, atol=1e-5, rtol=1e-5)
    assert attn.plan(24, q.device) is attn.plan(24, q.device)  # cached per length


def test_a_transposed_key_is_accepted_and_bad_shapes_are_refused() -> None:
    attn = SparseSelfAttention(CONFIGS["fixed"], max_seq_length=64)
    q, k, v = _inputs()
    torch.testing.assert_close(attn(q, k.transpose(-1, -2), v), attn(q, k, v))
    with pytest.raises(ValueError, match="dividable"):
        attn(*_inputs(seq=SEQ - 2))
    with pytest.raises(ValueError, match="max_seq_length"):
        attn(*_inputs(seq=80))
    with pytest.raises(ValueError, match="heads"):
        SparseSelfAttention(FixedSparsityConfig(3, block=BLOCK), max_seq_length=64)(q, k, v)
    with pytest.raises(ValueError, match="'add' or 'mul'"):
        SparseSelfAttention(CONFIGS["fixed"], attn_mask_mode="max")


def test_the_plan_reads_only_the_layouts_blocks() -> None:
    cfg = BigBirdSparsityConfig(1, block=16, num_random_blocks=1)
    layout = cfg.make_layout(16 * 256)
    plan = build_block_plan(layout)
    assert plan.nonzero_blocks == int(layout.sum())
    assert plan.shared.tolist() == [0]  # the global column: read once for every row
    read = sum(g.rows.numel() * (g.width + plan.shared.numel()) for g in plan.groups if not g.dense)
    read += sum(g.rows.numel() * plan.num_blocks for g in plan.groups if g.dense)
    assert read <= 1.25 * plan.nonzero_blocks + 256  # padding costs at most a quarter (+1 shared per row)
    assert [g.dense for g in plan.groups].count(True) == 1  # the global row
    assert [padded_width(c, 1000) for c in (3, 8, 9, 17, 33, 100)] == [3, 8, 10, 20, 40, 112]


def test_bert_sparse_self_attention_matches_dense_attention_of_its_projections() -> None:
    class Config:
        hidden_size, num_attention_heads, max_position_embeddings = 16, HEADS, 64

    torch.manual_seed(0)
    layer = BertSparseSelfAttention(Config(), DenseSparsityConfig(HEADS, block=BLOCK))
    hidden = torch.randn(2, SEQ, 16)
    mask = torch.zeros(2, SEQ)
    mask[1, -8:] = -10000.0
    out = layer(hidden, mask)

    def split(x):
        return x.view(2, SEQ, HEADS, 8).permute(0, 2, 1, 3)

    q, k, v = split(layer.query(hidden)), split(layer.key(hidden)), split(layer.value(hidden))
    ref = scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :]).permute(0, 2, 1, 3)
    torch.testing.assert_close(out, ref.reshape(2, SEQ, 16), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="not a multiple"):
        Config.hidden_size = 15
        BertSparseSelfAttention(Config())


@pytest.mark.parametrize("name", ["bigbird_per_head", "fixed_uni_patterns"])
def test_the_flex_attention_block_mask_keeps_the_same_elements(name: str) -> None:
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    from shardwise.ops.sparse_attention.block_mask import layout_block_mask

    attn = SparseSelfAttention(CONFIGS[name], max_seq_length=SEQ)
    layout = attn.get_layout(SEQ)
    mask = layout_block_mask(layout, BLOCK, causal=attn.causal)
    assert torch.equal(mask.to_dense()[0].bool(), layout.bool())
    q, k, v = (t.detach() for t in _inputs())  # flex_attention has no CPU backward
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # eager flex_attention warns that it is unfused
        flex = flex_attention(q, k, v, block_mask=mask)
    torch.testing.assert_close(attn(q, k, v), flex, atol=1e-5, rtol=1e-5)
