"""Per-rank scenarios for test_tensor_parallel.py (module level so the harness can pickle them)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import shardwise
from shardwise.comm import mesh
from shardwise.tensor_parallel.gather import GatherReplacedLayerParams
from shardwise.tensor_parallel.layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    TPGroup,
)

VOCAB, SEQ, MICRO = 64, 8, 2


def tiny_llama() -> nn.Module:
    """A random 2-layer Llama (4 heads, 2 key-value heads), built from a config: nothing downloaded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def batches(steps: int) -> list[torch.Tensor]:
    """The same token batches on every rank (each data-parallel rank trains on the same tokens)."""
    generator = torch.Generator().manual_seed(1)
    distinct = [torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator) for _ in range(4)]
    return [distinct[step % 4] for step in range(steps)]


def llama_config(tp: int, stage: int, **extra: Any) -> dict[str, Any]:
    """The ds_config of the parity runs: clipping at 0.5 (so the whole model's norm matters)."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.5,
        "zero_allow_untested_optimizer": True,  # SGD is elementwise: exact on flat shards
        "zero_optimization": {"stage": stage},
    }
    if stage == 3:  # shard every weight (the tiny model's are below the default persistence threshold)
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    config.update(extra)
    return config


def split_weight_bytes(model: nn.Module) -> int:
    """Bytes this rank holds for the weights of the split linear layers (stage 3: its local shards)."""
    from shardwise.comm.fsdp_internals import is_dtensor, local_tensor

    total = 0
    for name, param in model.named_parameters():
        if name.endswith("_proj.weight"):
            tensor = local_tensor(param) if is_dtensor(param) else param
            total += tensor.numel() * tensor.element_size()
    return total


def llama_losses(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train the tiny Llama ``case["steps"]`` steps at ``case["tp"]`` / ``case["stage"]``; the losses."""
    torch.set_num_threads(1)
    mesh.reset_layout()
    model = tiny_llama()
    # SGD with momentum, built on the whole model (initialize re-points it at the slices). Not Adam:
    # its m / sqrt(v) turns a rounding-level difference in a near-zero gradient into a full step.
    sgd = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    engine, _, _, _ = shardwise.initialize(model=model, optimizer=sgd,
                                           config=llama_config(case["tp"], case["stage"]))
    losses = []
    for tokens in batches(case["steps"]):
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    kinds = sorted({type(m).__name__ for m in engine.module.modules() if "Parallel" in type(m).__name__})
    out = {"losses": losses, "bytes": split_weight_bytes(engine.module), "kinds": kinds,
           "tp": shardwise.comm.groups.get_tensor_model_parallel_world_size(),
           "dp": shardwise.comm.groups.get_data_parallel_world_size()}
    mesh.reset_layout()
    return out


def layers_match_whole_ones(rank: int, world: int, case: dict[str, Any]) -> dict[str, float]:
    """Column (with and without a gathered output), row (local and whole input) and embedding layers
    over the world group against whole layers: outputs and input/weight gradients."""
    torch.set_num_threads(1)
    torch.manual_seed(3)
    tp = TPGroup(None, rank, world)
    x = torch.randn(3, 10)
    whole_col, whole_row = nn.Linear(10, 6), nn.Linear(6, 4)
    whole_emb = nn.Embedding(9, 5)
    errors: dict[str, float] = {}

    x1 = x.clone().requires_grad_()
    ref = whole_row(torch.relu(whole_col(x1)))
    ref.square().sum().backward()
    col = ColumnParallelLinear(whole_col, tp)
    row = RowParallelLinear(whole_row, tp)
    x2 = x.clone().requires_grad_()
    out = row(torch.relu(col(x2)))
    out.square().sum().backward()
    errors["column-row output"] = (out - ref).abs().max().item()
    errors["input grad"] = (x2.grad - x1.grad).abs().max().item()
    errors["column weight grad"] = (col.weight.grad - col.splits["weight"].local(whole_col.weight.grad, rank)).abs().max().item()
    errors["row weight grad"] = (row.weight.grad - row.splits["weight"].local(whole_row.weight.grad, rank)).abs().max().item()
    errors["row bias grad"] = (row.bias.grad - whole_row.bias.grad).abs().max().item()

    whole_gather = nn.Linear(10, 7)  # uneven: 4 + 3
    x3, x4 = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = whole_gather(x3)
    ref.square().sum().backward()
    gathered = ColumnParallelLinear(whole_gather, tp, gather_output=True)
    out = gathered(x4)
    out.square().sum().backward()
    errors["gathered output"] = (out - ref).abs().max().item()
    errors["gathered input grad"] = (x4.grad - x3.grad).abs().max().item()

    # GatherReplacedLayerParams: whole weights inside (uneven split included), slices after, an edit kept;
    # the row-parallel bias (replicated) is left alone
    holder = nn.ModuleList([col, row, gathered])
    params = [col.weight, col.bias, row.weight, row.bias, gathered.weight]
    with GatherReplacedLayerParams(params, holder):
        errors["gather column weight"] = (col.weight - whole_col.weight).abs().max().item()
        errors["gather column bias"] = (col.bias - whole_col.bias).abs().max().item()
        errors["gather row weight"] = (row.weight - whole_row.weight).abs().max().item()
        errors["gather uneven weight"] = (gathered.weight - whole_gather.weight).abs().max().item()
        errors["gather row bias untouched"] = float(row.bias.shape != whole_row.bias.shape)
        with torch.no_grad():
            gathered.weight.mul_(2.0)
    errors["gather sliced after"] = (col.weight - col.splits["weight"].local(whole_col.weight, rank)).abs().max().item()
    edited = gathered.splits["weight"].local(whole_gather.weight * 2.0, rank)
    errors["gather edit kept"] = (gathered.weight - edited).abs().max().item()

    x5, x6 = x[:, :6].clone().requires_grad_(), x[:, :6].clone().requires_grad_()
    whole_row.zero_grad()
    ref = whole_row(x5)
    ref.square().sum().backward()
    replicated_in = RowParallelLinear(whole_row, tp)
    out = replicated_in(x6)  # a whole input: sliced inside
    out.square().sum().backward()
    errors["row on whole input"] = (out - ref).abs().max().item()
    errors["row whole input grad"] = (x6.grad - x5.grad).abs().max().item()

    ids = torch.tensor([[0, 4, 8], [3, 3, 7]])
    ref = whole_emb(ids)
    ref.square().sum().backward()
    for dim in (0, 1):
        emb = ParallelEmbedding(whole_emb, tp, dim=dim)
        out = emb(ids)
        out.square().sum().backward()
        errors[f"embedding dim {dim}"] = (out - ref).abs().max().item()
        local_ref = emb.splits["weight"].local(whole_emb.weight.grad, rank)
        errors[f"embedding dim {dim} grad"] = (emb.weight.grad - local_ref).abs().max().item()
    return errors


def _engine(tp: int, stage: int) -> Any:
    mesh.reset_layout()
    model = tiny_llama()
    sgd = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    engine, _, _, _ = shardwise.initialize(model=model, optimizer=sgd, config=llama_config(tp, stage))
    return engine


def _train(engine: Any, tokens: list[torch.Tensor]) -> list[float]:
    losses = []
    for batch in tokens:
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def resume_at_other_degree(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train 6 steps at ``case["save_tp"]``, save; the next 2 steps' losses there and, from the
    checkpoint, at ``case["load_tp"]`` (a new engine on a new layout)."""
    torch.set_num_threads(1)
    tokens = batches(8)
    saver = _engine(case["save_tp"], case["stage"])
    _train(saver, tokens[:6])
    saver.save_checkpoint(case["dir"], tag="t")
    continued = _train(saver, tokens[6:])
    loader = _engine(case["load_tp"], case["stage"])
    loader.load_checkpoint(case["dir"], tag="t")
    resumed = _train(loader, tokens[6:])
    mesh.reset_layout()
    return {"continued": continued, "resumed": resumed}


def different_batches_are_refused(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """TP=2: the first forward with a different batch on each TP rank fails on both, naming the cause;
    a fresh engine given the same batch trains."""
    torch.set_num_threads(1)
    engine = _engine(2, 0)
    tokens = batches(1)[0]
    try:
        engine(input_ids=tokens + rank, labels=tokens)
        refused = None
    except AssertionError as error:
        refused = str(error)
    same = _train(_engine(2, 0), [tokens])
    mesh.reset_layout()
    return {"refused": refused, "same": same}
