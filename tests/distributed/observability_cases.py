"""Per-rank scenarios for test_observability.py (module level so the harness can pickle them).

Each scenario trains a small Linear model on 2 gloo ranks and returns what the engine
computed plus what this rank printed to stderr (captured at the file-descriptor level,
so everything the process wrote counts, not only the library's logger).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import shardwise
from shardwise.utils.logging import set_log_level

IN, HIDDEN, OUT = 8, 16, 4


@contextlib.contextmanager
def captured_stderr() -> Iterator[dict[str, str]]:
    """Everything written to fd 2 inside the block ends up in ``out["text"]``."""
    sys.stderr.flush()
    saved = os.dup(2)
    out: dict[str, str] = {}
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out["text"] = tmp.read().decode(errors="replace")


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def _batch(step: int, micro: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(size, IN, generator=gen), torch.randn(size, OUT, generator=gen)


def _config(**extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2},
    }
    cfg.update(extra)
    return cfg


def _train(engine: Any, rank: int, steps: int) -> list[dict[str, Any]]:
    """Train ``steps`` optimizer steps; per step, what the engine computed."""
    record = []
    gas = engine.gradient_accumulation_steps()
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(steps):
        window: torch.Tensor | None = None
        for m in range(gas):
            x, y = _batch(step, m, rank, micro)
            out = engine(x)
            loss = nn.functional.mse_loss(out.float(), y)
            returned = engine.backward(loss)
            # the same float32 additions as the engine's window sum
            value = returned.detach().float()
            window = value if window is None else window + value
            engine.step()
        assert window is not None
        record.append(
            {
                "window_loss": float(window),
                "samples": engine.global_samples,
                "lr": engine.get_lr()[0],
                "loss_scale": engine.loss_scale,
                "grad_norm": engine.get_global_grad_norm(),
                "grad_norm_post_clip": engine.get_global_grad_norm_post_clip(),
                "applied": engine.was_step_applied(),
            }
        )
    return record


def monitors_and_progress(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """fp16 ZeRO-2 with TensorBoard, CSV and offline W&B, progress lines and wall-clock timers."""
    torch.set_num_threads(1)
    os.environ.update({"WANDB_MODE": "offline", "WANDB_DIR": tmp, "WANDB_SILENT": "true"})
    cfg = _config(
        steps_per_print=2,
        wall_clock_breakdown=True,
        gradient_clipping=0.05,
        fp16={"enabled": True, "initial_scale_power": 8, "auto_cast": True},
        tensorboard={"enabled": True, "output_path": f"{tmp}/tb", "job_name": "job"},
        csv_monitor={"enabled": True, "output_path": f"{tmp}/csv", "job_name": "job"},
        wandb={"enabled": True, "project": "shardwise-test", "group": "obs"},
    )
    with captured_stderr() as err:
        engine, *_ = shardwise.initialize(model=_model(), config=cfg)
        record = _train(engine, rank, steps=4)
        engine.monitor.write_events([("Custom/answer", 42.0, engine.global_samples)])
        timers = engine.get_wall_clock_timers()
        writes = engine.monitor.writes
        engine.monitor.close()
        if rank == 0:
            import wandb

            wandb.teardown()  # wandb-core writes the offline file out completely when its service stops
    return {"record": record, "stderr": err["text"], "timers": timers, "writes": writes}


def comms_summary(rank: int, world: int) -> dict[str, Any]:
    """ZeRO-2 fp32 with the comms logger: what initialize and one optimizer step send."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # 10*6 + 6 + 6*3 + 3 = 87 elements; reduce_bucket_size 70 splits them into two buckets
    model = nn.Sequential(nn.Linear(10, 6), nn.Linear(6, 3))
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 70},
        "comms_logger": {"enabled": True},
    }
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    with captured_stderr():
        at_init = shardwise.comm.log_summary(return_dict=True)["summary"]
    shardwise.comm.reset_log()
    for micro in range(2):
        x = torch.randn(2, 10, generator=torch.Generator().manual_seed(10 * micro + rank))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    with captured_stderr() as err:
        step = shardwise.comm.log_summary(show_straggler=True, return_dict=True)
    count = shardwise.comm.get_comm_operation_count()
    shardwise.comm.configure(enabled=False)
    return {"init": at_init, "step": step, "stderr": err["text"], "count": count}


def flops_profile_in_training(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """The flops profiler at profile_step 1 (GAS 2, micro batch 2), written to a file by rank 0."""
    torch.set_num_threads(1)
    path = f"{tmp}/flops.txt"
    cfg = _config(
        gradient_clipping=0.0,
        flops_profiler={"enabled": True, "profile_step": 1, "module_depth": -1, "output_file": path},
    )
    model = _model()
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    _train(engine, rank, steps=3)
    hooks_left = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    text = None
    if rank == 0 and os.path.exists(path):
        with open(path) as handle:
            text = handle.read()
    return {"text": text, "hooks_left": hooks_left, "timers": engine.get_wall_clock_timers()}


def quiet_by_default(rank: int, world: int) -> dict[str, Any]:
    """What a default run prints at start-up and over two steps, and the same at log_level info."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name, extra in (
        ("default", {}),
        ("info", {"log_level": "info"}),
        ("memory", {"memory_breakdown": True}),
    ):
        with captured_stderr() as err:
            engine, *_ = shardwise.initialize(model=_model(), config=_config(**extra))
            _train(engine, rank, steps=2)
        out[name] = err["text"]
        set_log_level("warning")
    out["state_bytes"] = engine.optimizer.model_state_bytes()
    return out


SCENARIOS = {
    "monitors": monitors_and_progress,
    "comms": comms_summary,
    "flops": flops_profile_in_training,
    "quiet": quiet_by_default,
}


def run_scenario(rank: int, world: int, case: str, tmp: str) -> Any:
    """Dispatch one named scenario (all share one spawn)."""
    fn = SCENARIOS[case]
    return fn(rank, world) if case in ("comms", "quiet") else fn(rank, world, tmp)
