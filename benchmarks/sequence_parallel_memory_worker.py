"""One rank of the sequence-parallel memory benchmark (run by ``sequence_parallel_memory.py``).

Invoked as ``python sequence_parallel_memory_worker.py '<json spec>'`` with the launcher variables in
the environment; writes JSON to ``spec["out"]``. The same file runs against shardwise's ``deepspeed``
package and against real DeepSpeed 0.19.8: it imports only torch, ``deepspeed`` (``init_distributed``,
``deepspeed.sequence.layer.DistributedAttention``, ``deepspeed.runtime.sequence_parallel.ulysses_sp``'s
``TiledMLP`` / ``TiledFusedLogitsLoss``) and the saved-activation meter by its file path.

The model is a small Llama-style decoder written here (pre-norm attention with Ulysses around SDPA,
a gated MLP, an LM head). Each rank holds ``seq / world`` tokens of one sequence; the whole world is
one sequence-parallel group. Measured per rank:

* ``saved_bytes``: the peak bytes autograd saves during the forward (``saved_tensors_hooks``; each
  storage once, parameters excluded);
* ``peak_rss_delta``: the peak resident memory during forward + backward over what was resident
  before it (``/proc/self/clear_refs`` resets the high-water mark; glibc's mmap threshold is fixed by
  the driver so large tensors return their pages when freed);
* ``mlp_peak_delta``: the same for one MLP alone (untiled, or ``TiledMLP``) on the rank's tokens.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import traceback
import types
from typing import Any


def _load(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # VmHWM := VmRSS
    return _rss_kib("VmRSS")


def _peak_delta_bytes(before_kib: int) -> int:
    return (_rss_kib("VmHWM") - before_kib) * 1024


def build(spec: dict[str, Any], group: Any) -> Any:
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    from deepspeed.sequence.layer import DistributedAttention
    from torch import nn

    hidden, heads, inter = spec["hidden"], spec["heads"], spec["intermediate"]
    head_dim = hidden // heads

    def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return out.transpose(1, 2)

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(hidden, inter, bias=False)
            self.up = nn.Linear(hidden, inter, bias=False)
            self.down = nn.Linear(inter, hidden, bias=False)

        def plain(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not spec["tiled"]:
                return self.plain(x)
            shards = max(1, math.ceil(x.shape[1] / hidden))
            return TiledMLP.apply(MLP.plain, self, x, shards, [self.gate.weight, self.up.weight, self.down.weight])

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
            self.out = nn.Linear(hidden, hidden, bias=False)
            self.attention = DistributedAttention(local_attention, group)
            self.mlp = MLP()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, heads, head_dim).unbind(2)
            x = x + self.out(self.attention(q, k, v, batch_dim_idx=0).reshape(b, s, hidden))
            return x + self.mlp(self.norm2(x))

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(spec["vocab"], hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(spec["layers"]))
            self.norm = nn.LayerNorm(hidden)
            self.head = nn.Linear(hidden, spec["vocab"], bias=False)

    torch.manual_seed(0)
    return Decoder()


def loss_of(model: Any, ids: Any, labels: Any, spec: dict[str, Any]) -> Any:
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    x = model.embed(ids)
    for block in model.blocks:
        x = block(x)
    x = model.norm(x)
    count = max(1, int((labels != -100).sum()))

    def tile_loss(head: Any, h: Any, y: Any) -> Any:
        return torch.nn.functional.cross_entropy(head(h).float(), y, ignore_index=-100, reduction="sum")

    if spec["tiled"]:
        shards = max(1, math.ceil(ids.shape[1] / spec["hidden"]))
        total = TiledFusedLogitsLoss.apply(tile_loss, model.head, x, labels, None, shards, [model.head.weight], "sum")
    else:
        total = tile_loss(model.head, x.reshape(-1, x.shape[-1]), labels.reshape(-1))
    return total / count


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import deepspeed
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    meter = _load("sp_bench_meter", spec["meter_path"])
    model = build(spec, group)
    seq = spec["seq"]
    local = seq // world
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec["vocab"], (1, seq), generator=generator)
    labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    ids, labels = ids[:, rank * local : (rank + 1) * local], labels[:, rank * local : (rank + 1) * local]
    params = list(model.parameters())

    loss_of(model, ids, labels, spec).backward()  # warm-up: kernels, thread pools, allocator
    model.zero_grad(set_to_none=True)
    with meter.SavedActivationMeter(exclude=params) as saved:
        loss = loss_of(model, ids, labels, spec)
    loss.backward()
    model.zero_grad(set_to_none=True)
    del loss
    before = _reset_peak()
    loss_of(model, ids, labels, spec).backward()
    whole = _peak_delta_bytes(before)
    model.zero_grad(set_to_none=True)

    mlp = model.blocks[0].mlp
    x = torch.randn(1, local, spec["hidden"], requires_grad=True)
    upstream = torch.randn(1, local, spec["hidden"])
    mlp(x).backward(upstream)  # warm-up
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    before = _reset_peak()
    mlp(x).backward(upstream)
    mlp_peak = _peak_delta_bytes(before)
    dist.barrier()
    return {
        "rank": rank,
        "world": world,
        "saved_bytes": saved.peak_bytes,
        "peak_rss_delta": whole,
        "mlp_peak_delta": mlp_peak,
        "mlp_io_bytes": 2 * x.numel() * 4,  # made by any MLP's forward + backward: the output and x's gradient
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    try:
        result = run(spec)
    except Exception:
        with open(spec["out"] + ".error", "w") as err:
            err.write(traceback.format_exc())
        raise
    with open(spec["out"], "w") as out:
        json.dump(result, out)
    os._exit(0)


if __name__ == "__main__":
    main()
