"""ZeRO stages 0-3 on one GPU (nccl, world size 1) against the single-process reference on the same GPU.

Bounds. The engine and the reference (``zero_reference.reference_run`` with ``device`` = the GPU) run
the same CUDA kernels on the same shapes in the same order, with TF32 off, attention through the math
kernel and deterministic algorithms (``cuda_support.deterministic``); at world size 1 every reduction
is a copy and the gradient divisor is 1 (fp32, bf16) or the exact power of two 1/256 (fp16). So the
results are equal bit for bit by construction; the assertions allow the CPU suite's 1e-6 relative
(test_zero_parity.py), so any larger deviation is a bug, not rounding. With optimizer offload (cpu or
nvme) the engine steps AdamW on host copies of the gradients and masters; the reference does the same
(``opt_device='cpu'``: the same torch CPU fused AdamW on the same fp32 values), so the same bound holds
(a GPU-side reference could differ in the last bit: CUDA's fused kernel contracts multiply-adds).

fp16 overflow: an inf loss at steps 1 and 2 with hysteresis 2 skips both steps and halves the scale
once (16, 16, 8, 8), exactly as on the CPU. Memory: with ``offload_optimizer: cpu`` the peak device
memory of two training steps is lower than without by at least AdamW's state (two fp32 tensors per
parameter, 8 bytes each parameter), which then lives on the host.
"""

from __future__ import annotations

import copy
import math

import cuda_support
import cuda_zero_cases
import pytest
import torch
from stage3_cases import NVME, with_path

from shardwise.zero.param_swap import storage_exchange_available

pytestmark = pytest.mark.cuda

PARITY = [
    {"kind": "parity", "stage": stage, "precision": precision, "gas": 2}
    for stage in (0, 1, 2, 3)
    for precision in ("fp32", "bf16", "fp16")
]
OFFLOAD = [
    {
        "kind": "parity",
        "stage": 1,
        "precision": "bf16",
        "gas": 2,
        "zero": {"offload_optimizer": {"device": "cpu"}},
    },
    {
        "kind": "parity",
        "stage": 2,
        "precision": "fp32",
        "gas": 1,
        "zero": {"offload_optimizer": {"device": "cpu", "pin_memory": True}},
    },
    {
        "kind": "parity",
        "stage": 2,
        "precision": "fp32",
        "gas": 2,
        # pinned NVMe staging buffers are freed and refilled between steps (resize_)
        "zero": {
            "offload_optimizer": {"device": "nvme", "nvme_path": NVME, "pin_memory": True},
            "sub_group_size": 2000,
        },
    },
    {
        "kind": "parity",
        "stage": 3,
        "precision": "fp32",
        "gas": 1,
        "zero": {"offload_optimizer": {"device": "cpu", "pin_memory": True}},
    },
    {
        "kind": "parity",
        "stage": 3,
        "precision": "fp32",
        "gas": 2,
        "zero": {
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu"},
        },
    },
    {
        "kind": "parity",
        "stage": 3,
        "precision": "bf16",
        "gas": 1,
        "zero": {"offload_optimizer": {"device": "nvme", "nvme_path": NVME}},
    },
]
# NVMe parameter offload needs torch.UntypedStorage._swap_data_ptr_ (torch 2.13; absent in 2.11)
NVME_PARAM = [
    {
        "kind": "parity",
        "stage": 3,
        "precision": "bf16",
        "gas": 1,
        "zero": {
            "offload_param": {"device": "nvme", "nvme_path": NVME, "buffer_count": 2, "pin_memory": True},
            "offload_optimizer": {"device": "nvme", "nvme_path": NVME, "pin_memory": True},
            "stage3_param_persistence_threshold": 100,
        },
    },
]
ZERO_INIT = [{"kind": "zero_init", "precision": "bf16"}]
OVERFLOW = [{"kind": "fp16_overflow", "stage": stage} for stage in (0, 2, 3)]
MEMORY = [{"kind": "memory", "stage": stage} for stage in (2, 3)]
CASES = PARITY + OFFLOAD + ZERO_INIT + OVERFLOW + MEMORY + NVME_PARAM  # last: refused on torch 2.11


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("nvme"))
    cases = [with_path(copy.deepcopy(c), path) for c in CASES]
    out = cuda_support.run_cases(cuda_zero_cases.run_case, cases)
    return {cuda_support.case_id(c): out[cuda_support.case_id(r)] for c, r in zip(CASES, cases)}


def _parity_id(case):
    if case["kind"] == "zero_init":
        return f"stage3-{case['precision']}-zero.Init"
    zero = case.get("zero", {})
    where = "-".join(f"{k}={v['device']}" for k, v in zero.items() if isinstance(v, dict))
    return f"stage{case['stage']}-{case['precision']}-gas{case['gas']}" + (f"-{where}" if where else "")


@pytest.mark.parametrize("case", PARITY + OFFLOAD + ZERO_INIT, ids=_parity_id)
def test_matches_the_single_process_reference_on_the_device(results, case):
    _assert_parity(case, cuda_support.result_of(results, case))


@pytest.mark.parametrize("case", NVME_PARAM, ids=_parity_id)
def test_nvme_parameter_offload_matches_the_reference_or_names_the_torch_it_needs(results, case):
    """torch 2.13 trains like the reference; torch 2.11 (no UntypedStorage._swap_data_ptr_) is
    refused at initialize with an error naming the version and the fix."""
    if storage_exchange_available():
        _assert_parity(case, cuda_support.result_of(results, case))
        return
    out = results[cuda_support.case_id(case)]
    assert "error" in out, "initialize should refuse NVMe parameter offload on this torch"
    assert "_swap_data_ptr_" in out["error"] and "torch 2.13" in out["error"], out["error"]


def _assert_parity(case, out):
    assert out["device"].startswith(cuda_support.ON)
    ours, ref = out["engine"], out["reference"]
    assert out.get("tied", True)  # zero.Init keeps the lm_head tied to the embedding
    cuda_support.record(
        f"zero_parity[{_parity_id(case)}]",
        bitwise=all(torch.equal(a, b) for a, b in zip(ours["params"], ref["params"]))
        and ours["losses"] == ref["losses"],
        max_param_diff=max(float((a - b).abs().max()) for a, b in zip(ours["params"], ref["params"])),
        engine_param_alignment_mod_256=out["alignment"],
        max_loss_rel_diff=max(
            abs(v - ref["losses"][k]) / abs(ref["losses"][k]) for k, v in ours["losses"].items()
        ),
    )
    assert ours["steps"] == cuda_zero_cases.STEPS and ours["skipped"] == 0
    assert ours["losses"].keys() == ref["losses"].keys()
    for key, value in ours["losses"].items():
        assert value == pytest.approx(ref["losses"][key], rel=1e-6, abs=1e-7), key
    assert len(ours["params"]) == len(ref["params"])
    for index, (a, b) in enumerate(zip(ours["params"], ref["params"])):
        assert a.device.type == "cpu" and a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8, msg=lambda m, i=index: f"param {i}: {m}")


@pytest.mark.parametrize("case", OVERFLOW, ids=lambda c: f"stage{c['stage']}")
def test_fp16_overflow_skips_the_step_and_halves_the_scale(results, case):
    rec = cuda_support.result_of(results, case)["record"]
    assert [r["applied"] for r in rec] == [True, False, False, True]
    assert [r["changed"] for r in rec] == [True, False, False, True]
    assert [r["scale"] for r in rec] == [16.0, 16.0, 8.0, 8.0]  # hysteresis 2: the second overflow halves
    assert [r["skipped"] for r in rec] == [0, 1, 2, 2]
    assert math.isinf(rec[1]["norm"]) and math.isfinite(rec[3]["norm"])
    assert {r["param_device"] for r in rec} == {cuda_support.ON}


@pytest.mark.cuda(
    needs_device=True
)  # torch.cuda's memory statistics: not run under SHARDWISE_GPU_TESTS_ON=cpu
@pytest.mark.parametrize("case", MEMORY, ids=lambda c: f"stage{c['stage']}")
def test_optimizer_offload_holds_less_device_memory(results, case):
    out = cuda_support.result_of(results, case)
    assert out["device"] == "cuda"
    state_bytes = 8 * out["numel"]  # AdamW: exp_avg and exp_avg_sq, fp32
    saved = out["peaks"]["none"] - out["peaks"]["cpu"]
    cuda_support.record(f"offload_memory[stage{case['stage']}]", peaks=out["peaks"], state_bytes=state_bytes)
    assert saved >= state_bytes, (out["peaks"], state_bytes)
