"""What the GPU tests (``tests/gpu``, marker ``cuda``, ``make test-gpu``) share.

Both sides of the harness live here:

- the test side: :func:`run_cases` spawns ONE rank (world size 1) with backend ``nccl``, so the rank
  pins ``cuda:0`` and shardwise places the model there (``initialization._device``); every case runs
  in that one process (a CUDA context costs seconds per process), each under :func:`guarded` so one
  failing case reports its traceback and the others still run;
- the rank side: :func:`device` (the rank's device), :func:`deterministic` (TF32 off, the math
  attention kernel, deterministic algorithms) and :func:`to_cpu`.

``SHARDWISE_GPU_TESTS_ON=cpu`` (development on a machine without a GPU, opt-in only) makes the
``cuda`` tests collect and run the same cases with backend gloo on the CPU; tests/conftest.py
deselects ``cuda`` tests wherever neither a GPU nor that opt-in exists, so `make test` never runs
them (and, under the opt-in, the ones marked ``cuda(needs_device=True)``).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

# the CPU suites' per-rank case modules (zero_reference, stage3_cases, ...) are reused, not copied
_DISTRIBUTED = str(Path(__file__).resolve().parents[1] / "distributed")
if _DISTRIBUTED not in sys.path:
    sys.path.insert(0, _DISTRIBUTED)

#: ``cuda`` (default) or ``cpu`` (development only: gloo on the CPU)
ON = os.environ.get("SHARDWISE_GPU_TESTS_ON", "cuda")
#: cuBLAS is deterministic only with a fixed workspace configuration (set before its first use). And
#: torch's cuBLASLt path for ``addmm`` with a bias (nn.Linear) asks the heuristic for an algorithm given
#: each pointer's alignment (up to 256 bytes): the engine's parameters are views into flat buffers (a
#: 64-byte-aligned bf16 weight), the reference's are separate allocations (512-byte aligned), so the two
#: could get different algorithms, i.e. different summation orders. Without the Lt path both use cuBLAS's
#: gemm, whose kernels need only 16-byte alignment, which both layouts have (and at stages 0-2 the
#: reference's parameters are placed at their engine twins' alignment anyway: zero_reference ``align_like``).
RANK_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "DISABLE_ADDMM_CUDA_LT": "1"}


def backend() -> str:
    """``nccl`` on the GPU; ``gloo`` under ``SHARDWISE_GPU_TESTS_ON=cpu``."""
    if ON not in ("cuda", "cpu"):
        raise ValueError(
            f"SHARDWISE_GPU_TESTS_ON={ON!r}: expected 'cuda' (the default) or 'cpu' (run the GPU tests' "
            "logic on the CPU with gloo, for development without a GPU)"
        )
    return "gloo" if ON == "cpu" else "nccl"


def case_id(case: dict[str, Any]) -> str:
    """A stable name for a case dict (its sorted items)."""
    return repr(sorted(case.items()))


def run_cases(
    fn: Callable[..., Any], cases: Sequence[dict[str, Any]], timeout: float = 200.0
) -> dict[str, Any]:
    """Run ``fn(rank, 1, case)`` for every case in one spawned rank; ``{case_id: result}``.

    Ranks are ``spawn`` processes (not forked from the harness's forkserver), so no CUDA state of any
    other process can reach them."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SHARDWISE_HARNESS_START", "spawn")
        from shardwise.testing import run_distributed_cases

        out = run_distributed_cases(
            guarded, list(cases), world_size=1, args=(fn,), timeout=timeout, backend=backend(), env=RANK_ENV
        )
    return {case_id(case): ranks[0] for case, ranks in zip(cases, out)}


def run_on_cpu(fn: Callable[..., Any], cases: Sequence[dict[str, Any]], timeout: float = 240.0) -> list[Any]:
    """``fn(0, 1, case)`` for each case in one spawned CPU rank (gloo), e.g. to load what a GPU run saved."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SHARDWISE_HARNESS_START", "spawn")
        from shardwise.testing import run_distributed_cases

        out = run_distributed_cases(
            guarded, list(cases), world_size=1, args=(fn,), timeout=timeout, backend="gloo"
        )
    return [ranks[0] for ranks in out]


def guarded(rank: int, world: int, case: dict[str, Any], fn: Callable[..., Any]) -> Any:
    """Run one case; an exception becomes ``{"error": traceback}`` so the next cases still run."""
    try:
        deterministic()
        return fn(rank, world, case)
    except Exception:
        return {"error": traceback.format_exc()}


def record(test: str, **measured: Any) -> None:
    """What a test measured (differences from the references, peak memory), so a single GPU run leaves
    its numbers behind: printed as one ``GPU-REPORT {json}`` line (pytest shows it with ``-rA``) and
    appended to ``$SHARDWISE_GPU_REPORT`` when that is set."""
    import json

    line = json.dumps({"test": test, "on": ON, **measured}, default=str)
    print("GPU-REPORT", line)
    path = os.environ.get("SHARDWISE_GPU_REPORT")
    if path:
        with open(path, "a") as out:
            out.write(line + "\n")


def result_of(results: dict[str, Any], case: dict[str, Any]) -> Any:
    """The case's result, failing the test with the rank's traceback if it raised."""
    out = results[case_id(case)]
    if isinstance(out, dict) and "error" in out:
        pytest.fail(f"the case raised on the rank:\n{out['error']}", pytrace=False)
    return out


# ----------------------------------------------------------------------------------- rank side
def device() -> torch.device:
    """The rank's device: ``cuda:<current>`` under nccl, else the CPU (as shardwise places models)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def deterministic() -> None:
    """Same kernels, same bits: TF32 off, attention through the math kernel (the fused CUDA
    kernels' backward may accumulate with atomics), deterministic algorithms where torch has them."""
    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    if torch.cuda.is_available():
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
            torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_math_sdp(True)
    torch.use_deterministic_algorithms(True, warn_only=True)


def to_cpu(value: Any) -> Any:
    """Tensors (in dicts, lists, tuples) copied to the CPU, so the parent never touches CUDA."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value
