"""Train a tiny GPT with a DeepSpeed config: the README's demo.

A DeepSpeed script with the import changed: run it under any launcher, e.g.

    python -m torch.distributed.run --nproc_per_node 2 examples/train_gpt.py \
        --deepspeed_config examples/configs/zero2_bf16.json

The data is synthetic but learnable (arithmetic progressions modulo the vocabulary),
so the loss visibly falls from ln(vocab) within a few dozen steps.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import shardwise as deepspeed
from shardwise.testing.models import GPTConfig, TinyGPT
from shardwise.utils.logging import get_logger


class ProgressionDataset(torch.utils.data.Dataset):
    """Sequences ``start, start+d, start+2d, ... (mod vocab)`` with random start and d."""

    def __init__(self, num_samples: int, block_size: int, vocab_size: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab_size, (num_samples, 1), generator=gen)
        step = torch.randint(1, 8, (num_samples, 1), generator=gen)
        self.data = (start + step * torch.arange(block_size + 1)) % vocab_size

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by DeepSpeed-style launchers")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps to run")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=128))
    data = ProgressionDataset(4096, 32, 128)
    start = time.perf_counter()
    engine, _, loader, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=data
    )
    rank0 = engine.global_rank == 0
    if rank0:
        params = sum(p.numel() for p in model.parameters())
        print(
            f"{params / 1e6:.2f}M params | {engine.dp_world_size} ranks | ZeRO stage {engine.zero_optimization_stage()}"
            f" | {engine.precision.name} | batch {engine.train_batch_size()} = {engine.train_micro_batch_size_per_gpu()}"
            f" x {engine.gradient_accumulation_steps()} x {engine.dp_world_size} | ready in "
            f"{time.perf_counter() - start:.1f}s"
        )
    interactive = sys.stderr.isatty()
    # with "steps_per_print" the engine logs a progress line itself; print our own only without it
    engine_prints = bool(engine.config.config.steps_per_print)
    bar = tqdm(total=args.steps, disable=not (rank0 and interactive), desc="train", unit="step")
    first = last = None
    batches = deepspeed.RepeatingLoader(loader)
    # the engine's log lines go through tqdm.write, so they do not tear the bar
    with logging_redirect_tqdm(loggers=[get_logger()]):
        for x, y in batches:
            x, y = x.to(engine.device), y.to(engine.device)  # as DeepSpeed scripts do: the engine moves no inputs
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            if engine.micro_steps % engine.gradient_accumulation_steps() == 0:  # an optimizer step ended
                value = loss.item()
                first = value if first is None else first
                last = value
                stats = engine.telemetry.last_stats  # what the engine reported for this step
                postfix = {
                    "loss": f"{value:.3f}",
                    "lr": f"{engine.get_lr()[0]:.2e}",
                    "gnorm": f"{engine.get_global_grad_norm():.2f}",
                    "clipped": f"{engine.get_global_grad_norm_post_clip() or 0.0:.2f}",
                }
                if stats is not None and stats.samples_per_sec is not None:
                    postfix["samples/s"] = f"{stats.samples_per_sec:.0f}"
                bar.set_postfix(postfix)
                bar.update(1)
                if rank0 and not interactive and not engine_prints and engine.global_steps % 5 == 0:
                    print(
                        f"step {engine.global_steps:4d}  loss {value:.3f}  lr {engine.get_lr()[0]:.2e}  "
                        f"grad_norm_pre_clip {engine.get_global_grad_norm():.3f}  "
                        f"grad_norm_post_clip {engine.get_global_grad_norm_post_clip() or 0.0:.3f}",
                        flush=True,
                    )
            if engine.global_steps >= args.steps:
                break
    bar.close()
    if rank0:
        print(
            f"loss {first:.3f} -> {last:.3f} after {engine.global_steps} steps "
            f"({engine.skipped_steps} skipped), final grad norm {engine.get_global_grad_norm():.3f}"
        )


if __name__ == "__main__":
    main()
