"""Per-rank scenarios for test_activation_checkpointing.py (module level so the harness can pickle them).

Each engine case trains the same dropout-on TinyGPT twice on the same batches, once plainly and
once with a checkpoint per block, and returns both runs' losses and final local parameters; the
test compares them bit for bit. The model-parallel cases make both ranks one model-parallel
group (as tensor-parallel ranks, they hold the same activations) through a small mpu.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from zero_reference import batch, config

import shardwise
from shardwise import checkpointing
from shardwise import comm as sw_comm
from shardwise.testing.models import GPTConfig, TinyGPT
from shardwise.utils.logging import get_logger

DROPOUT_GPT = GPTConfig(
    vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.2, qkv_bias=False
)
STEPS = 3


class ModelParallelPair:
    """An mpu where the whole world is one model-parallel group and each rank its own data-parallel group."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        singles = [sw_comm.new_group([r]) for r in range(world)]  # every rank creates every group
        self.dp_group = singles[rank]
        self.mp_group = sw_comm.new_group(list(range(world)))

    def get_model_parallel_group(self) -> Any:
        return self.mp_group

    def get_model_parallel_rank(self) -> int:
        return self.rank

    def get_model_parallel_world_size(self) -> int:
        return self.world

    def get_data_parallel_group(self) -> Any:
        return self.dp_group

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_world_size(self) -> int:
        return 1


class _Infos(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _model(mode: str | None, frozen: bool) -> tuple[TinyGPT, list[int]]:
    """The model (same init on every rank), with ``mode`` checkpointing; and a block-forward counter."""
    torch.manual_seed(0)
    model = TinyGPT(DROPOUT_GPT)
    if frozen:  # LoRA-style: embeddings (and the tied head) frozen, so no block input requires grad
        model.wte.requires_grad_(False)
        model.wpe.requires_grad_(False)
    if mode is not None:
        model.checkpoint_fn = (
            checkpointing.checkpoint if mode == "reentrant" else checkpointing.non_reentrant_checkpoint
        )
    calls = [0]
    for block in model.blocks:
        block.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return model, calls


def _local(engine: Any) -> list[torch.Tensor]:
    out = []
    for p in engine.module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out.append(local.detach().float().clone())
    return out


def _train(case: dict[str, Any], mode: str | None, rank: int, world: int, mpu: Any) -> dict[str, Any]:
    dp_world = 1 if mpu is not None else world
    cfg = config(case["stage"], case["precision"], gas=case["gas"], micro_batch=2, world=dp_world)
    cfg["zero_optimization"].pop("reduce_bucket_size")
    if case["stage"] == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 100
    if mode is not None:
        cfg["activation_checkpointing"] = dict(case.get("section", {}))
        if case.get("num_checkpoints"):  # Megatron-LM: the slot count from configure, before initialize
            checkpointing.configure(mpu, deepspeed_config=cfg, num_checkpoints=case["num_checkpoints"])
    model, calls = _model(mode, case.get("frozen", False))
    params = [p for p in model.parameters() if p.requires_grad]
    handler = _Infos()
    get_logger().addHandler(handler)
    try:
        engine, *_ = shardwise.initialize(model=model, model_parameters=params, config=cfg, mpu=mpu)
        torch.manual_seed(1234 + (0 if mpu is not None else rank))  # dropout masks differ per dp rank
        data_rank = 0 if mpu is not None else rank
        losses, peaks = [], []
        for step in range(STEPS):
            for micro in range(case["gas"]):
                x, y = batch(step, micro, data_rank, 2)
                x, y = x.to(engine.device), y.to(engine.device)  # (the GPU tests run these cases too)
                with checkpointing.SavedActivationMeter(exclude=engine.module.parameters()) as meter:
                    loss = engine(x, y)
                    peaks.append(meter.peak_bytes)
                    engine.backward(loss)
                losses.append(loss.item())
                engine.step()
        timers = engine.get_wall_clock_timers()
    finally:
        get_logger().removeHandler(handler)
    return {
        "losses": losses,
        "params": _local(engine),
        "calls": calls[0],
        "peak": max(peaks),
        "timers": timers,
        "logged": [m for m in handler.messages if m.startswith("activation checkpointing")],
        "rng_after": torch.rand(1).item(),
        # the dropout masks' generator on a GPU (the CPU's again on the CPU: then equal by the line above)
        "device_rng_after": torch.rand(1, device=engine.device).item(),
    }


def engine_case(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Plain vs checkpointed training through initialize; with ``case['mpu']`` on one mp group."""
    torch.set_num_threads(1)
    mpu = ModelParallelPair(rank, world) if case.get("mpu") else None
    checkpointing.configure(None)  # a fresh start for every case (module state is per process)
    plain = _train(case, None, rank, world, mpu)
    ckpt = _train(case, case["mode"], rank, world, mpu)
    result = {
        "losses_equal": plain["losses"] == ckpt["losses"],
        "params_equal": all(torch.equal(a, b) for a, b in zip(plain["params"], ckpt["params"], strict=True)),
        "rng_equal": plain["rng_after"] == ckpt["rng_after"],
        "device_rng_equal": plain["device_rng_after"] == ckpt["device_rng_after"],
        "calls": (plain["calls"], ckpt["calls"]),
        "peaks": (plain["peak"], ckpt["peak"]),
        "timers": ckpt["timers"],
        "logged": ckpt["logged"],
        "losses": ckpt["losses"],
    }
    checkpointing.configure(None)
    return result


def partition_case(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """configure(mpu, partition_activations=...) without an engine: bytes stored per rank, gradients."""
    torch.set_num_threads(1)
    mpu = ModelParallelPair(rank, world)

    def run(settings: dict[str, Any] | None) -> tuple[float, list[torch.Tensor], int, int]:
        checkpointing.configure(mpu, **(settings or {}))
        model, _ = _model(None if settings is None else case["mode"], False)
        torch.manual_seed(7)  # the same dropout masks on both ranks (tensor-parallel replicas)
        x, y = batch(0, 0, 0, 2)
        with checkpointing.SavedActivationMeter(exclude=model.parameters()) as meter:
            loss = model(x, y)
            held = meter.current_bytes
            loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()], held, meter.current_bytes

    plain = run(None)
    kept = run({})  # checkpointing, inputs kept whole
    split = run(case["settings"])
    checkpointing.configure(None)
    return {
        "loss_equal": plain[0] == kept[0] == split[0],
        "grads_equal": all(
            torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(plain[1], kept[1], split[1])
        ),
        "held": (plain[2], kept[2], split[2]),
        "after_backward": split[3],
        "input_bytes": 2 * DROPOUT_GPT.block_size * DROPOUT_GPT.n_embd * 4,
    }


def run_case(rank: int, world: int, case: dict[str, Any]) -> Any:
    """Dispatch one case (all share one spawn)."""
    if case["kind"] == "partition":
        return partition_case(rank, world, case)
    return engine_case(rank, world, case)
