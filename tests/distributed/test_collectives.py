"""shardwise.comm on real process groups: 2 gloo ranks, and init_distributed in subprocesses.

One spawn runs the whole grid of collective cases (spawning costs seconds). Every rank
builds every rank's input from a per-rank seed, so it can compute the reference itself:
with two ranks a sum is a single rounded addition, so results must match the reference
exactly, in fp32 and bf16, for every algorithm, sync or async.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

import shardwise
from shardwise.testing import find_free_port, run_distributed_cases

pytestmark = pytest.mark.distributed

WORLD = 2
NUMEL = 2 * 1000 + 2 * 37  # divisible by the world size, not by anything convenient


def _inputs(dtype: Any, numel: int, seed: int) -> list[Any]:
    """Every rank's input for one case (each rank can rebuild all of them)."""
    import torch

    out = []
    for r in range(WORLD):
        g = torch.Generator().manual_seed(seed * 100 + r)
        out.append((torch.randn(numel, generator=g) * 4).to(dtype))
    return out


def _sum_reference(tensors: list[Any]) -> Any:
    # Two ranks: one addition, computed exactly in fp64 and rounded once, as gloo does.
    assert len(tensors) == 2
    return (tensors[0].double() + tensors[1].double()).to(tensors[0].dtype)


def _check_equal(actual: Any, expected: Any, what: str) -> None:
    import torch

    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


_subgroup: Any = None


def _group(kind: str) -> Any:
    """None (the world) or an explicit group object over all ranks (created once, collectively)."""
    global _subgroup
    if kind == "world":
        return None
    if _subgroup is None:
        from shardwise import comm

        _subgroup = comm.new_group(list(range(WORLD)))
    return _subgroup


def _collective_case(rank: int, world_size: int, case: dict[str, Any]) -> Any:
    import torch

    from shardwise import comm

    kind = case["kind"]
    dtype = getattr(torch, case.get("dtype", "float32"))
    seed = case.get("seed", 0)
    group = _group(case.get("group", "world"))

    def finish(handle: Any) -> None:
        if case.get("async_op"):
            assert isinstance(handle, comm.CommHandle), f"async call returned {handle!r}"
            assert not handle.is_completed()
            assert handle.wait() is True
            assert handle.is_completed()
            handle.wait()  # a second wait must not repeat the finishing step
        else:
            assert handle is None

    if kind == "ranges_without_exchange":
        # reduce_scatter_ranges' NCCL path (a reduce-scatter for equal shards, else an all-reduce of a
        # scratch copy), run here over gloo by turning the point-to-point exchange off
        from unittest import mock

        from shardwise.comm import collectives

        owned = [tuple(r) for r in case["owned"]]
        inputs = [torch.arange(10, dtype=dtype) * (r + 1) for r in range(world_size)]
        total = _sum_reference(inputs)
        lo, hi = owned[rank]
        buffer = inputs[rank].clone()
        out = torch.full((hi - lo,), float("nan"), dtype=dtype) if case["out"] else None
        with mock.patch.object(collectives, "_point_to_point_exchange", lambda *_: False):
            finish(comm.reduce_scatter_ranges(buffer, owned, group, case["async_op"], out=out))
        mine = buffer[lo:hi] if out is None else out
        _check_equal(mine, total[lo:hi], f"ranges {case}")
        if out is not None:
            _check_equal(buffer, inputs[rank], f"ranges {case}: the buffer is left alone")
        else:
            rest = torch.cat([buffer[:lo], buffer[hi:]])
            _check_equal(rest, torch.cat([inputs[rank][:lo], inputs[rank][hi:]]), f"ranges {case}: the rest")
        return True
    if kind == "reduce_scatter":
        inputs = _inputs(dtype, NUMEL, seed)
        full = _sum_reference(inputs)
        if case["op"] == "avg":
            full = (full.double() / world_size).to(dtype)
        n = NUMEL // world_size
        expected = full[rank * n : (rank + 1) * n]
        inp = inputs[rank].clone()
        if case.get("output_view"):
            out = inp[rank * n : (rank + 1) * n]  # output aliases this rank's slice of input
        else:
            out = torch.full((n,), float("nan"), dtype=dtype)
        handle = comm.reduce_scatter_flat(
            out,
            inp,
            group,
            case["async_op"],
            op=case["op"],
            input_is_scratch=case["scratch"],
            algorithm=case["algorithm"],
        )
        finish(handle)
        _check_equal(out, expected, f"reduce_scatter {case}")
        if not case["scratch"] and not case.get("output_view"):
            _check_equal(inp, inputs[rank], "input must be left intact when input_is_scratch=False")
        return float(out.double().sum())

    if kind == "all_gather":
        inputs = _inputs(dtype, NUMEL // world_size, seed)
        expected = torch.cat(inputs)
        out = torch.full((NUMEL,), float("nan"), dtype=dtype)
        n = NUMEL // world_size
        if case.get("shard_view"):
            shard = out[rank * n : (rank + 1) * n]
            shard.copy_(inputs[rank])
        else:
            shard = inputs[rank].clone()
        handle = comm.all_gather_flat(out, shard, group, case["async_op"], algorithm=case["algorithm"])
        finish(handle)
        _check_equal(out, expected, f"all_gather {case}")
        return float(out.double().sum())

    if kind == "all_reduce":
        inputs = _inputs(dtype, 301, seed)
        t = inputs[rank].clone()
        if case["op"] == "max":
            expected = torch.maximum(inputs[0], inputs[1])
        else:
            expected = _sum_reference(inputs)
            if case["op"] == "avg":
                expected = (expected.double() / world_size).to(dtype)
        handle = comm.all_reduce(t, op=case["op"], group=group, async_op=case["async_op"])
        finish(handle)
        _check_equal(t, expected, f"all_reduce {case}")
        return float(t.double().sum())

    if kind == "deepspeed_names":
        inputs = _inputs(dtype, NUMEL, seed)
        n = NUMEL // world_size
        out = torch.empty(n, dtype=dtype)
        comm.reduce_scatter_tensor(out, inputs[rank].clone(), op=comm.ReduceOp.AVG)
        avg = (_sum_reference(inputs).double() / world_size).to(dtype)
        _check_equal(out, avg[rank * n : (rank + 1) * n], "reduce_scatter_tensor AVG")
        full = torch.empty(NUMEL, dtype=dtype)
        comm.all_gather_into_tensor(full, out)
        _check_equal(full, avg, "all_gather_into_tensor")
        t = inputs[rank].clone()
        comm.all_reduce(t, op=comm.ReduceOp.SUM)
        _check_equal(t, _sum_reference(inputs), "all_reduce ReduceOp.SUM")
        return True

    if kind == "max_flag":
        flags = case["flags"]
        got = comm.all_reduce_max_flag(flags[rank], group=group)
        assert got is any(flags), f"flags {flags}: got {got}"
        return got

    if kind == "broadcast":
        t = torch.full((5,), float(rank + 1), dtype=dtype)
        handle = comm.broadcast(t, src=1, group=group, async_op=case["async_op"])
        finish(handle)
        _check_equal(t, torch.full((5,), 2.0, dtype=dtype), "broadcast from rank 1")
        return True

    if kind == "errors":
        # Validation happens before any communication, so a bad call raises on every rank
        # without leaving a partner waiting in a collective.
        checks = [
            (
                lambda: comm.reduce_scatter_flat(torch.empty(3), torch.empty(7)),
                "not divisible by the group size 2",
            ),
            (lambda: comm.reduce_scatter_flat(torch.empty(3), torch.empty(8)), "must have 4"),
            (
                lambda: comm.all_gather_flat(torch.empty(7), torch.empty(3)),
                "not divisible by the group size 2",
            ),
            (lambda: comm.all_gather_flat(torch.empty(8), torch.empty(3)), "must have 4"),
            (
                lambda: comm.all_gather_flat(torch.empty(8), torch.empty(4, dtype=torch.bfloat16)),
                "share dtype",
            ),
            (lambda: comm.reduce_scatter_flat(torch.empty(2), torch.empty(4, 2).t()), "contiguous"),
            (lambda: comm.reduce_scatter_flat(torch.empty(2), torch.empty(4), op="max"), "'sum' or 'avg'"),
            (lambda: comm.all_reduce(torch.ones(2), op="prod"), "not supported"),
            (lambda: comm.all_reduce(torch.ones(2, dtype=torch.int64), op="avg"), "floating-point"),
            (lambda: comm.all_gather_flat(torch.empty(8), torch.empty(4), algorithm="ring"), "algorithm"),
        ]
        for call, needle in checks:
            try:
                call()
            except ValueError as exc:
                assert needle in str(exc), f"expected {needle!r} in {exc}"
            else:
                raise AssertionError(f"no ValueError (wanted {needle!r})")
        comm.barrier()  # still in step with the other rank
        return len(checks)

    if kind == "adopt_and_topology":
        comm.init_distributed()  # the harness created the group: adopted, not re-created
        assert comm.is_initialized()
        assert (comm.get_rank(), comm.get_world_size()) == (rank, world_size)
        assert comm.get_local_rank() == int(os.environ["LOCAL_RANK"])
        plain = comm.build_topology()
        assert (plain.world_rank, plain.world_size, plain.dp_rank, plain.dp_size) == (rank, 2, rank, 2)
        assert (plain.dp_group, plain.shard_group, plain.mp_size, plain.sp_size) == (None, None, 1, 1)
        world = comm.get_world_group()
        mp = comm.build_topology(_MegatronMpu(world))
        assert (mp.dp_size, mp.dp_rank, mp.dp_group, mp.mp_size) == (2, rank, world, 1)
        assert (mp.shard_group, mp.shard_size) == (world, 2)
        ulysses = comm.build_topology(_UlyssesMpu(world))
        assert (ulysses.dp_size, ulysses.dp_rank, ulysses.sp_size, ulysses.sp_rank) == (1, 0, 2, rank)
        assert (ulysses.shard_group, ulysses.shard_size, ulysses.shard_rank) == (world, 2, rank)
        assert plain.dims == comm.ParallelDims(dp_shard=2, world_size=2)
        assert mp.dims == comm.ParallelDims(dp_shard=2, world_size=2)
        assert ulysses.dims == comm.ParallelDims(dp_shard=1, sp=2, world_size=2)
        mesh = plain.data_parallel_mesh("cpu")
        assert (mesh.mesh_dim_names, mesh.size(), mesh.get_local_rank()) == (("dp_shard",), 2, rank)
        comm.groups.set_topology(mp)
        try:
            assert (comm.groups.get_data_parallel_group(), comm.groups.get_data_parallel_rank()) == (
                world,
                rank,
            )
        finally:
            comm.groups.clear_topology()
        return True

    raise AssertionError(f"unknown case kind {kind!r}")


class _MegatronMpu:
    """A data-parallel-only mpu with DeepSpeed's methods (model parallel size 1)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def get_data_parallel_group(self) -> Any:
        return self.group

    def get_data_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self.group)

    def get_data_parallel_world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(self.group)

    def get_model_parallel_group(self) -> Any:
        return None

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1


class _UlyssesMpu:
    """A sequence-parallel mpu over both ranks: no get_data_parallel_world_size."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def get_sequence_parallel_group(self) -> Any:
        return self.group

    def get_sequence_parallel_world_size(self) -> int:
        return 2

    def get_sequence_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()

    def get_sequence_data_parallel_group(self) -> Any:
        return self.group

    def get_sequence_data_parallel_world_size(self) -> int:
        return 2

    def get_sequence_data_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()


def _cases() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    seed = 0
    for dtype in ("float32", "bfloat16"):
        for async_op in (False, True):
            for algorithm in ("native", "all_reduce", "exchange", "auto"):
                for scratch in (False, True):
                    for op in ("sum", "avg"):
                        seed += 1
                        cases.append(
                            {
                                "kind": "reduce_scatter",
                                "dtype": dtype,
                                "async_op": async_op,
                                "algorithm": algorithm,
                                "scratch": scratch,
                                "op": op,
                                "seed": seed,
                            }
                        )
                seed += 1
                cases.append(
                    {
                        "kind": "all_gather",
                        "dtype": dtype,
                        "async_op": async_op,
                        "algorithm": algorithm,
                        "seed": seed,
                    }
                )
            for op in ("sum", "avg", "max"):
                seed += 1
                cases.append(
                    {"kind": "all_reduce", "dtype": dtype, "async_op": async_op, "op": op, "seed": seed}
                )
            cases.append({"kind": "broadcast", "dtype": dtype, "async_op": async_op})
    for algorithm in ("native", "all_reduce", "exchange"):
        # In-place forms and an explicit group object.
        seed += 1
        cases.append(
            {
                "kind": "reduce_scatter",
                "async_op": False,
                "algorithm": algorithm,
                "scratch": True,
                "op": "avg",
                "seed": seed,
                "output_view": True,
                "group": "explicit",
            }
        )
        seed += 1
        cases.append(
            {"kind": "all_gather", "async_op": True, "algorithm": algorithm, "seed": seed, "shard_view": True}
        )
        cases.append(
            {
                "kind": "all_gather",
                "async_op": False,
                "algorithm": algorithm,
                "seed": seed,
                "group": "explicit",
            }
        )
    for owned in ([(0, 5), (5, 10)], [(0, 3), (3, 10)], [(2, 4), (6, 9)]):
        for out in (False, True):
            cases.append({"kind": "ranges_without_exchange", "owned": owned, "out": out, "async_op": out})
    cases.append({"kind": "deepspeed_names", "seed": 999})
    for flags in ([False, False], [True, False], [False, True], [True, True]):
        cases.append({"kind": "max_flag", "flags": flags})
    cases.append({"kind": "max_flag", "flags": [False, True], "group": "explicit"})
    cases.append({"kind": "errors"})
    cases.append({"kind": "adopt_and_topology"})
    return cases


CASES = _cases()


def test_collectives_grid() -> None:
    results = run_distributed_cases(_collective_case, CASES, world_size=WORLD, timeout=120)
    assert len(results) == len(CASES)
    for case, per_rank in zip(CASES, results):
        if case["kind"] == "reduce_scatter":
            # The two shards are different halves of the same reduced buffer.
            assert per_rank[0] != per_rank[1], case
        elif case["kind"] in ("all_gather", "all_reduce", "max_flag"):
            assert per_rank[0] == per_rank[1], case  # every rank ends with the same result
        elif case["kind"] == "errors":
            assert per_rank == [10, 10]
        else:
            assert per_rank == [True, True], case


# --------------------------------------------------------------------------------------
# init_distributed in fresh processes: no launcher at all, and an mpirun-like environment.
# --------------------------------------------------------------------------------------

_INIT_SCRIPT = r"""
import json, os, sys, warnings
warnings.simplefilter("error")  # e.g. FutureWarnings from deprecated collective names
import torch
import torch.distributed as dist
from shardwise import comm

drains = []  # destroy_process_group's drain of point-to-point messages (monitored_barrier calls)
_monitored_barrier = dist.monitored_barrier
dist.monitored_barrier = lambda *a, **k: drains.append(1) or _monitored_barrier(*a, **k)


def phase():
    comm.init_distributed(dist_backend="gloo")
    rank, world = comm.get_rank(), comm.get_world_size()
    t = torch.full((4,), float(rank + 1))
    comm.all_reduce(t, op="avg")
    shard = torch.empty(4 // world)
    full = torch.arange(4.0) * (rank + 1)
    comm.reduce_scatter_flat(shard, full, input_is_scratch=True)
    gathered = torch.empty(4)
    comm.all_gather_flat(gathered, shard)
    result = {
        "rank": rank, "world": world, "local_rank": comm.get_local_rank(),
        "avg": t.tolist(), "gathered": gathered.tolist(),
        "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")},
    }
    before = len(drains)
    comm.destroy_process_group()
    assert not comm.is_initialized()
    result["drains"] = len(drains) - before
    return result


launched = phase()  # as started: an mpirun-like environment
# Then as a plain `python script.py`: no launcher variables at all.
for name in list(os.environ):
    if name.startswith("OMPI_") or name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                            "MASTER_ADDR", "MASTER_PORT"):
        del os.environ[name]
alone = phase()
print(json.dumps({"launched": launched, "alone": alone}))
"""

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCHER_VARS and not k.startswith(("OMPI_", "PMI_", "MPI_LOCAL", "SLURM_"))
    }
    env.update({"OMP_NUM_THREADS": "1", "SHARDWISE_TIMEOUT_SECONDS": "30", "CUDA_VISIBLE_DEVICES": ""})
    src = os.path.dirname(os.path.dirname(os.path.abspath(shardwise.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([src, *sys.path])
    return env


def test_init_distributed_mpirun_environment_then_single_process() -> None:
    """Two processes with OpenMPI's variables form a 2-rank world; after teardown and with
    every launcher variable removed, each re-initialises as a world of one."""
    port = find_free_port()
    procs = []
    for rank in range(2):
        env = _clean_env()
        env.update(
            {
                "OMPI_COMM_WORLD_RANK": str(rank),
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                "MASTER_PORT": str(port),  # MASTER_ADDR left out: one node, so loopback
            }
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _INIT_SCRIPT],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, f"exit {proc.returncode}\n{err}"
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()

    for rank, both in enumerate(outputs):
        got = both["launched"]
        assert (got["rank"], got["world"], got["local_rank"]) == (rank, 2, rank)
        assert got["avg"] == [1.5] * 4
        assert got["gathered"] == [0.0, 3.0, 6.0, 9.0]  # arange(4) * (1 + 2)
        assert got["drains"] == 1  # 2 gloo ranks exchanged point to point: teardown waits for both
        assert got["env"] == {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
        }
        one = both["alone"]
        assert (one["rank"], one["world"], one["local_rank"]) == (0, 1, 0)
        assert one["avg"] == [1.0] * 4
        assert one["gathered"] == [0.0, 1.0, 2.0, 3.0]
        assert one["drains"] == 0  # a world of one sent nothing: no barrier
        assert one["env"] == {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
