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
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

SENT = {"bytes": 0}
_original = dist.all_to_all_single


def _counting(*args, **kwargs):  # type: ignore[no-untyped-def]
    tensor = kwargs["input"] if "input" in kwargs else args[1]
    SENT["bytes"] += tensor.numel() * tensor.element_size()
    return _original(*args, **kwargs)


dist.all_to_all_single = _counting  # both libraries call it through the module at call time


def build_model(spec: dict) -> nn.Module:
    """Mixtral's layout (``model.layers[i].mlp.gate`` / ``.experts.gate_up_proj`` / ``.down_proj``, what
    both libraries' ``preset_model: mixtral`` detects) with a column/row-parallel pair for the dense part."""
    hidden, ffn, experts, top_k = spec["hidden"], spec["ffn"], spec["experts"], spec["k"]

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * ffn, hidden) * hidden**-0.5)
            self.down_proj = nn.Parameter(torch.randn(experts, hidden, ffn) * ffn**-0.5)

    class SparseBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(hidden, experts, bias=False)
            self.experts = Experts()

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # replaced by both libraries' AutoEP layer
            raise RuntimeError("the MoE block was not converted")

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_layernorm = nn.LayerNorm(hidden)
            self.up = nn.Linear(hidden, 4 * hidden)
            self.down = nn.Linear(4 * hidden, hidden)
            self.post_attention_layernorm = nn.LayerNorm(hidden)
            self.mlp = SparseBlock()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.down(torch.relu(self.up(self.input_layernorm(x))))
            return x + self.mlp(self.post_attention_layernorm(x))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = type("Config", (), {"model_type": "mixtral", "num_local_experts": experts,
                                              "num_experts_per_tok": top_k, "hidden_size": hidden,
                                              "intermediate_size": ffn})()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList([Layer() for _ in range(spec["layers"])])
            self.lm_head = nn.Linear(hidden, hidden, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.model.layers:
                x = layer(x)
            return self.lm_head(x)

    torch.manual_seed(0)
    return Model()


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
    cpu, wall, sent, losses = [], [], [], []
    for step in range(spec["warmup"] + spec["steps"]):
        before = SENT["bytes"]
        dist.barrier()
        c0, w0 = time.process_time(), time.perf_counter()
        loss = ((engine(x) - target) ** 2).mean()
        engine.backward(loss)
        engine.step()
        c1, w1 = time.process_time(), time.perf_counter()
        losses.append(float(loss))
        if step >= spec["warmup"]:
            cpu.append(c1 - c0)
            wall.append(w1 - w0)
            sent.append(SENT["bytes"] - before)
    print(json.dumps({
        "rank": rank, "peer": args.peer, "cpu_ms_min": 1e3 * min(cpu), "wall_ms_median": 1e3 * statistics.median(wall),
        "a2a_bytes_per_step": sent[-1], "losses": losses,
    }))
    os._exit(0)


if __name__ == "__main__":
    main()
