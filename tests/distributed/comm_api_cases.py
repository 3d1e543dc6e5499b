"""Per-rank body of test_comm_api.py: every deepspeed.comm collective shardwise added, next to
torch.distributed's own result for the same inputs, with the comms logger on (module level so the
harness can pickle it)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import shardwise.comm as comm
from shardwise.comm.comms_logger import COMMS_LOGGER
from shardwise.compat import runtime_utils


def _values(rank: int, n: int, offset: float = 0.0) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + 10 * rank + offset


def collectives(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    comm.configure(enabled=True, prof_all=True, prof_ops=[], verbose=False, debug=False)
    comm.reset_log()

    # all_to_all (gloo: through all_to_all_single), against torch's all_to_all_single of the same pieces
    pieces = [_values(rank, 2 + r, 100 * r) for r in range(world)]  # rank r gets 2 + r elements
    received = [torch.empty(2 + rank) for _ in range(world)]
    comm.all_to_all(received, pieces)
    expect = torch.empty((2 + rank) * world)
    dist.all_to_all_single(expect, torch.cat(pieces), [2 + rank] * world, [2 + r for r in range(world)])
    out["all_to_all"] = torch.equal(torch.cat(received), expect)
    handle = comm.all_to_all([torch.empty(2 + rank) for _ in range(world)], pieces, async_op=True)
    out["all_to_all_async"] = handle is not None and handle.wait()

    # gather / scatter
    mine = _values(rank, 3)
    gathered = [torch.empty(3) for _ in range(world)] if rank == 0 else None
    comm.gather(mine, gathered, dst=0)
    reference = [torch.empty(3) for _ in range(world)] if rank == 0 else None
    dist.gather(mine, reference, dst=0)
    out["gather"] = rank != 0 or all(torch.equal(a, b) for a, b in zip(gathered, reference))  # type: ignore[arg-type]
    chunks = [_values(r, 4, 0.5) for r in range(world)] if rank == 1 else None
    got, ref = torch.empty(4), torch.empty(4)
    comm.scatter(got, chunks, src=1)
    dist.scatter(ref, chunks, src=1)
    out["scatter"] = torch.equal(got, ref) and torch.equal(got, _values(rank, 4, 0.5))

    # objects
    objects: list[Any] = [None] * world
    comm.all_gather_object(objects, {"rank": rank, "name": f"r{rank}"})
    ref_objects: list[Any] = [None] * world
    dist.all_gather_object(ref_objects, {"rank": rank, "name": f"r{rank}"})
    out["all_gather_object"] = objects == ref_objects == [{"rank": r, "name": f"r{r}"} for r in range(world)]
    listed: list[Any] = [("from", rank), rank * 7] if rank == 1 else [None, None]
    comm.broadcast_object_list(listed, src=1)
    out["broadcast_object_list"] = listed == [("from", 1), 7]

    # point to point: a batch exchanging with the other rank
    peer = 1 - rank
    inbox = torch.empty(5)
    works = comm.batch_isend_irecv([comm.P2POp(comm.isend, _values(rank, 5), peer),
                                    comm.P2POp(comm.irecv, inbox, peer)])
    for work in works:
        work.wait()
    out["batch_isend_irecv"] = torch.equal(inbox, _values(peer, 5))
    try:
        comm.P2POp(comm.send, inbox, peer)
        out["p2pop_refuses_send"] = False
    except ValueError:
        out["p2pop_refuses_send"] = True

    # coalesced: against one torch all_reduce per tensor
    tensors = [_values(rank, 3), _values(rank, 2, 1).double(), _values(rank, 4, 2).reshape(2, 2)]
    refs = [t.clone() for t in tensors]
    comm.all_reduce_coalesced(tensors)
    for t in refs:
        dist.all_reduce(t)
    out["all_reduce_coalesced"] = all(torch.equal(a, b) for a, b in zip(tensors, refs))
    averaged = [_values(rank, 3)]
    handle = comm.all_reduce_coalesced(averaged, op="avg", async_op=True)
    handle.wait()  # type: ignore[union-attr]
    out["all_reduce_coalesced_avg"] = torch.equal(averaged[0], (_values(0, 3) + _values(1, 3)) / 2)
    inputs = [_values(rank, 3), _values(rank, 1, 5)]
    outputs = [torch.empty(world * 3), torch.empty(world)]
    comm.all_gather_coalesced(outputs, inputs)
    ref_outputs = [torch.empty(world * 3), torch.empty(world)]
    for o, i in zip(ref_outputs, inputs):
        dist.all_gather_into_tensor(o, i)
    out["all_gather_coalesced"] = all(torch.equal(a, b) for a, b in zip(outputs, ref_outputs))

    # DeepSpeed's flat entry points, against torch's flat collectives
    flat_out, flat_ref = torch.empty(world * 3), torch.empty(world * 3)
    comm.allgather_fn(flat_out, _values(rank, 3))
    dist.all_gather_into_tensor(flat_ref, _values(rank, 3))
    out["allgather_fn"] = torch.equal(flat_out, flat_ref)
    shard, shard_ref = torch.empty(3), torch.empty(3)
    comm.reduce_scatter_fn(shard, _values(rank, world * 3))
    dist.reduce_scatter_tensor(shard_ref, _values(rank, world * 3))
    out["reduce_scatter_fn"] = torch.equal(shard, shard_ref)

    comm.monitored_barrier(wait_all_ranks=True)
    out["ranks_of_world"] = comm.get_all_ranks_from_group()
    pair = comm.new_group([0, 1])
    out["ranks_of_group"] = comm.get_all_ranks_from_group(pair)
    out["norm_fast"] = runtime_utils.get_norm_with_moe_layers_fast(2.0 + 2 * rank, None)  # mean of 2 and 4

    # prof=True records an op that neither prof_all nor prof_ops selects
    comm.configure(prof_all=False, prof_ops=["gather"])
    comm.all_gather_object([None] * world, rank)
    comm.gather(mine, [torch.empty(3) for _ in range(world)] if rank == 0 else None, dst=0, log_name="gather")
    comm.scatter(got, chunks, src=1, prof=True, log_name="scatter_forced")
    comm.all_reduce(torch.ones(2), prof=True, log_name="all_reduce_forced")  # shardwise's own collectives too
    comm.all_gather_into_tensor(torch.empty(world * 3), mine, log_name="gather")
    comm.barrier(prof=True)
    out["ops"] = sorted(comm.get_logged_comm_ops())
    out["counts"] = {op: sum(len(rs) for rs in sizes.values())
                     for op, sizes in COMMS_LOGGER.records.items()}
    out["gather_bytes"] = sorted(COMMS_LOGGER.records["gather"])
    comm.configure(enabled=False, prof_all=True, prof_ops=[])
    comm.reset_log()
    return out
