"""Per-rank scenarios for the pipeline tests (test_pipe_parity.py, test_pipe_engine.py): a TinyGPT
with tied embeddings trained unpipelined (the reference) and as a PipelineModule under each schedule,
eval_batch, checkpoints across stage counts, fp16 overflow agreement, pipeline x data parallelism.
Module level so the harness can pickle them."""

from __future__ import annotations

import copy
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

    net = PipelineModule(
        pm.gpt_layers(GPT), num_stages=stages, loss_fn=pm.gpt_loss, partition_method="uniform"
    )
    pm.state_from_gpt(net, initial_gpt_state(), GPT.n_layer)  # before initialize: ZeRO's masters copy these
    engine, *_ = shardwise.initialize(model=net, config=config(schedule, virtual_stages, **extra))
    if (
        virtual_stages > 1
    ):  # re-cut into chunks at initialize: new layers (fp32: the masters are the parameters)
        pm.state_from_gpt(engine.module, initial_gpt_state(), GPT.n_layer)
    return engine


def stage_weights(engine: Any) -> dict[str, torch.Tensor]:
    """This stage's parameters under TinyGPT's names (every tied copy, under its one name)."""
    return {
        pm.pipe_name_to_gpt(k, GPT.n_layer): v.detach().clone() for k, v in engine.module.named_parameters()
    }


def train(engine: Any, steps: int, first_step: int = 0) -> list[float]:
    """``train_batch`` for ``steps`` steps on this rank's data-parallel slice."""
    grid = engine.grid
    losses = []
    for step in range(first_step, first_step + steps):
        batches = [
            micro_batch(step, i, grid.data_parallel_id, grid.data_parallel_size) for i in range(MICRO_BATCHES)
        ]
        losses.append(float(engine.train_batch(iter(batches))))
    return losses


def pipelined(rank: int, world: int, case: tuple[str, int], steps: int) -> dict[str, Any]:
    """Train under one schedule; losses on every rank, this stage's weights, how many chunks it ran."""
    schedule, virtual = case
    engine = build_pipe(2, schedule, virtual)
    losses = train(engine, steps)
    return {"losses": losses, "weights": stage_weights(engine), "chunks": len(engine.executor.stages)}


def resume_save(rank: int, world: int, directory: str, stages: int) -> dict[str, Any]:
    """Train 3 steps on ``stages`` stages, save (engine checkpoint and per-layer files), train one more."""
    engine = build_pipe(stages)
    train(engine, 3)
    engine.save_checkpoint(directory, tag="step3")
    engine.module.save_state_dict(f"{directory}/layers")
    after = train(engine, 1, first_step=3)
    return {"next_loss": after[0], "weights": stage_weights(engine)}


def resume_load(rank: int, world: int, directory: str, stages: int) -> dict[str, Any]:
    """A fresh ``stages``-stage engine (other weights) loads the checkpoint and trains the next step;
    a second fresh module loads the per-layer files."""
    from shardwise.pipe import PipelineModule

    torch.manual_seed(1234 + rank)
    engine = build_pipe(stages)
    for p in engine.module.parameters():  # start far from the saved weights
        torch.nn.init.normal_(p.data, std=0.5)
    engine.load_checkpoint(directory, tag="step3")
    after = train(engine, 1, first_step=3)
    module = PipelineModule(
        pm.gpt_layers(GPT), num_stages=stages, loss_fn=pm.gpt_loss, partition_method="uniform"
    )
    module.load_state_dir(f"{directory}/layers")
    return {
        "next_loss": after[0],
        "weights": stage_weights(engine),
        "layer_files": {
            pm.pipe_name_to_gpt(k, GPT.n_layer): v.detach().clone() for k, v in module.named_parameters()
        },
    }


def overflow_agreement(rank: int, world: int) -> dict[str, Any]:
    """fp16 with an infinite gradient on the last stage only, at the second step: every stage skips it
    and halves its loss scale; the first stage's weights do not move at that step."""
    engine = build_pipe(
        2, fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000, "hysteresis": 1}
    )
    train(engine, 1)
    last = list(engine.module.parameters())[-1]
    handle = None
    if engine.is_last_stage():
        handle = last.register_hook(lambda g: g * float("inf"))
    before = {k: v.clone() for k, v in stage_weights(engine).items()}
    train(engine, 1, first_step=1)
    if handle is not None:
        handle.remove()
    unchanged = all((before[k] == v).all().item() for k, v in stage_weights(engine).items())
    train(engine, 1, first_step=2)
    return {
        "skipped": engine.skipped_steps,
        "scale": engine.loss_scale,
        "unchanged": unchanged,
        "steps": engine.global_steps,
    }


def refusals(rank: int, world: int) -> list[str]:
    """Config keys refused by name, and the unpipelined entry points."""
    from shardwise.config import ConfigError

    messages = []
    refused = (
        {"zero_optimization": {"stage": 2}},
        {"pipeline": {"schedule": "interleaved_1f1b"}},
        {"managed_gradient_accumulation": False},
    )
    for extra in refused:
        from shardwise.pipe import PipelineModule

        net = PipelineModule(pm.gpt_layers(GPT), num_stages=2, loss_fn=pm.gpt_loss)
        try:
            shardwise.initialize(model=net, config={**config(), **extra})
        except ConfigError as exc:
            messages.append(str(exc))
    engine = build_pipe(2)
    try:
        engine(torch.zeros(1))
    except RuntimeError as exc:
        messages.append(str(exc))
    return messages


def eval_sequential(rank: int, world: int) -> dict[str, Any]:
    """DeepSpeed's test_pipe_module check (skipped on CPU there): eval_batch of an nn.Sequential cut in
    two equals the whole model's output, on both stages; with a loss_fn it returns the mean loss."""
    from torch import nn

    from shardwise.data import RepeatingLoader
    from shardwise.pipe import PipelineModule

    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)], nn.Linear(32, 1))
    x = torch.randn(1, 32)
    expected = base(x).detach()
    pipe = PipelineModule(layers=copy.deepcopy(base), num_stages=2)
    cfg = {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
    }
    engine, *_ = shardwise.initialize(config=cfg, model=pipe, model_parameters=list(pipe.parameters()))
    out = engine.eval_batch(iter(RepeatingLoader([(x, 0)])))
    loss_pipe = PipelineModule(
        layers=copy.deepcopy(base), num_stages=2, loss_fn=lambda o, y: ((o - y) ** 2).mean()
    )
    engine2, *_ = shardwise.initialize(
        config=cfg, model=loss_pipe, model_parameters=list(loss_pipe.parameters())
    )
    y = torch.randn(1, 1)
    loss, logits = engine2.eval_batch(iter(RepeatingLoader([(x, y)])), return_logits=True)
    # initialize(training_data=...): train_batch() with no iterator reads the engine's own loader
    gen = torch.Generator().manual_seed(
        3
    )  # the same samples on both stages (inputs on one, labels on the other)
    data = [(torch.randn(32, generator=gen), torch.randn(1, generator=gen)) for _ in range(8)]
    third = PipelineModule(
        layers=copy.deepcopy(base), num_stages=2, loss_fn=lambda o, y: ((o - y) ** 2).mean()
    )
    engine3, *_ = shardwise.initialize(
        config=cfg, model=third, model_parameters=list(third.parameters()), training_data=data
    )
    from_loader = [float(engine3.train_batch()) for _ in range(3)]
    return {
        "from_loader": from_loader,
        "out": out,
        "expected": expected,
        "loss": loss,
        "expected_loss": ((expected - y) ** 2).mean(),
        "logits": logits,
        "first": engine.is_first_stage(),
        "last": engine.is_last_stage(),
    }


def pipe_data_parallel(rank: int, world: int, steps: int) -> dict[str, Any]:
    """2 stages x 2 data-parallel ranks, ZeRO stage 1."""
    engine = build_pipe(2, zero_optimization={"stage": 1})
    assert engine.grid.data_parallel_size == 2 and engine.dp_world_size == 2
    losses = train(engine, steps)
    return {"losses": losses, "weights": stage_weights(engine), "dp": engine.grid.data_parallel_id}


def bf16_pipelined(rank: int, world: int, steps: int) -> list[float]:
    """bf16 (fp32 masters and gradient accumulation) on 2 stages."""
    return train(build_pipe(2, bf16={"enabled": True}), steps)
