"""Scenarios for test_nvme_streaming.py: a model whose state is larger than a memory cap, trained
with parameters and optimizer state on NVMe (``zero.Init(remote_device="nvme")``, stage 3)."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

import shardwise
from shardwise.testing.models import GPTConfig, TinyGPT

SHAPE = GPTConfig(vocab_size=4096, block_size=16, n_layer=20, n_head=8, n_embd=640, dropout=0.0)
BYTES_PER_PARAM = 16  # DeepSpeed's model-state accounting: 16-bit param and grad, fp32 master, Adam m, v


def _fixed_malloc_threshold() -> None:
    """Large blocks straight from mmap (glibc's default moves the threshold up as blocks are freed,
    keeping freed memory in the heap): the peak then measures what the run holds, not the heap's history."""
    m_mmap_threshold = -3
    ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 1 << 20)


def _rss_mib() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    return out


def _config(nvme: str | None, world: int) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_live_parameters": 0,
        "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 0,
        "sub_group_size": 1_000_000,
    }
    if nvme is not None:
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 2}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 2}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
        "steps_per_print": 10_000,
    }


def train(rank: int, world: int, nvme: str | None, steps: int = 2) -> dict[str, Any]:
    """Build the model (under ``zero.Init``, in files with ``nvme``), train, report memory and numbers."""
    torch.set_num_threads(1)
    _fixed_malloc_threshold()
    cfg = _config(nvme, world)
    torch.manual_seed(0)
    tokens = torch.randint(0, SHAPE.vocab_size, (steps, 2, 1, SHAPE.block_size))
    base = _rss_mib()["VmRSS"]
    with shardwise.zero.Init(remote_device="nvme" if nvme else None, config_dict_or_path=cfg):
        model = TinyGPT(SHAPE)
    numel = sum(p.numel() for p in model.parameters())
    built = _rss_mib()["VmHWM"] - base
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = []
    for step in range(steps):
        loss = engine(tokens[step, 0], tokens[step, 1])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    peak = _rss_mib()["VmHWM"] - base
    params = [p.detach().full_tensor().clone() for p in engine.module.parameters()]
    engine.destroy()
    return {
        "losses": losses,
        "state_mib": BYTES_PER_PARAM * numel / world / 2**20,
        "peak_mib": peak,
        "built_mib": built,
        "checksum": float(sum(p.double().sum() for p in params)),
        "params": params,
    }
