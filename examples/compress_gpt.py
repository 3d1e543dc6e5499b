"""Compress the demo GPT with ``compression_training``: 8-bit then 4-bit weights, 50 % row pruning.

    python examples/compress_gpt.py --out /tmp/compressed

1. trains the dense model (``--dense-steps``) and measures its loss;
2. continues with ``examples/configs/compression_gpt.json`` (``initialize`` calls
   ``init_compression``; the engine advances the schedule every step): weights go 8 -> 4 bits,
   half of each MLP's hidden rows are pruned;
3. ``redundancy_clean`` bakes the 4-bit weights and removes the pruned rows (and the matching
   columns of the second MLP linear), the cleaned model is checkpointed and exported with
   ``shardwise checkpoint export``. Sizes and losses are printed at each stage.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys

import torch

import shardwise as deepspeed
from shardwise.compression.compress import redundancy_clean
from shardwise.config.loading import read_config_source
from shardwise.testing.models import GPTConfig, TinyGPT

sys.path.insert(0, os.path.dirname(__file__))
from train_gpt import ProgressionDataset

HERE = os.path.dirname(os.path.abspath(__file__))


def _train(engine, batches, steps: int) -> float:
    loss = torch.tensor(0.0)
    for _ in range(steps):
        x, y = (t.to(engine.device) for t in next(batches))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    return loss.item()


@torch.no_grad()
def _eval(model: torch.nn.Module, data: ProgressionDataset) -> float:
    model.eval()
    device = next(model.parameters()).device
    x, y = data.data[:256, :-1].to(device), data.data[:256, 1:].to(device)
    loss = model(x, y).item()
    model.train()
    return loss


def _size(model: torch.nn.Module, quantized_bits: dict[str, int]) -> str:
    params = {id(p): (n, p) for n, p in model.named_parameters()}
    count = sum(p.numel() for _, p in params.values())
    bits = sum(p.numel() * quantized_bits.get(n, 32) for n, p in params.values())
    return f"{count / 1e6:.3f}M params, {bits / 8 / 2**20:.2f} MiB at their bit widths"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dense-steps", type=int, default=60)
    parser.add_argument("--compress-steps", type=int, default=120)
    parser.add_argument("--out", default="compressed_gpt")
    args = parser.parse_args()
    config, _ = read_config_source(os.path.join(HERE, "configs", "compression_gpt.json"))
    dense_config = {k: v for k, v in config.items() if k != "compression_training"}

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=128))
    data = ProgressionDataset(4096, 32, 128)
    engine, _, loader, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), training_data=data, config=dense_config
    )
    batches = iter(deepspeed.RepeatingLoader(loader))
    _train(engine, batches, args.dense_steps)
    print(f"dense:      loss {_eval(model, data):.4f} | {_size(model, {})}")

    baseline = copy.deepcopy(model)  # the dense model trained as long, for comparison
    engine, _, loader, _ = deepspeed.initialize(
        model=baseline, model_parameters=baseline.parameters(), training_data=data, config=dense_config
    )
    _train(engine, iter(deepspeed.RepeatingLoader(loader)), args.compress_steps)
    print(f"dense, +{args.compress_steps} steps: loss {_eval(baseline, data):.4f} (the baseline)")

    student = copy.deepcopy(model)
    engine, _, loader, _ = deepspeed.initialize(
        model=student, model_parameters=student.parameters(), training_data=data, config=config
    )
    batches = iter(deepspeed.RepeatingLoader(loader))
    _train(engine, batches, args.compress_steps)
    bits = {
        f"{name}.weight": tech.bits
        for name, module in student.named_modules()
        for key, tech in getattr(module, "compression", {}).items()
        if key == "weight_quantization"
    }
    print(
        f"compressed: loss {_eval(student, data):.4f} (masked, {sorted(set(bits.values()))} bits, step {engine.global_steps})"
    )
    redundancy_clean(student, config)
    print(f"cleaned:    loss {_eval(student, data):.4f} | {_size(student, bits)}")

    engine, _, _, _ = deepspeed.initialize(
        model=student, model_parameters=student.parameters(), config=dense_config
    )
    checkpoints = os.path.join(args.out, "checkpoints")
    engine.save_checkpoint(checkpoints, tag="cleaned")
    target = os.path.join(args.out, "model.safetensors")
    subprocess.run(
        [sys.executable, "-m", "shardwise.cli.main", "checkpoint", "export", checkpoints, target], check=True
    )
    print(
        f"exported:   {target} ({os.path.getsize(target) / 2**20:.2f} MiB as fp32), shapes "
        + json.dumps({n: list(p.shape) for n, p in student.named_parameters() if "blocks.0.mlp" in n})
    )


if __name__ == "__main__":
    main()
