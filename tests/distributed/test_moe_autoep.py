"""AutoEP on 2 gloo ranks: the ``expert_parallel`` section converts a tiny transformers Mixtral and
Qwen3-MoE (random weights from a config) to expert parallelism, and training matches the unconverted
model at ZeRO 0-2.

Tolerance 1e-5 on the loss over 6 SGD steps: each token's expert results are added in the same
(ascending expert) order as transformers' loop; what differs is the row count of each expert's
matrix products (both ranks' tokens at once), a few fp32 ulps per step.
"""

from __future__ import annotations

import pytest
from autoep_cases import train

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed


FAMILIES = ["mixtral", "qwen3_moe"]
CASES = [{"family": f, "stage": stage, "ep": ep} for f in FAMILIES for stage in (0, 1, 2) for ep in (1, 2)]


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[object, list[dict]]:
    """Both families' twelve trainings in one spawn, so the ranks import transformers and set up the
    group once; each case builds and seeds its own model (autoep_cases.train), as in a spawn of its
    own, and a failing case is named by run_distributed_cases. In the same ranks: an ep=2 Mixtral
    checkpoint at stage 2 resumed at ep=1 (key "resume")."""
    resume = {"resume_at_ep1": True, "stage": 2, "dir": str(tmp_path_factory.mktemp("autoep-resume"))}
    results = run_distributed_cases(train, [*CASES, resume], world_size=2, timeout=1200)
    runs: dict[object, list[dict]] = {"resume": results.pop()}
    runs.update({(c["family"], c["stage"], c["ep"]): r for c, r in zip(CASES, results, strict=True)})
    return runs


def test_an_ep2_checkpoint_resumes_at_ep1(family_runs) -> None:
    # expert weights are saved as cuts of the whole [num_experts, ...] tensor (not one per rank under
    # one name), so a run at another autoep_size finds every expert
    resumed = family_runs["resume"]
    assert all(r["equal"] and r["experts"] == 4 and r["refused"] for r in resumed), resumed
    # and DeepSpeed's MoE files of it (checkpoint.deepspeed_moe_files): every expert whole by global
    # index, the AutoEP metadata, the router under DeepSpeed's second name too
    for r in resumed:
        files = r["ds_files"]
        assert files["experts_equal"] and files["router_twice"] and files["no_experts_in_main"], files
        assert len(files["layers"]) >= 1 and all(n == 4 and ep == 2 for _, n, ep in files["layers"]), files


@pytest.mark.parametrize("family", FAMILIES)
def test_autoep_matches_the_unconverted_model(family_runs, family: str) -> None:
    runs = {(stage, ep): family_runs[(family, stage, ep)] for stage in (0, 1, 2) for ep in (1, 2)}
    for stage in (0, 1, 2):
        for rank in range(2):
            dense, ep = runs[(stage, 1)][rank], runs[(stage, 2)][rank]
            assert max(abs(a - b) for a, b in zip(dense["loss"], ep["loss"])) <= 1e-5, (stage, dense, ep)
            assert ep["expert_numel"] > 0 and dense["expert_numel"] == 0
            assert dense["numel"] - ep["numel"] == ep["expert_numel"]  # half of the experts left this rank
        assert runs[(stage, 1)][0]["loss"][-1] < runs[(stage, 1)][0]["loss"][0]

