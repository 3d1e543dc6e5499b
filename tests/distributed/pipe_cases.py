"""Per-rank scenarios for the pipeline tests (test_pipe_parity.py, test_pipe_engine.py): a TinyGPT
with tied embeddings trained unpipelined (the reference) and as a PipelineModule under each schedule,
eval_batch, checkpoints across stage counts, fp16 overflow agreement, pipeline x data parallelism.
Module level so the harness can pickle them."""

from __future__ import annotations

from typing import Any

import torch

import shardwise
from shardwise.testing import pipe_models as pm
from shardwise.testing.models import GPTConfig, TinyGPT, TokenDataset

GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, qkv_bias=False)
MICRO_BATCHES = 4
MICRO = 2  # samples per micro batch


def config(schedule: str = "1f1b", virtual_stages: int = 1, **extra: Any) -> dict[str, Any]:
    """The run's ds_config: 4 micro batches of 2, AdamW, clipping (so the norm spans the stages)."""
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": MICRO_BATCHES,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "pipeline": {"schedule": schedule, "virtual_stages": virtual_stages},
        **extra,
    }


def micro_batch(step: int, index: int, dp_rank: int = 0, dp: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro batch ``index`` of ``step`` for data-parallel rank ``dp_rank`` (same on every stage)."""
    data = TokenDataset(512, GPT.block_size, GPT.vocab_size, seed=1)
    first = ((step * dp + dp_rank) * MICRO_BATCHES + index) * MICRO
    rows = [data[(first + j) % len(data)] for j in range(MICRO)]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def initial_gpt_state() -> dict[str, torch.Tensor]:
    """The starting weights every run shares."""
    torch.manual_seed(0)
    return {k: v.clone() for k, v in TinyGPT(GPT).state_dict().items()}


def reference(rank: int, world: int, steps: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """TinyGPT on ``world`` data-parallel ranks without pipelining: per-step mean losses, final weights."""
    model = TinyGPT(GPT)
    model.load_state_dict(initial_gpt_state())
    engine, *_ = shardwise.initialize(model=model, config=config(**(extra or {})))
    losses = []
    for step in range(steps):
        total = torch.zeros(())
        for i in range(MICRO_BATCHES):
            x, y = micro_batch(step, i, rank, world)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append(float(total) / MICRO_BATCHES / world)
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.named_parameters()}}


def build_pipe(stages: int, schedule: str = "1f1b", virtual_stages: int = 1, **extra: Any) -> Any:
    """A pipelined TinyGPT engine starting from :func:`initial_gpt_state`."""
    from shardwise.pipe import PipelineModule

    net = PipelineModule(pm.gpt_layers(GPT), num_stages=stages, loss_fn=pm.gpt_loss, partition_method="uniform")
    engine, *_ = shardwise.initialize(model=net, config=config(schedule, virtual_stages, **extra))
    pm.state_from_gpt(engine.module, initial_gpt_state(), GPT.n_layer)
    return engine


def stage_weights(engine: Any) -> dict[str, torch.Tensor]:
    """This stage's parameters under TinyGPT's names (every tied copy, under its one name)."""
    return {pm.pipe_name_to_gpt(k, GPT.n_layer): v.detach().clone() for k, v in engine.module.named_parameters()}


def train(engine: Any, steps: int, first_step: int = 0) -> list[float]:
    """``train_batch`` for ``steps`` steps on this rank's data-parallel slice."""
    grid = engine.grid
    losses = []
    for step in range(first_step, first_step + steps):
        batches = [micro_batch(step, i, grid.data_parallel_id, grid.data_parallel_size) for i in range(MICRO_BATCHES)]
        losses.append(float(engine.train_batch(iter(batches))))
    return losses


def pipelined(rank: int, world: int, case: tuple[str, int], steps: int) -> dict[str, Any]:
    """Train under one schedule; losses on every rank, this stage's weights, how many chunks it ran."""
    schedule, virtual = case
    engine = build_pipe(2, schedule, virtual)
    losses = train(engine, steps)
    return {"losses": losses, "weights": stage_weights(engine), "chunks": len(engine.executor.stages)}
