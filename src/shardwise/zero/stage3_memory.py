"""Stage 3's model-state bytes by role, for ``memory_breakdown`` (the memory plan's tests and
``engine.memory_breakdown()``): what each storage the optimizer reaches holds, counted once."""

from __future__ import annotations

from typing import Any

import torch

from shardwise.comm.fsdp_internals import local_tensor
from shardwise.zero.offloaded_optimizer import OffloadedOptimizer


def breakdown(opt: Any) -> dict[str, int]:
    """Model-state bytes held by this rank, by role.

    ``params``/``grads``/``optimizer`` are on the compute device; ``offloaded_host``
    and ``offloaded_nvme`` are what offload moved away. Each storage is counted once.
    """
    seen: set[int] = set()

    def size(t: torch.Tensor | None) -> int:
        storage = None if t is None else t.untyped_storage()
        if storage is None or storage.nbytes() == 0 or storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return int(storage.nbytes())

    out = {"params": 0, "grads": 0, "optimizer": 0, "offloaded_host": 0, "offloaded_nvme": 0}
    params_away = opt.record.policy.param_offload is not None
    swapper = opt.record.swapper
    for param in opt.record.sharded:
        mapped = swapper is not None and swapper.is_mapped(param)  # in the swap file: not held
        nbytes = 0 if mapped else size(local_tensor(param))
        grad = opt._acc.get(id(param))
        gbytes = size(grad)
        if params_away:
            out["offloaded_host"] += nbytes + gbytes
        else:
            out["params"] += nbytes
            out["grads"] += gbytes
    for param in opt.record.replicated:
        out["params"] += size(param)
    for master in opt.replicated.masters:
        out["optimizer"] += size(master)
    for acc in opt.replicated.accumulators:
        out["grads"] += size(acc)
    if opt.record.swapper is not None:
        out["offloaded_nvme"] += opt.record.swapper.file_bytes
    inner = opt.optimizer.inner if isinstance(opt.optimizer, OffloadedOptimizer) else opt.optimizer
    offloaded_ids: set[int] = set()
    if opt.store is not None:
        store_bytes = opt.store.state_bytes(inner)
        out["offloaded_host"] += store_bytes["host"]
        out["offloaded_nvme"] += store_bytes["nvme"]
        offloaded_ids = {id(t) for t in opt.store.host[: opt.store.offloaded]}
        for t in opt.store.host[: opt.store.offloaded]:
            size(t)  # counted by the store already
            for value in inner.state.get(t, {}).values():
                if torch.is_tensor(value):
                    size(value)
    # with offload_param the masters, hence the optimizer state, live on the host
    state_on_host = params_away and opt.store is None
    for param_key, state in inner.state.items():
        if id(param_key) in offloaded_ids:
            continue
        for value in state.values():
            if torch.is_tensor(value) and value.dim() > 0:
                nbytes = size(value)
                out["offloaded_host" if state_on_host else "optimizer"] += nbytes
    return out
