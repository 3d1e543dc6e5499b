"""Node-local checkpoints where one node's checkpoint directory is read-only (injected).

Usage (under the launcher, one rank per node): ``read_only_node.py READONLY_NODE_INDEX``. Every
rank saves to its node-local ``ckpt`` directory with ``use_node_local_storage``: under the
cluster-in-a-box stand-ins ``$CLUSTER_BOX_NODE_DIR/ckpt``, under ``--launcher local`` (every
"node" on this machine) ``./local-node<CROSS_RANK>/ckpt``. The first save succeeds everywhere;
for the second, node ``READONLY_NODE_INDEX`` (``CROSS_RANK``) has its directory turned
read-only: every open for writing under it fails with EROFS, as on a file system remounted
read-only. The script prints the error each rank got and what ``latest`` names afterwards.
"""

import builtins
import errno
import os
import sys

import torch

import shardwise

readonly_node = int(next(a for a in sys.argv[1:] if not a.startswith("--local_rank")))
node_index = int(os.environ["CROSS_RANK"])  # the worker sets it under every runner
node = os.environ.get("CLUSTER_BOX_NODE", f"local-node{node_index}")
ckpt = os.path.join(os.environ.get("CLUSTER_BOX_NODE_DIR", os.path.abspath(node)), "ckpt")
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
config = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 1},
    "checkpoint": {"use_node_local_storage": True},
}
engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)


def step() -> None:
    loss = engine(torch.randn(2, 8)).pow(2).mean()
    engine.backward(loss)
    engine.step()


step()
engine.save_checkpoint(ckpt, tag="one")
step()
if node_index == readonly_node:
    real_open, real_os_open = builtins.open, os.open

    def _refuse(path: object) -> None:
        if str(path).startswith(ckpt):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    def guarded_open(file, mode="r", *args, **kwargs):
        if any(m in mode for m in "wax+"):
            _refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            _refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    builtins.open, os.open = guarded_open, guarded_os_open
    os.mkdir = lambda path, *a, **k: _refuse(path)
try:
    engine.save_checkpoint(ckpt, tag="two")
    print(f"node {node} rank {engine.global_rank}: saved", flush=True)
except Exception as exc:
    print(f"node {node} rank {engine.global_rank}: {type(exc).__name__}: {exc}", flush=True)
latest_file = os.path.join(ckpt, "latest")
latest = None
if os.path.exists(latest_file):
    with open(latest_file) as handle:
        latest = handle.read().strip()
print(f"node {node} latest={latest}", flush=True)
