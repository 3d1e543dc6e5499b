"""Rank-side bodies of test_sequence_parallel.py (module level so the harness can pickle them)."""

from __future__ import annotations

from typing import Any

import torch


def _fresh_layout(sp: int | None) -> Any:
    from shardwise.comm import groups, mesh

    mesh.reset_layout()
    groups.clear_topology()
    return None if sp is None else mesh.ensure_layout(sp=sp, source=f"test sp={sp}")


def exchange_case(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """DistributedAttention around SDPA against attention over the whole sequence on one rank."""
    import torch.nn.functional as F

    from shardwise.sequence.layer import DistributedAttention, _SeqAllToAll

    topo = _fresh_layout(world)
    group = topo.group_of("sp")
    heads, kv, batch_dim = case["heads"], case["kv"], case["batch_dim"]
    b, s, d = 2, 8, 4
    torch.manual_seed(0)
    shape = (b, s) if batch_dim == 0 else (s, b)
    q, k, v = (torch.randn(*shape, h, d, dtype=torch.float64) for h in (heads, kv, kv))
    seq_dim = 1 - batch_dim
    lo, hi = rank * s // world, (rank + 1) * s // world
    mine = [t.narrow(seq_dim, lo, hi - lo).clone().requires_grad_(True) for t in (q, k, v)]
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]

    def local(qq: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
        to_bhsd = (lambda t: t.permute(0, 2, 1, 3)) if batch_dim == 0 else (lambda t: t.permute(1, 2, 0, 3))
        group_size = qq.shape[2] // kk.shape[2]
        kk, vv = kk.repeat_interleave(group_size, dim=2), vv.repeat_interleave(group_size, dim=2)
        out = F.scaled_dot_product_attention(to_bhsd(qq), to_bhsd(kk), to_bhsd(vv), is_causal=True)
        return out.permute(0, 2, 1, 3) if batch_dim == 0 else out.permute(2, 0, 1, 3)

    attention = DistributedAttention(local, group)
    out = attention(*mine, batch_dim_idx=batch_dim)
    weights = torch.randn(*shape, heads, d, dtype=torch.float64)
    (out * weights.narrow(seq_dim, lo, hi - lo)).sum().backward()
    ref = local(*full)
    (ref * weights).sum().backward()
    errors = {"out": (out - ref.narrow(seq_dim, lo, hi - lo)).abs().max().item()}
    for name, t, f in zip("qkv", mine, full, strict=True):
        errors[f"d{name}"] = (t.grad - f.grad.narrow(seq_dim, lo, hi - lo)).abs().max().item()
    # DeepSpeed's own round trip: sequence -> heads -> sequence is the identity
    x = mine[0].detach()
    heads_sharded = _SeqAllToAll.apply(group, x, 2, seq_dim, batch_dim)
    back = _SeqAllToAll.apply(group, heads_sharded, seq_dim, 2, batch_dim)
    errors["round_trip"] = (back - x).abs().max().item()
    errors["heads_here"] = heads_sharded.shape[2]
    return errors


VOCAB, HIDDEN, HEADS, KV_HEADS, LAYERS, SEQ = 64, 32, 4, 2, 2, 32


def _tiny_llama(dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )
    torch.manual_seed(1234)
    return LlamaForCausalLM(config)


def _batches(steps: int, pad_to: int | None) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (1, SEQ), generator=generator)
        labels = ids.clone()
        if pad_to is not None:  # the last tokens are padding (not counted), as a collator pads
            labels[:, pad_to:] = -100
        out.append({"input_ids": ids, "position_ids": torch.arange(SEQ)[None], "labels": labels})
    return out


def _config(stage: int, bf16: bool, sp: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_allow_untested_optimizer": True,  # SGD is element-wise: exact on shards
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }
    if sp > 1:
        config["sequence_parallel_size"] = sp
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def parity_case(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train the same tokens with SP=1 (both ranks hold the whole sequence) and SP=2."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import shardwise
    from shardwise.compat.groups import _get_sequence_parallel_group, _get_sequence_parallel_rank
    from shardwise.sequence.data import UlyssesSPDataLoaderAdapter
    from shardwise.sequence.hf_attention import UlyssesSPAttentionHF
    from shardwise.sequence.loss import sequence_parallel_cross_entropy
    from shardwise.zero.param_access import safe_get_full_grad

    stage, bf16, steps = case["stage"], case["bf16"], case["steps"]
    batches = _batches(steps, case.get("pad_to"))
    dtype = torch.bfloat16 if bf16 else torch.float32
    watched = (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "lm_head.weight",
    )

    def grads(engine: Any) -> dict[str, torch.Tensor]:
        named = dict(engine.module.named_parameters())
        return {n: safe_get_full_grad(named[n]).float().clone() for n in watched}

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    results: dict[str, Any] = {}
    try:
        # SP=1: every rank trains on the whole sequence (dp=2 over identical data = the sequence's gradient)
        _fresh_layout(None)
        engine, *_ = shardwise.initialize(model=_tiny_llama(dtype), config=_config(stage, bf16, 1))
        losses, last = [], {}
        for i, batch in enumerate(batches):
            loss = engine(**batch).loss
            engine.backward(loss)
            if i == steps - 1:
                last = grads(engine)
            engine.step()
            losses.append(loss.item())
        results["sp1"] = {"losses": losses, "grads": last}
        engine.destroy()

        # SP=2: the same sequences, each rank a half (UlyssesSPDataLoaderAdapter over rank-identical loaders
        # yields every batch twice: once from each rank's loader; take every other one)
        _fresh_layout(None)
        model = _tiny_llama(dtype)
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model,
            core_attn_implementation="sdpa",
            sequence_parallel_size=world,
            micro_batch_size=1,
            seq_length=SEQ,
            seq_length_is_variable=True,
        )
        engine, *_ = shardwise.initialize(model=model, config=_config(stage, bf16, world), mpu=mpu)
        group = _get_sequence_parallel_group()
        loader = UlyssesSPDataLoaderAdapter(
            [dict(b) for b in batches], _get_sequence_parallel_rank(), group, world, torch.device("cpu")
        )
        losses, last = [], {}
        shards = [shard for i, shard in enumerate(loader) if i % world == 0]
        for i, shard in enumerate(shards):
            logits = engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
            loss = sequence_parallel_cross_entropy(logits, shard["shift_labels"], group)
            engine.backward(loss)
            if i == steps - 1:
                last = grads(engine)
            engine.step()
            losses.append(loss.item())
        results["sp2"] = {"losses": losses, "grads": last}
        results["sp2_sizes"] = (engine.sequence_parallel_size, engine.seq_dp_world_size, engine.dp_world_size)
        engine.destroy()
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original
        _fresh_layout(None)
    return results
