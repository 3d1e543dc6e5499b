"""One rank of one engine-core benchmark case (run by ``engine_core.py``; not for direct use).

Invoked as ``python engine_core_worker.py '<json spec>'`` with the launcher variables (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) in the environment, writes its measurements as
JSON to ``spec["out"]``. The same file runs under the project venv (shardwise and the torch
peers) and under ``.venv-ds`` (DeepSpeed), so it imports only the standard library at module
level and loads the benchmark model from its file path rather than through ``shardwise``.

What a case measures on each rank:

* ``init``: wall time from the parent's ``Popen`` of this rank (``BENCH_T_LAUNCH``) to "engine
  ready" (process group up, model built and wrapped, optimizer created), split into the import
  phase and the build phase.
* ``step``: wall time of each optimizer step (all ``GAS`` micro batches: forward, backward and
  the framework's step call), after ``warmup`` untimed steps.
* ``opt``: time spent inside the innermost ``torch.optim.Optimizer.step`` calls of each step,
  caught with torch's global optimizer step hooks, and the bytes AdamW moves there
  (parameter, gradient, both moments read; parameter and moments written).
* ``mem``: bytes of every distinct tensor storage reachable from what the framework holds
  (engine/module, optimizer, FSDP2 state), taken after the boundary backward of step 2, when
  parameters, gradients and optimizer state all exist.
* ``losses``: the mean micro-batch loss of every step on this rank.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib.util
import json
import os
import sys
import time
import traceback
import types
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_models import load_models  # this script's directory is on sys.path
from step_parts import StepPartTimer

# How far the model-state walker follows references from its roots, and how many objects it
# visits at most (a guard against wandering into unrelated global state).
_WALK_MAX_DEPTH = 16
_WALK_MAX_OBJECTS = 500_000


# --------------------------------------------------------------------------- measurement helpers


class OptimizerStepTimer:
    """Times the innermost ``torch.optim.Optimizer.step`` calls via torch's global step hooks.

    Wrappers (ZeroRedundancyOptimizer around AdamW, an engine's own optimizer around torch's)
    nest: the outer step's hooks fire around the inner one's. Only calls at the deepest nesting
    level seen in a step count, so the time is the AdamW kernel's, not the wrapper's
    communication.
    """

    def __init__(self) -> None:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self._open: list[float] = []
        self.records: list[tuple[int, float, int]] = []  # (depth, seconds, bytes moved)
        self._handles = [
            register_optimizer_step_pre_hook(self._pre),
            register_optimizer_step_post_hook(self._post),
        ]

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._open.append(time.perf_counter())

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        t0 = self._open.pop()
        self.records.append((len(self._open), time.perf_counter() - t0, self._bytes_moved(optimizer)))

    def _bytes_moved(self, optimizer: Any) -> int:
        total = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                local = _local(p)
                # AdamW reads p, g, m, v and writes p, m, v: 7 tensors of the parameter's size.
                total += 7 * local.numel() * local.element_size()
        return total

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def take(self) -> tuple[float, int]:
        """Seconds and bytes of the innermost optimizer steps since the last call."""
        records, self.records = self.records, []
        if not records:
            return 0.0, 0
        deepest = max(depth for depth, _, _ in records)
        inner = [(dt, nbytes) for depth, dt, nbytes in records if depth == deepest]
        return sum(dt for dt, _ in inner), sum(nbytes for _, nbytes in inner)


def _local(t: Any) -> Any:
    """The local shard of a DTensor, or the tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local


def model_state_bytes(roots: list[Any]) -> int:
    """Bytes of all distinct, allocated tensor storages reachable from ``roots``.

    Follows object attributes, containers, tensor ``.grad`` and tensor attributes (DeepSpeed
    hangs its partitions on parameters), bound methods, ``functools.partial`` and closure cells
    (hooks often keep their buffers only there). Storages are de-duplicated by address, so
    views of one flat buffer count once; storages freed by resizing to zero (FSDP2's unsharded
    parameters between steps) count nothing. Of shardwise's shared-memory buffers
    (``SharedBuffers``, every rank's buffer mapped in every rank) only this rank's own counts, and
    only while it holds memory (``resident``: stage 2's gradient staging gives it back after each
    reduction).
    """
    import torch

    storages: dict[int, int] = {}
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(root, 0) for root in roots]
    skip = (str, bytes, int, float, bool, complex, type(None), type, types.ModuleType, torch.dtype)
    while stack and len(seen) < _WALK_MAX_OBJECTS:
        obj, depth = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            local = getattr(obj, "_local_tensor", None)
            if local is not None:
                stack.append((local, depth))
            else:
                with contextlib.suppress(RuntimeError, NotImplementedError):
                    storage = obj.untyped_storage()
                    if storage.data_ptr() != 0 and storage.nbytes() > 0:
                        ptr = storage.data_ptr()
                        storages[ptr] = max(storages.get(ptr, 0), storage.nbytes())
            if obj.is_leaf and obj.grad is not None:
                stack.append((obj.grad, depth))
            extra = getattr(obj, "__dict__", None)
            if extra:
                stack.extend((v, depth + 1) for v in extra.values())
            continue
        if depth >= _WALK_MAX_DEPTH:
            continue
        if type(obj).__name__ == "SharedBuffers":
            # shardwise's shared-memory buffers map every rank's buffer; the others' are their memory;
            # a released one (stage 2's gradient staging between reductions) holds none
            if getattr(obj, "resident", True):
                stack.append((obj.mine, depth + 1))
            continue
        children: list[Any] = []
        if isinstance(obj, dict):
            children = [*obj.keys(), *obj.values()]
        elif isinstance(obj, list | tuple | set | frozenset | deque):
            children = list(obj)
        elif isinstance(obj, functools.partial):
            children = [obj.func, *obj.args, *obj.keywords.values()]
        elif isinstance(obj, types.MethodType):
            children = [obj.__self__, obj.__func__]
        elif isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                with contextlib.suppress(ValueError):
                    children.append(cell.cell_contents)
        else:
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict):
                children = list(attrs.values())
            for slot in getattr(type(obj), "__slots__", ()) or ():
                if isinstance(slot, str) and hasattr(obj, slot):
                    children.append(getattr(obj, slot))
        stack.extend((child, depth + 1) for child in children)
    return sum(storages.values())


# --------------------------------------------------------------------------- the data


class Data:
    """The deterministic micro batches: rank r's micro batch m of step s, the same in every case."""

    def __init__(self, models: types.ModuleType, spec: dict[str, Any]) -> None:
        self.world = int(spec["world_size"])
        self.micro = int(spec["micro_batch"])
        self.gas = int(spec["gas"])
        steps = int(spec["warmup"]) + int(spec["steps"])
        samples = steps * self.gas * self.world * self.micro
        vocab = int(gpt_config(models, spec).vocab_size)
        self.dataset = models.TokenDataset(samples, int(spec["seq_len"]), vocab, seed=int(spec["data_seed"]))

    def batch(self, step: int, micro: int, rank: int) -> tuple[Any, Any]:
        start = ((step * self.gas + micro) * self.world + rank) * self.micro
        rows = self.dataset.data[start : start + self.micro]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def global_batch(self, step: int, micro: int) -> tuple[Any, Any]:
        """All ranks' micro batches of (step, micro), concatenated in rank order."""
        import torch

        parts = [self.batch(step, micro, r) for r in range(self.world)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


# --------------------------------------------------------------------------- the runners
# Each runner builds its framework in __init__ (timed as "build") and runs one micro batch in
# micro(); `before_step` is called after the boundary micro batch's backward, just before the
# optimizer step, so the memory walk sees gradients and optimizer state together.


def _adamw_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    opt = spec["optimizer"]
    return {
        "lr": opt["lr"],
        "betas": tuple(opt["betas"]),
        "eps": opt["eps"],
        "weight_decay": opt["weight_decay"],
        "fused": True,
    }


def _ds_style_config(spec: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed-format config that both shardwise and DeepSpeed receive."""
    opt = spec["optimizer"]
    return {
        "train_micro_batch_size_per_gpu": spec["micro_batch"],
        "gradient_accumulation_steps": spec["gas"],
        "gradient_clipping": spec["clip"],
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": opt["lr"],
                "betas": list(opt["betas"]),
                "eps": opt["eps"],
                "weight_decay": opt["weight_decay"],
                # DeepSpeed's default FusedAdam is a JIT-compiled op; torch's fused AdamW kernel
                # is the fastest CPU AdamW both frameworks can run, and what the torch peers use.
                "torch_adam": True,
                "fused": True,
            },
        },
        "bf16": {"enabled": bool(spec["bf16"])},
        "zero_optimization": {"stage": spec["stage"], **_overlap_comm(spec), **spec.get("zero_extra", {})},
        # --zeropp rows: the comms logger counts the bytes every collective sends
        **({"comms_logger": {"enabled": True}} if spec.get("count_bytes") else {}),
    }


def _overlap_comm(spec: dict[str, Any]) -> dict[str, Any]:
    """``--overlap-comm``: ``zero_optimization.overlap_comm`` of the stage 1-2 rows (shardwise and
    DeepSpeed alike); absent when not given (DeepSpeed's default: false at stages 1-2)."""
    value = spec.get("overlap_comm")
    return {} if value is None or spec["stage"] not in (1, 2) else {"overlap_comm": bool(value)}


def _ensure_process_group() -> None:
    """Start the gloo process group unless an earlier case of this job already did."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")


def gpt_config(models: types.ModuleType, spec: dict[str, Any]) -> Any:
    """``{"preset": "gpt_17m"}`` names a preset function of models.py; anything else is GPTConfig's fields."""
    shape = dict(spec["model"])
    preset = shape.pop("preset", None)
    return getattr(models, preset)() if preset else models.GPTConfig(**shape)


def build_model(models: types.ModuleType, spec: dict[str, Any]) -> Any:
    """The benchmark GPT, initialised from the case's seed (identical in every case)."""
    import torch

    torch.manual_seed(spec["seed"])
    return models.TinyGPT(gpt_config(models, spec))


class _TorchPeer:
    """Shared loop of the plain-torch peers: autocast forward, loss / GAS backward, clip, step."""

    model: Any
    wrapped: Any
    optimizer: Any

    def __init__(self, spec: dict[str, Any], models: types.ModuleType) -> None:
        import torch

        self.torch = torch
        self.spec = spec
        self.gas = int(spec["gas"])
        self.bf16 = bool(spec["bf16"])

    def _no_sync(self, boundary: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def micro(self, x: Any, y: Any, boundary: bool, before_step: Callable[[], None] | None) -> float:
        torch = self.torch
        with self._no_sync(boundary):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self._autocast()):
                loss = self.wrapped(x, y)
            (loss / self.gas).backward()
        if boundary:
            if before_step is not None:
                before_step()
            self._clip()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def _autocast(self) -> bool:
        return self.bf16

    def _clip(self) -> None:
        if self.spec["clip"] > 0:  # --clip 0: no clipping (as gradient_clipping 0 in the engines)
            self.torch.nn.utils.clip_grad_norm_(self.wrapped.parameters(), self.spec["clip"])

    def roots(self) -> list[Any]:
        return [self.wrapped, self.optimizer]


class DDPRunner(_TorchPeer):
    """Stage-0 peer: DistributedDataParallel + fused AdamW; ``no_sync`` off the GA boundary."""

    def __init__(self, spec: dict[str, Any], models: types.ModuleType) -> None:
        super().__init__(spec, models)
        from torch.nn.parallel import DistributedDataParallel as DDP

        _ensure_process_group()
        self.model = build_model(models, spec)
        # Gradients as views of the reducer's buckets: no second copy of the gradients.
        self.wrapped = DDP(self.model, gradient_as_bucket_view=True)
        self.optimizer = self._make_optimizer()

    def _make_optimizer(self) -> Any:
        return self.torch.optim.AdamW(self.wrapped.parameters(), **_adamw_kwargs(self.spec))

    def _no_sync(self, boundary: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if boundary else self.wrapped.no_sync()


class ZeroRunner(DDPRunner):
    """Stage-1 peer: DDP (full gradients) + ZeroRedundancyOptimizer sharding AdamW's state."""

    def _make_optimizer(self) -> Any:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            self.wrapped.parameters(), optimizer_class=self.torch.optim.AdamW, **_adamw_kwargs(self.spec)
        )

    def roots(self) -> list[Any]:
        return [self.wrapped, self.optimizer, self.optimizer.optim]


class FSDP2Runner(_TorchPeer):
    """Stage-2 peer: FSDP2 ``fully_shard`` per block and at the root, reshard_after_forward=False
    (parameters stay gathered from forward to backward, gradients and optimizer state sharded:
    the SHARD_GRAD_OP / ZeRO-2 layout). bf16 is MixedPrecisionPolicy(param_dtype=bf16), which also
    reduce-scatters in bf16; off the GA boundary gradient sync is disabled (unsharded gradients
    accumulate locally), FSDP2's equivalent of ``no_sync``."""

    def __init__(self, spec: dict[str, Any], models: types.ModuleType) -> None:
        super().__init__(spec, models)
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        _ensure_process_group()
        self.model = build_model(models, spec)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if self.bf16 else MixedPrecisionPolicy()
        for block in self.model.blocks:
            fully_shard(block, reshard_after_forward=False, mp_policy=mp)
        fully_shard(self.model, reshard_after_forward=False, mp_policy=mp)
        self.wrapped = self.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **_adamw_kwargs(spec))

    def _autocast(self) -> bool:
        return False  # FSDP2 casts parameters itself (param_dtype)

    def _no_sync(self, boundary: bool) -> contextlib.AbstractContextManager[Any]:
        self.model.set_requires_gradient_sync(boundary)
        return contextlib.nullcontext()

    def roots(self) -> list[Any]:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        # FSDP2 keeps its per-module state (sharded/unsharded buffers) outside the module's
        # attributes; add it explicitly.
        states = [fully_shard.state(m) for m in self.model.modules() if isinstance(m, FSDPModule)]  # type: ignore[attr-defined]
        return [self.model, self.optimizer, *states]


class FSDP2Zero3Runner(FSDP2Runner):
    """Stage-3 peer: FSDP2 used directly with per-block wrapping and default resharding
    (blocks reshard after forward: parameters, gradients and optimizer state all sharded,
    the FULL_SHARD / ZeRO-3 layout); otherwise as :class:`FSDP2Runner`."""

    def __init__(self, spec: dict[str, Any], models: types.ModuleType) -> None:
        _TorchPeer.__init__(self, spec, models)
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        _ensure_process_group()
        self.model = build_model(models, spec)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if self.bf16 else MixedPrecisionPolicy()
        for block in self.model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(self.model, mp_policy=mp)
        self.wrapped = self.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **_adamw_kwargs(spec))


class ReferenceRunner(_TorchPeer):
    """One process, the whole global batch per micro step, fp32, fused AdamW, same clipping."""

    def __init__(self, spec: dict[str, Any], models: types.ModuleType) -> None:
        super().__init__(spec, models)
        import torch

        self.model = build_model(models, spec)
        self.wrapped = self.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **_adamw_kwargs(spec))
        self.bf16 = False


class _EngineRunner:
    """DeepSpeed's API, used exactly as documented: engine(x, y); backward; step per micro batch."""

    def __init__(self, spec: dict[str, Any], models: types.ModuleType, lib: Any) -> None:
        model = build_model(models, spec)
        self.params = sum(p.numel() for p in model.parameters())
        self.engine, self.optimizer, _, _ = lib.initialize(
            model=model, model_parameters=model.parameters(), config=_ds_style_config(spec)
        )

    def micro(self, x: Any, y: Any, boundary: bool, before_step: Callable[[], None] | None) -> float:
        loss = self.engine(x, y)
        self.engine.backward(loss)
        if boundary and before_step is not None:
            before_step()
        self.engine.step()
        return float(loss.detach().float())

    def roots(self) -> list[Any]:
        return [self.engine, self.optimizer]


class ShardwiseRunner(_EngineRunner):
    """shardwise through its DeepSpeed-compatible API; its own ``init_distributed`` when it has one."""

    def __init__(self, spec: dict[str, Any], models: types.ModuleType) -> None:
        import shardwise

        init = getattr(shardwise, "init_distributed", None)
        if init is not None:
            init(dist_backend="gloo")
        else:
            _ensure_process_group()
        super().__init__(spec, models, shardwise)


class DeepSpeedRunner(_EngineRunner):
    """DeepSpeed on CPU (the driver sets ``DS_ACCELERATOR=cpu``) over gloo."""

    def __init__(self, spec: dict[str, Any], models: types.ModuleType) -> None:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        super().__init__(spec, models, deepspeed)


RUNNERS: dict[str, Callable[[dict[str, Any], types.ModuleType], Any]] = {
    "shardwise": ShardwiseRunner,
    "ddp": DDPRunner,
    "zero": ZeroRunner,
    "fsdp2": FSDP2Runner,
    "fsdp2_zero3": FSDP2Zero3Runner,
    "deepspeed": DeepSpeedRunner,
    "reference": ReferenceRunner,
}

# Modules each framework imports before building: timed as the import phase of init.
_IMPORTS = {
    "shardwise": ["shardwise"],
    "deepspeed": ["deepspeed"],
    "fsdp2": ["torch.distributed.fsdp"],
    "fsdp2_zero3": ["torch.distributed.fsdp"],
    "zero": ["torch.distributed.optim", "torch.nn.parallel"],
    "ddp": ["torch.nn.parallel"],
    "reference": [],
}


# --------------------------------------------------------------------------- the case


def run_case(spec: dict[str, Any], models: types.ModuleType, t_launch: float, first: bool) -> dict[str, Any]:
    """Build the case's framework, run warm-up + measured steps, return this rank's numbers.

    ``first``: the first case of this process; its import phase is timed (later cases of a
    grouped job reuse the imports, and report the first case's import time).
    """
    import torch

    framework = spec["framework"]
    rank = int(os.environ.get("RANK", "0"))
    for name in _IMPORTS[framework]:
        importlib.import_module(name)
    t_imported = time.time()
    runner = RUNNERS[framework](spec, models)
    t_ready = time.time()
    torch.set_num_threads(1)  # a framework may have changed it while building

    data = Data(models, spec)
    gas, warmup, steps = int(spec["gas"]), int(spec["warmup"]), int(spec["steps"])
    timer = OptimizerStepTimer()
    parts = StepPartTimer(runner.engine.optimizer) if framework == "shardwise" else None
    mem: dict[str, int] = {}

    def measure_memory() -> None:
        t0 = time.perf_counter()
        mem["bytes"] = model_state_bytes(runner.roots())
        mem["walk_ms"] = int(1e3 * (time.perf_counter() - t0))

    losses: list[float] = []
    step_s: list[float] = []
    opt_s: list[float] = []
    opt_bytes = 0
    parts_s: list[dict[str, float]] = []
    parts_bytes: dict[str, int] = {}
    for step in range(warmup + steps):
        if framework == "reference":
            batches = [data.global_batch(step, m) for m in range(gas)]
        else:
            batches = [data.batch(step, m, rank) for m in range(gas)]
        # The memory walk happens once, in step index 1 (optimizer state exists from step 0 on),
        # which is a warm-up step: the walk's time never enters the measured steps.
        hook = measure_memory if step == 1 else None
        if step == warmup and spec.get("count_bytes"):
            _reset_comms_log()
        t0 = time.perf_counter()
        step_losses = [runner.micro(x, y, m == gas - 1, hook) for m, (x, y) in enumerate(batches)]
        dt = time.perf_counter() - t0
        opt_dt, nbytes = timer.take()
        part_dt, parts_bytes = parts.take() if parts is not None else ({}, {})
        losses.append(sum(step_losses) / gas)
        if step >= warmup:
            step_s.append(dt)
            opt_s.append(opt_dt)
            opt_bytes = nbytes
            parts_s.append(part_dt)
    timer.remove()
    # The same processes, right after the steps, under the same machine load: the optimizer's
    # bandwidth is compared with this, not with a triad measured minutes earlier.
    t_triad = time.perf_counter()
    triad = (
        concurrent_triad_Bps(int(spec["triad_elements"]), int(spec["triad_reps"]))
        if framework != "reference"
        else None
    )
    t_triad = time.perf_counter() - t_triad

    params = runner.params if hasattr(runner, "params") else sum(p.numel() for p in runner.model.parameters())
    result = {
        "rank": rank,
        "fresh_process": first,
        "import_s": t_imported - t_launch,
        "build_s": t_ready - t_imported,
        "step_s": step_s,
        "opt_s": opt_s,
        "opt_bytes": opt_bytes,
        **({"parts_s": parts_s, "parts_bytes": parts_bytes} if parts is not None else {}),
        "triad_Bps": triad,
        "triad_s": t_triad,
        "mem_walk_s": mem.get("walk_ms", 0) / 1e3,
        "mem_bytes": mem.get("bytes", 0),
        "params": params,
        "losses": losses,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if framework == "deepspeed":
        import deepspeed

        result["deepspeed"] = deepspeed.__version__
    if spec.get("count_bytes"):
        result["wire_bytes_per_step"] = _wire_bytes(int(spec["world_size"]), steps)
    return result


def _reset_comms_log() -> None:
    import shardwise

    shardwise.comm.reset_log()


def _wire_bytes(world: int, steps: int) -> dict[str, int]:
    """Bytes this rank sent per measured step, per collective, from shardwise's comms logger: an
    all-gather / reduce-scatter record is one rank's part (W - 1 parts leave), an all-to-all record
    the whole buffer ((W - 1) / W of it leaves), an all-reduce ~2 (W - 1) / W of the tensor."""
    from shardwise.comm.comms_logger import COMMS_LOGGER

    share = {"all_to_all_single": (world - 1) / world, "all_reduce": 2 * (world - 1) / world}
    out = {}
    for op, by_size in COMMS_LOGGER.records.items():
        total = sum(size * len(entries) for size, entries in by_size.items())
        out[op] = int(total * share.get(op, world - 1) / max(1, steps))
    return out


def run_job(spec: dict[str, Any], t_launch: float, out: Path) -> None:
    """Run the job's cases in order, appending one JSON line per finished case to ``out``."""
    import torch

    torch.set_num_threads(1)
    models = load_models(spec["models_path"])
    import_s: float | None = None
    for index, case in enumerate(spec["cases"]):
        try:
            result = run_case(dict(spec, **case), models, t_launch, first=index == 0)
        except BaseException:
            out.with_suffix(".error").write_text(
                json.dumps({"case": index, "traceback": traceback.format_exc()})
            )
            raise
        gc.collect()  # the finished case's engine, before the next one allocates
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # the next case starts together on both ranks
        if import_s is None:
            import_s = result["import_s"]
        result["import_s"] = import_s
        with out.open("a") as handle:
            handle.write(json.dumps(result) + "\n")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def triad_Bps(n: int, reps: int) -> float:
    """STREAM triad ``a = b + s*c`` with torch on this process's one thread, in bytes/s.

    Counted as STREAM does: 2 arrays read and 1 written (3 x 4 bytes per element), no
    write-allocate traffic, and the best of ``reps`` runs (a run that another process preempted
    is not the memory system's bandwidth). ``n`` should make each array much larger than the
    last-level cache.
    """
    import torch

    a = torch.zeros(n)
    b = torch.full((n,), 1.5)
    c = torch.full((n,), 0.5)
    torch.add(b, c, alpha=3.0, out=a)  # every page touched before the timing
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        times.append(time.perf_counter() - t0)
    return 3 * 4 * n / min(times)


def concurrent_triad_Bps(n: int, reps: int) -> float:
    """Triad on every rank at once (started together), this rank's bandwidth."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    return triad_Bps(n, reps)


def run_triad(spec: dict[str, Any]) -> dict[str, Any]:
    """The stand-alone triad job: all ranks at once, then rank 0 alone."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    n, reps = int(spec["triad_elements"]), int(spec["triad_reps"])
    rank = int(os.environ.get("RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    together = concurrent_triad_Bps(n, reps)
    if dist.is_initialized():
        dist.barrier()
    alone = triad_Bps(n, reps) if rank == 0 else 0.0
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return {"rank": rank, "together_Bps": together, "alone_Bps": alone}


def main() -> None:
    t_launch = float(os.environ.get("BENCH_T_LAUNCH", time.time()))
    spec = json.loads(sys.argv[1])
    out = Path(spec["out"])
    if spec.get("framework") == "triad":
        try:
            out.write_text(json.dumps(run_triad(spec)) + "\n")
        except BaseException:
            out.with_suffix(".error").write_text(json.dumps({"case": 0, "traceback": traceback.format_exc()}))
            raise
    else:
        run_job(spec, t_launch, out)
    # Results are on disk and the process group is closed: skip the interpreter's teardown of
    # torch (a second or two per rank, per case, that would only lengthen the run).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
