"""One rank of the MoE benchmark (``moe_bench.py``): the same model and loop under shardwise or under
DeepSpeed (``--peer``), timing each step and counting the bytes handed to ``all_to_all_single``.

Run by the driver with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set; prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from a2a_timing import SENT, timed_steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer", choices=["shardwise", "deepspeed"], required=True)
    parser.add_argument("--spec", required=True, help="JSON: hidden, ffn, experts, ep, k, batch, seq, layers, steps, warmup")
    args = parser.parse_args()
    spec = json.loads(args.spec)
    if args.peer == "shardwise":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
        import shardwise as ds
        from shardwise.moe.layer import MoE
        from shardwise.moe.utils import split_params_into_different_moe_groups_for_optimizer as split
    else:
        import deepspeed as ds
        from deepspeed.moe.layer import MoE
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split
    torch.manual_seed(0)
    hidden = spec["hidden"]

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            expert = torch.nn.Sequential(
                torch.nn.Linear(hidden, spec["ffn"]), torch.nn.GELU(), torch.nn.Linear(spec["ffn"], hidden)
            )
            self.layers = torch.nn.ModuleList(
                MoE(hidden, expert, num_experts=spec["experts"], ep_size=spec["ep"], k=spec["k"], min_capacity=0)
                for _ in range(spec["layers"])
            )
            self.head = torch.nn.Linear(hidden, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            aux = 0.0
            for layer in self.layers:
                out, l_aux, _ = layer(x)
                x, aux = x + out, aux + l_aux
            return self.head(x).pow(2).mean() + 0.01 * aux

    model = Net()
    groups = split({"params": list(model.parameters()), "name": "dense"})
    optimizer = torch.optim.AdamW(groups, lr=1e-4)
    config = {"train_micro_batch_size_per_gpu": spec["batch"], "zero_optimization": {"stage": spec["stage"]}}
    engine, *_ = ds.initialize(model=model, optimizer=optimizer, config=config)
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(spec["batch"], spec["seq"], hidden, generator=gen)
    def step() -> float:
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        return float(loss)

    timed = timed_steps(step, spec["warmup"], spec["steps"])
    cpu, wall, sent, loss = timed["cpu"], timed["wall"], timed["sent"], timed["losses"][-1]
    tokens = spec["batch"] * spec["seq"]
    cap = max(math.ceil(tokens / spec["experts"] * 1.0 * spec["k"]), 0)
    # two all-to-alls forward and two backward per layer, but the first layer's input needs no
    # gradient, so autograd skips the backward of its dispatch all-to-all
    calls = 4 * spec["layers"] - 1
    theory = calls * spec["experts"] * cap * hidden * 4 if spec["ep"] > 1 else 0
    print(json.dumps({
        "rank": rank, "peer": args.peer, "cpu_ms_min": 1e3 * min(cpu), "wall_ms_median": 1e3 * statistics.median(wall),
        "a2a_bytes_per_step": sent[-1], "a2a_calls": SENT["calls"], "theory_bytes_per_step": theory,
        "capacity": cap, "loss": float(loss),
    }))
    os._exit(0)


if __name__ == "__main__":
    main()
