"""One rank of one activation-checkpointing benchmark peer (run by ``activation_checkpointing_bench.py``).

Invoked as ``python activation_checkpointing_worker.py '<json spec>'`` with the launcher variables in
the environment; writes JSON to ``spec["out"]``. The same file runs under the project venv (none,
torch, shardwise) and under ``.venv-ds`` (DeepSpeed), so it loads the model and the saved-activation
meter from their file paths (both import only torch).

Both ranks form one model-parallel group (an mpu with data-parallel size 1) and train the same
replica on the same batches, as tensor-parallel ranks hold the same activations: that is what
``partition_activations`` splits. Each step is zero_grad, forward (a checkpoint per block), backward,
AdamW step; the meter (``saved_tensors_hooks``) records the saved-activation bytes, and each step's
wall time and this process's CPU time (``time.process_time``: the work done, which other load on
the machine disturbs far less than the wall clock) are kept.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
import types
from typing import Any


def _load(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look the module up while building
    spec.loader.exec_module(module)
    return module


class PairMpu:
    """The world is one model-parallel group; every rank is its own data-parallel group."""

    def __init__(self, dist: Any, rank: int, world: int) -> None:
        singles = [dist.new_group([r]) for r in range(world)]
        self.dp_group, self.mp_group = singles[rank], dist.new_group(list(range(world)))
        self.rank, self.world = rank, world

    def get_model_parallel_group(self) -> Any:
        return self.mp_group

    def get_model_parallel_rank(self) -> int:
        return self.rank

    def get_model_parallel_world_size(self) -> int:
        return self.world

    def get_data_parallel_group(self) -> Any:
        return self.dp_group

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_world_size(self) -> int:
        return 1


def _ds_config(spec: dict[str, Any], partition: bool) -> dict[str, Any]:
    batch = spec["batch"][0]
    return {
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": batch,
        "activation_checkpointing": {"partition_activations": partition},
    }


def _checkpoint_fn(peer: str, spec: dict[str, Any], mpu: PairMpu, meter_module: types.ModuleType) -> Any:
    """What runs each block: None (plain), or the peer's checkpoint function, configured."""
    import torch

    if peer == "none":
        return None
    if peer == "torch":  # reentrant: its saved inputs are visible to the meter, like DeepSpeed's
        return functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
    partition = peer.endswith("_partition")
    if peer.startswith("shardwise"):
        from shardwise import checkpointing

        checkpointing.configure(mpu, deepspeed_config=_ds_config(spec, partition))
        return checkpointing.checkpoint
    import deepspeed

    deepspeed.checkpointing.configure(mpu, deepspeed_config=_ds_config(spec, partition))
    return _deepspeed_counted(deepspeed.checkpointing.checkpoint, meter_module)


def _deepspeed_counted(ds_checkpoint: Any, meter_module: types.ModuleType) -> Any:
    """DeepSpeed's checkpoint, with what it keeps made visible to the meter.

    DeepSpeed's ``CheckpointFunction`` keeps the block inputs as an attribute of its autograd
    context (``ctx.deepspeed_saved_tensors``), not through ``save_for_backward``, so saved-tensor
    hooks never see them; with ``partition_activations`` each kept input is emptied and this
    rank's partition hangs on its ``saved_data``. Both are counted here, for as long as the
    context (the output's ``grad_fn``) lives, exactly like a saved tensor.
    """
    import torch

    def run(function: Any, *args: Any) -> Any:
        out = ds_checkpoint(function, *args)
        node = out.grad_fn
        counted = []
        for meter in meter_module._ACTIVE:
            for t in getattr(node, "deepspeed_saved_tensors", ()) or ():
                if torch.is_tensor(t):
                    counted.append(meter._pack(t))
                    if torch.is_tensor(getattr(t, "saved_data", None)):
                        counted.append(meter._pack(t.saved_data))
        node._bench_counted = counted  # released with the context, after backward
        return out

    return run


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    peer = spec["peer"]
    if peer.startswith("deepspeed"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        torch.distributed.init_process_group("gloo")
    import torch.distributed as dist

    models = _load("_bench_models", spec["models_path"])
    if peer.startswith("shardwise"):  # the same module the checkpoint storage reports to
        import shardwise.checkpointing.meter as meter_module
    else:
        meter_module = _load("_bench_meter", spec["meter_path"])
    mpu = PairMpu(dist, rank, world)
    torch.manual_seed(0)
    model = models.TinyGPT(models.GPTConfig(**spec["model"]))
    model.checkpoint_fn = _checkpoint_fn(peer, spec, mpu, meter_module)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = models.TokenDataset(64, model.config.block_size, model.config.vocab_size, seed=1)
    batch, seq = spec["batch"]
    times, cpu_times, peaks, held, losses = [], [], [], [], []
    for step in range(spec["warmup"] + spec["steps"]):
        rows = [data[(step * batch + i) % len(data)] for i in range(batch)]
        x = torch.stack([r[0][:seq] for r in rows])
        y = torch.stack([r[1][:seq] for r in rows])
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        with meter_module.SavedActivationMeter(exclude=model.parameters()) as meter:
            loss = model(x, y)
            after_forward = meter.current_bytes
            loss.backward()
        optimizer.step()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        losses.append(loss.item())
        if step >= spec["warmup"]:
            times.append(elapsed)
            cpu_times.append(cpu)
            peaks.append(meter.peak_bytes)
            held.append(after_forward)
    return {
        "peer": peer,
        "rank": rank,
        "step_s": statistics.median(times),
        "step_s_min": min(times),
        "cpu_s_min": min(cpu_times),
        "held_after_forward": max(held),
        "step_s_all": times,
        "peak_saved_bytes": max(peaks),
        "losses": losses,
        "torch": torch.__version__,
    }


def interleaved(spec: dict[str, Any]) -> dict[str, Any]:
    """One process, one rank: none, torch, shardwise and DeepSpeed take turns on the same model and
    batch (order reversed every round), so machine load hits every peer alike. Runs under the
    DeepSpeed venv with shardwise on PYTHONPATH; forward + backward CPU time per peer and round."""
    import torch

    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    from shardwise import checkpointing

    deepspeed.checkpointing.configure(None, partition_activations=False)
    checkpointing.configure(None)
    models = _load("_bench_models", spec["models_path"])
    torch.manual_seed(0)
    model = models.TinyGPT(models.GPTConfig(**spec["model"]))
    batch, seq = spec["batch"]
    x = torch.randint(0, model.config.vocab_size, (batch, seq))
    y = torch.randint(0, model.config.vocab_size, (batch, seq))
    peers = {
        "none": None,
        "torch": functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True),
        "shardwise": checkpointing.checkpoint,
        "deepspeed": deepspeed.checkpointing.checkpoint,
    }
    cpu: dict[str, list[float]] = {name: [] for name in peers}
    for round_ in range(spec["warmup"] + spec["steps"]):
        order = list(peers) if round_ % 2 == 0 else list(peers)[::-1]
        for name in order:
            model.checkpoint_fn = peers[name]
            model.zero_grad(set_to_none=True)
            start = time.process_time()
            model(x, y).backward()
            if round_ >= spec["warmup"]:
                cpu[name].append(time.process_time() - start)
    return {"cpu_s_min": {k: min(v) for k, v in cpu.items()}, "cpu_s": cpu}


def main() -> None:
    spec = json.loads(sys.argv[1])
    try:
        result = interleaved(spec) if spec.get("peer") == "interleaved" else run(spec)
    except Exception:
        with open(spec["out"] + ".error", "w") as f:
            f.write(traceback.format_exc())
        raise
    with open(spec["out"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
