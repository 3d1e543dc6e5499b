"""Stage-3 rows of the engine-core benchmark: shardwise stage 3 against FSDP2 and DeepSpeed stage 3.

Same workload, data, seeds, optimizer, clipping, launch model and columns as
``engine_core.py`` (it is driven by engine_core's own functions; see benchmarks/README.md):

    python benchmarks/stage3_bench.py                 # fp32/bf16 x GAS 1/4, gpt_17m
    python benchmarks/stage3_bench.py --quick         # the small GPT, fewer steps
    python benchmarks/stage3_bench.py --out stage3.json

Peers of stage 3:

| name | what it runs |
|---|---|
| shardwise | ``shardwise.initialize`` with ``zero_optimization.stage: 3`` and DeepSpeed's defaults for every other key (the same config DeepSpeed gets) |
| fsdp2_zero3 | FSDP2 used directly with per-block wrapping: ``fully_shard`` on each transformer block, then on the root, default ``reshard_after_forward`` (True for blocks: ZeRO-3), ``AdamW(fused=True)`` on the DTensor parameters, ``clip_grad_norm_(1.0)``, ``set_requires_gradient_sync(False)`` off the GA boundary; bf16 = ``MixedPrecisionPolicy(param_dtype=bf16)`` |
| deepspeed | ``deepspeed.initialize`` with the same config at stage 3 (``DS_ACCELERATOR=cpu``, gloo, torch's fused AdamW) |

Targets (shardwise rows): ``step``: median step time <= 0.95 x the best of the two peers
(same precision and GAS); ``mem``: fp32 model-state bytes per parameter <= 8.5 (DeepSpeed
measured 10). The other two columns (optimizer bandwidth, init time) are reported as in
the engine-core table.

The file is also the worker of its jobs: run with a JSON spec as its only argument it
registers the ``fsdp2_zero3`` runner with ``engine_core_worker`` and runs the case there.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import time
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
STAGE = 3
PEERS = ["fsdp2_zero3", "deepspeed"]
STEP_RATIO_TARGET = 0.95
MEM_TARGET_BYTES_PER_PARAM = 8.5

DESCRIPTIONS = {
    "shardwise": "shardwise.initialize(...) with zero_optimization.stage 3 (DeepSpeed's defaults otherwise): "
    "FSDP2 shard units per block, reshard/prefetch/persistence from the stage3_* keys, AdamW(fused) on "
    "the local fp32 shards, one norm all-reduce",
    "fsdp2_zero3": "torch fully_shard on each block and the root with default reshard_after_forward "
    "(ZeRO-3), AdamW(fused=True) on the DTensor parameters, clip_grad_norm_(1.0), "
    "set_requires_gradient_sync(False) off the GA boundary; bf16 = MixedPrecisionPolicy(param_dtype=bf16)",
    "deepspeed": "deepspeed.initialize with the same config at stage 3 (DS_ACCELERATOR=cpu, gloo, "
    "torch_adam + fused: torch's fused AdamW)",
    "reference": "one process, fp32, the global batch per micro step (as in engine_core)",
}


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- worker side


def _register_runner(worker: types.ModuleType) -> None:
    """Add the FSDP2 ZeRO-3 peer to the engine-core worker's runners."""

    class FSDP2Zero3Runner(worker._TorchPeer):  # type: ignore[name-defined,misc]
        """FSDP2 directly, per-block wrapping, default resharding (blocks reshard after forward)."""

        def __init__(self, spec: dict[str, Any], models: types.ModuleType) -> None:
            super().__init__(spec, models)
            import torch
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            worker._ensure_process_group()
            self.model = worker.build_model(models, spec)
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if self.bf16 else MixedPrecisionPolicy()
            for block in self.model.blocks:
                fully_shard(block, mp_policy=mp)
            fully_shard(self.model, mp_policy=mp)
            self.wrapped = self.model
            self.optimizer = torch.optim.AdamW(self.model.parameters(), **worker._adamw_kwargs(spec))

        def _autocast(self) -> bool:
            return False  # FSDP2 casts the parameters (param_dtype)

        def _no_sync(self, boundary: bool) -> contextlib.AbstractContextManager[Any]:
            self.model.set_requires_gradient_sync(boundary)
            return contextlib.nullcontext()

        def roots(self) -> list[Any]:
            from torch.distributed.fsdp import FSDPModule, fully_shard

            states = [fully_shard.state(m) for m in self.model.modules() if isinstance(m, FSDPModule)]
            return [self.model, self.optimizer, *states]

    worker.RUNNERS["fsdp2_zero3"] = FSDP2Zero3Runner
    worker._IMPORTS["fsdp2_zero3"] = ["torch.distributed.fsdp"]


def worker_main() -> None:
    """Run one job as the engine-core worker does, with the stage-3 peer registered."""
    worker = _load("engine_core_worker", HERE / "engine_core_worker.py")
    _register_runner(worker)
    worker.main()


# --------------------------------------------------------------------------- driver side


def build_cases(
    core: types.ModuleType,
    precisions: list[str],
    gas_list: list[int],
    preset: dict[str, Any],
    wanted: set[str],
) -> list[Any]:
    """Stage-3 cases: shardwise first, then its peers, per precision and GAS."""
    cases = []
    for precision in precisions:
        for gas in gas_list:
            micro, seq = preset["bf16_batch" if precision == "bf16" else "fp32_batch"]
            for framework in ["shardwise", *PEERS]:
                if framework in wanted:
                    cases.append(core.Case(framework, STAGE, precision == "bf16", gas, micro, seq))
    return cases


def evaluate(cases: list[Any]) -> None:
    """Ratios against the best stage-3 peer and shardwise's stage-3 targets."""
    for case in cases:
        if case.status != "ok":
            continue
        peers = [c for c in cases if c.group == case.group and c.framework in PEERS and c.status == "ok"]
        best = min(peers, key=lambda c: c.metrics["step_ms"]) if peers else None
        m = case.metrics
        m["best_peer"] = best.framework if best else None
        m["step_ratio"] = m["step_ms"] / best.metrics["step_ms"] if best else None
        if case.framework != "shardwise":
            continue
        pf = {True: "pass", False: "FAIL"}
        m["targets"] = {
            "step": "n/a" if m["step_ratio"] is None else pf[m["step_ratio"] <= STEP_RATIO_TARGET],
            "mem": "n/a" if case.bf16 else pf[round(m["bytes_per_param"], 2) <= MEM_TARGET_BYTES_PER_PARAM],
            "opt_bw": "n/a" if m["opt_vs_triad"] is None else pf[m["opt_vs_triad"] >= 0.85],
            "init": pf[m["init_s"] < 2.0],
        }


def print_summary(cases: list[Any]) -> dict[str, dict[str, int]]:
    """Pass/fail counts of shardwise's stage-3 targets."""
    summary: dict[str, dict[str, int]] = {}
    for case in cases:
        for name, verdict in case.metrics.get("targets", {}).items():
            summary.setdefault(name, {"pass": 0, "FAIL": 0, "n/a": 0})[verdict] += 1
    labels = {
        "step": f"median step time <= {STEP_RATIO_TARGET} x min(FSDP2 per-block, DeepSpeed stage 3)",
        "mem": f"model-state bytes/param per rank (fp32) <= {MEM_TARGET_BYTES_PER_PARAM}",
        "opt_bw": "optimizer-step bandwidth >= 85% of per-process triad",
        "init": "process start to engine ready < 2 s",
    }
    print("\nshardwise stage-3 targets:")
    for name, label in labels.items():
        b = summary.get(name, {"pass": 0, "FAIL": 0, "n/a": 0})
        print(f"  {label:<78} pass {b['pass']:>2}  FAIL {b['FAIL']:>2}  n/a {b['n/a']:>2}")
    return summary


def run(argv: list[str] | None = None) -> tuple[list[Any], dict[str, Any]]:
    """Run the stage-3 grid; returns the cases (with metrics) and the run's metadata."""
    core = _load("engine_core", HERE / "engine_core.py")
    core.WORKER = Path(__file__).resolve()  # jobs run this file, which registers the extra peer
    parser = argparse.ArgumentParser(description="stage-3 rows of the engine-core benchmark")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--frameworks", nargs="+", default=["shardwise", *PEERS])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--gas", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--ds-python", default=str(core.DEFAULT_DS_PYTHON))
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--grouped", action=argparse.BooleanOptionalAction, default=None)
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    preset = dict(core.QUICK if args.quick else core.FULL)
    warmup = max(2, args.warmup if args.warmup is not None else preset["warmup"])
    steps = args.steps if args.steps is not None else preset["steps"]
    grouped = args.quick if args.grouped is None else args.grouped
    cfg = core.Settings(
        python=args.python,
        ds_python=args.ds_python,
        src_env={
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(core.REPO / "src"), os.environ.get("PYTHONPATH")])
            )
        },
        ds_env={"DS_ACCELERATOR": "cpu"},
        timeout=args.timeout,
        warmup=warmup,
        base={
            "world_size": core.WORLD,
            "models_path": str(core.MODELS),
            "model": preset["model"],
            "warmup": warmup,
            "steps": steps,
            "seed": 1234,
            "data_seed": 4321,
            "optimizer": core.OPTIMIZER,
            "clip": 1.0,
            "triad_elements": preset["triad_elements"],
            "triad_reps": 10,
        },
    )
    meta: dict[str, Any] = {
        "mode": "quick" if args.quick else "full",
        "stage": STAGE,
        "frameworks": DESCRIPTIONS,
    }
    wanted = set(args.frameworks)
    unavailable = core.check_frameworks(wanted & {"shardwise", "deepspeed"}, cfg, meta)
    triad = core.measure_triad(cfg, meta)
    cases = build_cases(core, args.precisions, args.gas, preset, wanted)
    references = core.run_references(cases, cfg)
    core.run_grid(
        cases, cfg, grouped=grouped, unavailable=unavailable, references=references, triad_Bps=triad
    )
    evaluate(cases)
    meta["wall_s"] = time.monotonic() - t0
    print()
    print(
        f"stage-3 benchmark ({meta['mode']}): {core.WORLD} gloo ranks x 1 thread, model {preset['model']}, "
        f"{warmup} warm-up + {steps} measured steps"
    )
    core.print_table(cases)
    summary = print_summary(cases)
    print("\nwhat each framework runs:")
    for name, text in DESCRIPTIONS.items():
        print(f"  {name:<12} {text}")
    print(f"\nwall time {meta['wall_s']:.0f} s")
    if args.out:
        core.write_json(args.out, meta, summary, cases, references)
    return cases, meta


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].lstrip().startswith("{"):
        worker_main()
    else:
        run()
