"""Train a tiny model with ZeRO-2 for a few steps and print every step's loss exactly (rank 0).

Each rank draws its own batch from a seed of (step, rank), so any launch with the same world
size sees the same data and must print the same losses bit for bit. Prints the node it ran on
(``CLUSTER_BOX_NODE``, set by the cluster-in-a-box stand-ins; ``local-node<CROSS_RANK>`` under
``--launcher local``) for each rank.
"""

import os
import sys

import torch

import shardwise

steps = int(next(a for a in sys.argv[1:] if not a.startswith("--local_rank")))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
config = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 2},
}
engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
rank = engine.global_rank
node = os.environ.get("CLUSTER_BOX_NODE", f"local-node{os.environ.get('CROSS_RANK', '0')}")
print(f"rank {rank} of {engine.world_size} on node {node}", flush=True)
for step in range(steps):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    if rank == 0:
        print(f"step {step} loss {loss.item()!r}", flush=True)
