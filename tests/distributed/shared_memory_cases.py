"""Per-rank scenarios for test_shared_memory_transport.py: the shared-memory collectives of one
host (:mod:`shardwise.comm.shared_memory`) and the ZeRO stages that use them."""

from __future__ import annotations

import errno
import logging
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch
from zero_reference import config, make_model, train_step

import shardwise
from shardwise.comm import shared_memory as shm
from shardwise.comm import shm_barrier
from shardwise.comm.fsdp_internals import unit_param_groups
from shardwise.comm.fsdp_shared_hooks import SharedAllGather, SharedReduceScatter
from shardwise.comm.host_transport import PeerBuffer

CPU = torch.device("cpu")


def _inputs(world: int, numel: int) -> list[torch.Tensor]:
    """Every rank's input, computable on every rank (seeded by rank)."""
    return [torch.randn(numel, generator=torch.Generator().manual_seed(100 + r)) for r in range(world)]


def _in_rank_order(values: list[torch.Tensor]) -> torch.Tensor:
    total = values[0] + values[1]
    for v in values[2:]:
        total = total + v
    return total


# The prefixes of the shared-memory groups this rank process opened: the leftover check looks at
# their files only, so another shardwise job on the machine (a second test run, a training job)
# cannot fail it with files of its own.
_OPENED: set[str] = set()
_group_init = shm.SharedMemoryGroup.__init__


def _recording_init(self: shm.SharedMemoryGroup, group: Any, prefix: str, *args: Any, **kwargs: Any) -> None:
    _group_init(self, group, prefix, *args, **kwargs)
    _OPENED.add(prefix)


shm.SharedMemoryGroup.__init__ = _recording_init  # type: ignore[method-assign]  # rank processes only


def _leftovers() -> list[str]:
    """This process's groups' files still in the shared-memory directory (names ``PREFIX-COUNT-RANK``)."""
    return sorted(p.name for p in shm.SHM_DIR.glob("shardwise-*") if p.name.rsplit("-", 2)[0] in _OPENED)


def collectives(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """reduce_scatter, all_gather (whole and in pieces) and all_reduce on buffers of
    ``case["shard"]`` elements per rank; the expected sums are taken in rank order."""
    group = shm.open_shared_memory(None, CPU)
    assert not isinstance(group, str), group
    shard = case["shard"]
    numel = shard * world
    buffers = group.allocate(numel, torch.float32)
    torch.distributed.barrier()  # every rank has returned (and unlinked its file)
    after_allocate = _leftovers()
    ranges = [(r * shard, (r + 1) * shard) for r in range(world)]
    values = _inputs(world, numel)
    expected = _in_rank_order(values)
    lo, hi = ranges[rank]
    out: dict[str, Any] = {"leftovers": after_allocate, "zeros": bool((buffers.mine == 0).all())}
    # the spinning barrier where the memory model allows it (x86-64), gloo's elsewhere
    spins = isinstance(getattr(group.barrier, "__self__", None), shm_barrier.SpinBarrier)
    out["barrier_as_expected"] = spins == shm_barrier.supported()

    buffers.mine.copy_(values[rank])
    buffers.reduce_scatter(ranges)
    out["reduce_scatter_mine"] = torch.equal(buffers.mine[lo:hi], expected[lo:hi])
    others = torch.ones(numel, dtype=torch.bool)
    others[lo:hi] = False
    out["reduce_scatter_rest_untouched"] = torch.equal(buffers.mine[others], values[rank][others])

    buffers.all_gather(ranges)  # every owner's sums to everyone
    out["all_gather"] = torch.equal(buffers.mine, expected)

    buffers.mine.copy_(values[rank] * 2)
    step = case.get("piece", 7)
    pieces = [(a, min(a + step, shard)) for a in range(0, shard, step)]  # uneven last piece
    buffers.all_gather(ranges, pieces)
    out["all_gather_pieces"] = torch.equal(
        buffers.mine, torch.cat([values[r][a:b] * 2 for r, (a, b) in enumerate(ranges)])
    )

    buffers.mine.copy_(values[rank])
    buffers.all_reduce(ranges)
    out["all_reduce"] = torch.equal(buffers.mine, expected)
    out.update(_staged(group, rank, world, shard, values, expected))
    out.update(_released(group, rank, world))
    return out


def _rss_shmem_mib() -> float:
    """This process's resident shared-memory pages (``RssShmem``), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssShmem in /proc/self/status")


def peer_pages(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """What an all-reduce leaves resident in this process: its own buffer, not the other ranks'
    (read during the collective, then dropped from this process's page tables)."""
    group = shm.open_shared_memory(None, CPU)
    assert not isinstance(group, str), group
    numel = case["numel"]
    buffers = group.allocate(numel, torch.float32)
    shard = numel // world
    ranges = [(r * shard, (r + 1) * shard) for r in range(world)]
    buffers.mine.fill_(float(rank + 1))  # this rank's pages are resident from here on
    before = _rss_shmem_mib()
    buffers.all_reduce(ranges)
    after = _rss_shmem_mib()
    total = float(sum(range(1, world + 1)))
    return {
        "grew_mib": after - before,
        "buffer_mib": numel * 4 / 2**20,
        "sums": bool((buffers.mine == total).all()),
        "peers_still_readable": bool((buffers.tensors[(rank + 1) % world] == total).all()),
    }


def _released(group: Any, rank: int, world: int) -> dict[str, bool]:
    """A releasable buffer gives its pages back (its file holds no blocks; every rank reads zeros),
    takes them again, and says what to do when /dev/shm has no room left for that."""
    buffers = group.allocate(5000, torch.float32, releasable=True)
    assert buffers.own_fd is not None
    blocks = lambda: os.fstat(buffers.own_fd).st_blocks  # noqa: E731
    buffers.mine.fill_(rank + 1.0)
    buffers.barrier()
    out = {"release_before": blocks() > 0}
    buffers.release()
    buffers.barrier()
    out["released"] = blocks() == 0 and not buffers.resident
    buffers.barrier()  # (tmpfs: reading a hole maps a page in again; nobody reads before every check)
    out["released_reads_zeros"] = all(bool((t == 0).all()) for t in buffers.tensors)
    buffers.barrier()
    buffers.reserve()
    buffers.mine.fill_(rank + 2.0)
    buffers.barrier()
    out["reserved"] = blocks() * 512 >= 5000 * 4 and buffers.resident
    out["reserved_reads_values"] = all(bool((t == r + 2.0).all()) for r, t in enumerate(buffers.tensors))
    buffers.barrier()
    buffers.release()
    saved = os.posix_fallocate

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    os.posix_fallocate = full
    try:
        buffers.reserve()
        out["full_is_an_error"] = False
    except RuntimeError as exc:
        out["full_is_an_error"] = (
            "--shm-size" in str(exc) and shm.ENV_SWITCH in str(exc) and not buffers.resident
        )
    finally:
        os.posix_fallocate = saved
    return out


def _staged(
    group: Any, rank: int, world: int, shard: int, values: list[torch.Tensor], expected: torch.Tensor
) -> dict[str, bool]:
    """Stage 3's pair (:meth:`SharedBuffers.gather_shards`, :meth:`SharedBuffers.sum_shards`) on a
    byte buffer: into private tensors, in fp32 and bf16, the input staged by copy or in place."""
    numel = shard * world
    staging = group.allocate(numel * 4, torch.uint8)
    out: dict[str, bool] = {}
    lo, hi = rank * shard, (rank + 1) * shard
    for dtype in (torch.float32, torch.bfloat16):
        full = torch.empty(numel, dtype=dtype)
        mine = values[rank][lo:hi].to(dtype)
        full[lo:hi] = mine
        staging.gather_shards(full, full[lo:hi])  # the shard is a view of the output, as in FSDP2
        want = torch.cat([values[r][r * shard : (r + 1) * shard].to(dtype) for r in range(world)])
        out[f"gather_shards_{dtype}"] = torch.equal(full, want)
        separate = torch.empty(numel, dtype=dtype)
        staging.gather_shards(separate, mine.clone())  # a shard of its own
        out[f"gather_shards_separate_{dtype}"] = torch.equal(separate, want)
    for in_place in (False, True):
        output = torch.empty(shard)
        if in_place:  # packed straight into the staging buffer (FSDP2's allocate hook): no copy
            staged = staging.staging(numel, torch.float32)
            staged.copy_(values[rank])
            staging.sum_shards(output, staged)
        else:
            staging.sum_shards(output, values[rank].clone())
        out[f"sum_shards_in_place_{in_place}"] = torch.equal(output, expected[lo:hi])
    return out


def refusals(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """One rank cannot reserve its buffer, sees another host, or has the switch off: every rank
    gets the same refusal (no hang, nothing left in /dev/shm)."""
    kind = case["kind"]
    saved = (os.posix_fallocate, socket.gethostname, os.environ.get(shm.ENV_SWITCH), shm.SHM_DIR)
    try:
        if kind == "no_space" and rank == 1:

            def full(fd: int, offset: int, length: int) -> None:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            os.posix_fallocate = full
        if kind == "two_hosts" and rank == 1:
            socket.gethostname = lambda: "elsewhere"
        if kind == "switched_off" and rank == 1:
            os.environ[shm.ENV_SWITCH] = "0"
        if kind == "separate_dirs" and rank == 1:  # as with containers that each mount their own /dev/shm
            shm.SHM_DIR = Path(tempfile.mkdtemp())
        got = shm.open_shared_memory(None, CPU)
        if not isinstance(got, str):
            got = got.allocate(1000, torch.float32)
        torch.distributed.barrier()
        leftovers = _leftovers()
        if saved[3] != shm.SHM_DIR:
            leftovers += sorted(p.name for p in shm.SHM_DIR.iterdir())
            shm.SHM_DIR.rmdir()
        return {"result": got if isinstance(got, str) else "shared", "leftovers": leftovers}
    finally:
        os.posix_fallocate, socket.gethostname, shm.SHM_DIR = saved[0], saved[1], saved[3]
        if saved[2] is None:
            os.environ.pop(shm.ENV_SWITCH, None)
        else:
            os.environ[shm.ENV_SWITCH] = saved[2]


def _full(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter (stage 3's are sharded DTensors)."""
    data = param.detach()
    return (data.full_tensor() if hasattr(data, "full_tensor") else data).clone()


def _transport(strategy: Any) -> dict[str, Any]:
    """Which buffers (stages 0-2) or FSDP2 hooks (stage 3) go through shared memory."""
    if hasattr(strategy, "groups"):
        return {
            "shared_params": [isinstance(g.param_store, PeerBuffer) for g in strategy.groups],
            "shared_grads": [isinstance(g.grad_store, PeerBuffer) for g in strategy.groups],
            "staged": [any(isinstance(s, PeerBuffer) for s in g.staging) for g in strategy.groups],
            # the staging buffer holds no memory between steps (its file's allocated blocks)
            "staging_blocks": [
                os.fstat(s.buffers.own_fd).st_blocks
                for g in strategy.groups
                for s in g.staging
                if isinstance(s, PeerBuffer) and s.buffers.own_fd is not None
            ],
        }
    hooks = [
        (group._all_gather_comm, group._reduce_scatter_comm)
        for module in strategy.record.fsdp_modules()
        for group in unit_param_groups(module)
    ]
    return {
        "shared_params": [isinstance(g, SharedAllGather) for g, _ in hooks],
        "shared_grads": [isinstance(r, SharedReduceScatter) for _, r in hooks],
        "reduce_fp32": strategy.record.policy.reduce_dtype == torch.float32,
    }


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append((record.levelno, record.getMessage()))


def train(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Three steps of ZeRO stage ``case["stage"]`` (clipping on) with shared memory on, off, and
    with rank 1 unable to reserve its buffers: losses, parameters, and what was logged."""
    out: dict[str, Any] = {}
    for mode in ("shared", "gloo", "no_space"):
        saved = (os.posix_fallocate, os.environ.get(shm.ENV_SWITCH))
        if mode == "gloo":
            os.environ[shm.ENV_SWITCH] = "0"
        if mode == "no_space" and rank == 1:

            def full(fd: int, offset: int, length: int) -> None:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            os.posix_fallocate = full
        records = _Records()
        log = logging.getLogger("shardwise")
        level = log.level
        log.setLevel(logging.INFO)
        log.addHandler(records)
        try:
            torch.manual_seed(0)
            zero = {"reduce_bucket_size": case["bucket"]} if "bucket" in case else {}
            zero.update(case.get("zero", {}))
            cfg = config(case["stage"], case["precision"], case["gas"], 2, world, clip=0.05, **zero)
            engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
            losses = [loss for step in range(3) for loss in train_step(engine, step, rank, case["gas"])]
            out[mode] = {
                "losses": losses,
                "params": [_full(p) for p in engine.module.parameters()],
                **_transport(engine.optimizer),
                "logged": records.messages,
            }
            engine.destroy()
        finally:
            log.removeHandler(records)
            log.setLevel(level)
            os.posix_fallocate = saved[0]
            if saved[1] is None:
                os.environ.pop(shm.ENV_SWITCH, None)
            else:
                os.environ[shm.ENV_SWITCH] = saved[1]
    torch.distributed.barrier()
    assert _OPENED, "no shared-memory group was recorded: the leftover check would look at nothing"
    out["leftovers"] = _leftovers()
    return out
