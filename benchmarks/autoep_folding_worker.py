"""One rank of the folded AutoEP + AutoTP benchmark (``autoep_folding_bench.py``): a Mixtral-shaped MoE
model trained with ``expert_parallel`` beside ``tensor_parallel`` under shardwise or DeepSpeed (``--peer``),
timing each step and counting the bytes handed to ``all_to_all_single`` (the expert dispatch).

Run by the driver with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set; prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "distributed"))
import autoep_folding_cases as cases  # the test's model (it imports only torch)
from a2a_timing import timed_steps


def build_model(spec: dict) -> nn.Module:
    """The folded test's Mixtral-shaped model (``tests/distributed/autoep_folding_cases.build_model``: what
    both libraries' ``preset_model: mixtral`` converts, with a column/row-parallel dense pair) at this size."""
    return cases.build_model(hidden=spec["hidden"], ffn=spec["ffn"], experts=spec["experts"], top_k=spec["k"],
                             out=spec["hidden"], layers=spec["layers"], dense=4 * spec["hidden"], init_scale=0.05)


def config(spec: dict) -> dict:
    """The ds_config both peers read: AutoEP folded over AutoTP, fp32, Adam (torch's), ZeRO ``stage``."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": spec["stage"]},
        "expert_parallel": {"enabled": True, "autoep_size": spec["ep"], "preset_model": "mixtral",
                            "use_grouped_mm": False},
        "tensor_parallel": {"autotp_size": spec["tp"], "partition_config": {"use_default_specs": False, "layer_specs": [
            {"patterns": [r".*\.up\.weight$", r".*\.up\.bias$"], "partition_type": "column"},
            {"patterns": [r".*\.down\.weight$"], "partition_type": "row"},
            {"patterns": [r".*\.weight$"], "partition_type": "skip"},
        ]}},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer", choices=["shardwise", "deepspeed"], required=True)
    parser.add_argument("--spec", required=True, help="JSON: hidden, ffn, experts, k, layers, tokens, tp, ep, stage, steps, warmup")
    args = parser.parse_args()
    spec = json.loads(args.spec)
    if args.peer == "shardwise":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
        import shardwise as ds
    else:
        import deepspeed as ds
    engine, *_ = ds.initialize(model=build_model(spec), config=config(spec))
    rank, tp = dist.get_rank(), spec["tp"]
    gen = torch.Generator().manual_seed(rank // tp)  # one batch per data-parallel replica, the same on its TP lanes
    x = torch.randn(1, spec["tokens"], spec["hidden"], generator=gen)
    target = torch.randn(1, spec["tokens"], spec["hidden"], generator=gen)
    def step() -> float:
        loss = ((engine(x) - target) ** 2).mean()
        engine.backward(loss)
        engine.step()
        return float(loss)

    timed = timed_steps(step, spec["warmup"], spec["steps"])
    cpu, wall, sent, losses = timed["cpu"], timed["wall"], timed["sent"], timed["losses"]
    print(json.dumps({
        "rank": rank, "peer": args.peer, "cpu_ms_min": 1e3 * min(cpu), "wall_ms_median": 1e3 * statistics.median(wall),
        "a2a_bytes_per_step": sent[-1], "losses": losses,
    }))
    os._exit(0)


if __name__ == "__main__":
    main()
