"""A tiny training script for tests/integration/test_autotuning.py: a two-layer MLP on random data.

``--steps`` optimizer steps (an autotuning experiment ends itself earlier); ``--batch_size``
(set through ``arg_mappings``) is written to ``--record`` with the config's micro batch, so a
test can check the mapping; after training, rank 0 appends ``trained <stage> <micro>`` to it.
"""

from __future__ import annotations

import argparse

import torch

import shardwise as deepspeed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=0)
    parser.add_argument("--record", default="")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    data = torch.utils.data.TensorDataset(torch.randn(512, 16), torch.randn(512, 4))
    engine, _, loader, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=data
    )
    micro = engine.train_micro_batch_size_per_gpu()
    if args.record and engine.global_rank == 0:
        with open(args.record, "a", encoding="utf-8") as handle:
            handle.write(f"batch_size {args.batch_size} micro {micro}\n")
    for x, y in deepspeed.RepeatingLoader(loader):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        if engine.global_steps >= args.steps:
            break
    if args.record and engine.global_rank == 0:
        with open(args.record, "a", encoding="utf-8") as handle:
            handle.write(f"trained {engine.zero_optimization_stage()} {micro}\n")


if __name__ == "__main__":
    main()
