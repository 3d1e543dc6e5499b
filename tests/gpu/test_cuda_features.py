"""Activation checkpointing, checkpoints, sparse attention, compression and data efficiency on one GPU
(nccl, world size 1), through the CPU suites' own case functions run on the GPU. One spawn.

Bounds.
- Activation checkpointing with dropout (p=0.2): the recompute draws the same CUDA dropout masks, so
  losses, parameters and the generators' next draws equal a run without checkpointing bit for bit.
  The same for dropout inside ``get_cuda_rng_tracker().fork()`` (the tracked stream is replayed).
- Checkpoint resume (dropout on, WarmupLR, fp16 loss scale): train 2N == train N, save, fresh engine
  with another init, load, train N, loss for loss, exactly (same kernels, restored CUDA RNG). A
  checkpoint saved on the GPU loads on the CPU (gloo) with every parameter and optimizer value equal
  (a load is a copy).
- Sparse attention: fp32, against the dense masked reference on the GPU and against its own CPU
  result, outputs and gradients within the CPU unit test's 1e-5 (test_sparse_self_attention.py: two
  fp32 computations of the same attention summed in different orders over <= 64 keys).
- Compression: the quantizer on the GPU equals the CPU's bit for bit (only exact or singly-rounded
  elementwise IEEE operations); weight quantization and head pruning train (loss falls) and resume.
- Data efficiency: curriculum seqlen reaches the model at the scheduled lengths; a resume mid-curriculum
  (random-LTD on) equals an uninterrupted run exactly.
"""

from __future__ import annotations

import cuda_feature_cases
import cuda_support
import pytest
import torch

pytestmark = pytest.mark.cuda

AC = [
    {"kind": "activation_checkpointing", "stage": 0, "precision": "fp32", "gas": 1, "mode": "reentrant"},
    {"kind": "activation_checkpointing", "stage": 2, "precision": "fp32", "gas": 1, "mode": "non_reentrant"},
    {
        "kind": "activation_checkpointing",
        "stage": 2,
        "precision": "fp32",
        "gas": 1,
        "mode": "reentrant",
        "section": {"profile": True, "synchronize_checkpoint_boundary": True, "cpu_checkpointing": True},
    },
    {"kind": "activation_checkpointing", "stage": 1, "precision": "fp16", "gas": 2, "mode": "non_reentrant"},
    {"kind": "activation_checkpointing", "stage": 3, "precision": "bf16", "gas": 2, "mode": "reentrant"},
]
TRACKER = [{"kind": "rng_tracker_fork"}]
RESUME = [
    {"kind": "checkpoint_resume", "stage": 0, "precision": "fp16", "extra": {}},
    {"kind": "checkpoint_resume", "stage": 2, "precision": "fp32", "extra": {}, "cpu_view": True},
    {"kind": "checkpoint_resume", "stage": 3, "precision": "bf16", "extra": {}, "cpu_view": True},
    {
        "kind": "checkpoint_resume",
        "stage": 2,
        "precision": "bf16",
        "extra": {
            "zero_optimization": {
                "stage": 2,
                "reduce_bucket_size": 2000,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},  # pinned host buffers
            }
        },
    },
]
SPARSE = [
    {"kind": "sparse_attention", "configs": ["dense", "fixed_uni_patterns", "bigbird_per_head", "variable"]}
]
COMPRESSION = [{"kind": "compression", "stage": 2}]
DATA = [
    {"kind": "curriculum_seqlen", "stage": 0},
    {"kind": "curriculum_seqlen", "stage": 3},
    {"kind": "curriculum_resume", "stage": 2, "ltd": True, "index": None},
]
COLLECTIVES = [{"kind": "cpu_tensor_collectives"}]
RNG_LAYOUT = [{"kind": "rng_restore_on_another_layout"}]
GRAD_FOLD = [{"kind": "grad_fold"}]
CASES = COLLECTIVES + RNG_LAYOUT + GRAD_FOLD + AC + TRACKER + RESUME + SPARSE + COMPRESSION + DATA


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda_features")
    cases = []
    for index, case in enumerate(CASES):
        case = dict(case)
        if case["kind"] in ("checkpoint_resume", "curriculum_resume"):
            case["dir"] = str(root / f"case{index}")
        if case["kind"] == "compression":
            case["tmp"] = str(root / f"case{index}")
        cases.append(case)
    out = cuda_support.run_cases(cuda_feature_cases.run_case, cases)
    return {cuda_support.case_id(c): out[cuda_support.case_id(r)] for c, r in zip(CASES, cases)} | {
        "paths": {cuda_support.case_id(c): r for c, r in zip(CASES, cases)}
    }


def test_cpu_tensors_pass_through_nccl_collectives(results):
    out = cuda_support.result_of(results, COLLECTIVES[0])
    assert out["backend"] == cuda_support.backend()
    assert out["summed"] == ("cpu", [3.0, 5.0])  # world size 1
    assert out["averaged"] == ("cpu", [4.0, 8.0])
    assert out["sent"] == ("cpu", [0, 1, 2, 3, 4, 5])
    assert out["gathered"] == ("cpu", [10 * 0 + i for i in range(4)])
    assert out["ranged"] == (cuda_support.ON, [float(i) for i in range(10)], [3.0, 4.0, 5.0, 6.0])
    assert out["whole"] == ([float(i) for i in range(6)], [float(i) for i in range(6)])


@pytest.mark.cuda(needs_device=True)  # a CUDA generator: not run under SHARDWISE_GPU_TESTS_ON=cpu
def test_checkpoint_rng_restores_the_saving_ranks_gpu_generator(results):
    out = cuda_support.result_of(results, RNG_LAYOUT[0])
    assert out["device"].startswith("cuda") and out["equal"]


def test_folded_divisor_is_bitwise_the_separate_division(results):
    out = cuda_support.result_of(results, GRAD_FOLD[0])
    _on_device(out)
    unequal = [name for name, equal in out.items() if name != "device" and not equal]
    cuda_support.record("grad_fold", unequal=unequal)
    assert len(out) == 1 + 2 * 7 and not unequal


def _on_device(out):
    assert out["device"].startswith(cuda_support.ON), out["device"]


@pytest.mark.parametrize("case", AC, ids=lambda c: f"stage{c['stage']}-{c['precision']}-{c['mode']}")
def test_checkpointed_training_equals_plain_bit_for_bit(results, case):
    out = cuda_support.result_of(results, case)
    _on_device(out)
    assert out["losses_equal"] and out["params_equal"]
    assert out["rng_equal"] and out["device_rng_equal"]  # the recompute's draws were replayed, then undone
    plain_calls, ckpt_calls = out["calls"]
    assert ckpt_calls == 2 * plain_calls > 0  # every block ran again in backward
    plain_peak, ckpt_peak = out["peaks"]
    assert ckpt_peak < plain_peak / 2  # only the block inputs are kept (as on the CPU)
    if case.get("section", {}).get("profile"):
        assert out["timers"]["act_ckpt_forward"] > 0 and out["timers"]["act_ckpt_recompute"] > 0


def test_rng_tracker_fork_is_replayed_in_the_recompute(results):
    out = cuda_support.result_of(results, TRACKER[0])
    _on_device(out)
    for mode, check in out["modes"].items():
        assert check["grad_equal"] and check["state_equal"], mode
    assert out["fork_differs_from_default"]
    assert 0.3 < out["dropped_fraction"] < 0.7  # p=0.5 over 512 values


@pytest.mark.parametrize(
    "case", RESUME, ids=lambda c: f"stage{c['stage']}-{c['precision']}-{sorted(c['extra'])}"
)
def test_resume_equals_an_uninterrupted_run(results, case):
    out = cuda_support.result_of(results, case)
    _on_device(out)
    assert out["resumed"] == out["reference"]  # exact, loss for loss
    assert out["first"] != out["reference"]
    assert out["params_equal"] and out["optimizer_equal"]
    assert out["lr_equal"] and out["scale_equal"]
    assert out["counters"][0] == 4 and out["counters"][2] == 0


CPU_VIEW = [case for case in RESUME if case.get("cpu_view")]


@pytest.fixture(scope="module")
def loaded_on_cpu(results):
    """The GPU-saved checkpoints of ``CPU_VIEW`` loaded by one CPU (gloo) rank."""
    paths = [results["paths"][cuda_support.case_id(case)] for case in CPU_VIEW]
    return dict(
        zip(
            map(cuda_support.case_id, CPU_VIEW),
            cuda_support.run_on_cpu(cuda_feature_cases.load_on_cpu, paths),
        )
    )


@pytest.mark.parametrize("case", CPU_VIEW, ids=lambda c: f"stage{c['stage']}-{c['precision']}")
def test_a_gpu_checkpoint_loads_on_the_cpu(results, loaded_on_cpu, case):
    saved = cuda_support.result_of(results, case)
    on_cpu = loaded_on_cpu[cuda_support.case_id(case)]
    if "error" in on_cpu:
        pytest.fail(on_cpu["error"], pytrace=False)
    assert on_cpu["device"] == "cpu"
    assert saved["loaded_params"].keys() == on_cpu["loaded_params"].keys()
    for name, value in saved["loaded_params"].items():
        assert torch.equal(value, on_cpu["loaded_params"][name]), name
    assert saved["loaded_state"].keys() == on_cpu["loaded_state"].keys()
    for key, value in saved["loaded_state"].items():
        if key == "optim/param_groups":
            continue
        theirs = on_cpu["loaded_state"][key]
        assert torch.equal(value, theirs) if torch.is_tensor(value) else value == theirs, key


def test_sparse_attention_matches_dense_and_the_cpu(results):
    out = cuda_support.result_of(results, SPARSE[0])
    _on_device(out)
    cuda_support.record("sparse_attention", **{name: out[name] for name in SPARSE[0]["configs"]})
    for name in SPARSE[0]["configs"]:
        assert out[name]["output_device"] == cuda_support.ON, name
        assert out[name]["vs_dense"] <= 1e-5, (name, out[name])
        assert out[name]["vs_cpu"] <= 1e-5, (name, out[name])


def test_compression_acts_on_the_device(results):
    out = cuda_support.result_of(results, COMPRESSION[0])
    _on_device(out)
    assert out["losses"][-1] < out["losses"][0]
    assert out["steps"] == out["resumed_steps"] == 12
    assert out["bits"] == out["resumed_bits"] == 6
    assert out["heads_on"] and out["resumed_heads"]
    for name, (equal, levels) in out["quantizer_equal_to_cpu"].items():
        bits = int(name.split("-")[0])
        assert equal, name
        assert levels <= 2**bits, name


@pytest.mark.parametrize("case", DATA[:2], ids=lambda c: f"stage{c['stage']}")
def test_curriculum_seqlen_reaches_the_model(results, case):
    out = cuda_support.result_of(results, case)
    _on_device(out)
    seen = out["seen"]
    expected = [min(16, max(4, (4 + 12 * (s + 1) // 6) // 4 * 4)) for s in range(8) for _ in range(2)]
    assert [s for s, _ in seen[:-1]] == expected
    assert [length for _, length in seen[:-1]] == expected
    assert seen[-1] == (None, 16)


def test_resume_mid_curriculum_equals_an_uninterrupted_run(results):
    out = cuda_support.result_of(results, DATA[2])
    _on_device(out)
    assert out["resumed"] == out["reference"]
    assert out["first"] != out["reference"]
    assert out["hook_state_equal"]
    assert out["seqlens_after_resume"] == [12, 12, 12, 12, 16, 16]
    assert out["kept_after_first"] == [8, 8]
