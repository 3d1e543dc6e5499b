"""The real clients (transformers' Trainer, accelerate) on shardwise through the 'deepspeed' package.

Each test installs the compatibility package into a temporary site directory (``shardwise compat
install-deepspeed --target``), puts it on ``PYTHONPATH`` and runs a client script on 2 gloo ranks:
tiny GPT-2 built from a config, no hub access. Resumes are compared bit for bit with the run that
did not stop.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardwise.compat import installer

pytestmark = [pytest.mark.integration, pytest.mark.distributed]

SCRIPTS = Path(__file__).parent / "hf_clients"
CORPUS = Path(__file__).parent / "hf_clients" / "configs"
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def client_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("site")
    installer.install(site)
    src = Path(__file__).resolve().parents[2] / "src"
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(src), str(site), str(SCRIPTS)]),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def _run(command: list[str], env: dict[str, str], cwd: Path) -> None:
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"


def _torchrun(script: str, *args: str, env: dict[str, str], cwd: Path) -> None:
    _run([str(BIN / "torchrun"), "--nproc-per-node", "2", str(SCRIPTS / script), *args], env, cwd)


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"weights differ after resume: {different[:5]}"


@pytest.mark.parametrize(
    "config",
    [
        "017_axolotl-ai-cloud__axolotl__deepspeed_configs__zero2.json",  # stage 2, optimizer offload, "auto"
        "192_lm-sys__FastChat__playground__deepspeed_config_s3.json",  # stage 3, param+optimizer offload
    ],
)
def test_trainer_saves_and_resumes_bit_exactly(
    config: str, client_env: dict[str, str], tmp_path: Path
) -> None:
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _torchrun("trainer_run.py", str(CORPUS / config), str(full), env=client_env, cwd=tmp_path)
    resumed.mkdir()
    subprocess.run(["cp", "-r", str(full / "checkpoint-3"), str(resumed)], check=True)
    _torchrun("trainer_run.py", str(CORPUS / config), str(resumed), "resume", env=client_env, cwd=tmp_path)
    _same_weights(
        load_file(full / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    )
    at_step3 = load_file(full / "checkpoint-3" / "model.safetensors")
    assert any(
        not torch.equal(at_step3[k], v) for k, v in load_file(full / "final" / "model.safetensors").items()
    )
    # DeepSpeed's zero_to_fp32 helper on the engine checkpoint inside the Trainer's (fp32 training: exact)
    from shardwise.compat.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    fp32 = get_fp32_state_dict_from_zero_checkpoint(full / "checkpoint-3")
    _same_weights(at_step3, {k: fp32[k] for k in at_step3})


def test_accelerate_client_scheduler_drives_the_learning_rate(
    client_env: dict[str, str], tmp_path: Path
) -> None:
    # the script asserts, at every step, that the client's AdamW steps with the scheduler's LR; stage 3
    # (stage 2 runs the same loop in test_accelerate_launch_use_deepspeed)
    stage = 3
    _torchrun("accelerate_loop.py", str(stage), str(tmp_path), env=client_env, cwd=tmp_path)
    _torchrun("accelerate_loop.py", str(stage), str(tmp_path), "resume", env=client_env, cwd=tmp_path)
    full, resumed = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resume.pt")
    assert full["stage"] == resumed["stage"] == stage
    lrs = [lr for _, lr, _ in full["rows"]]
    assert len(set(lrs)) > 3 and all(lr > 0 for lr in lrs), lrs  # warm-up then decay, never the dead 0.0
    assert resumed["rows"] == full["rows"][3:]  # same LRs and losses after the resume
    _same_weights(full["weights"], resumed["weights"])


def test_accelerate_launch_use_deepspeed(client_env: dict[str, str], tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    config.write_text(
        '{"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": 1,'
        ' "zero_optimization": {"stage": 2}}'
    )
    launch = [
        str(BIN / "accelerate"),
        "launch",
        "--use_deepspeed",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
    ]
    _run(
        [
            *launch,
            "--deepspeed_config_file",
            str(config),
            str(SCRIPTS / "accelerate_loop.py"),
            "launched",
            str(tmp_path),
        ],
        client_env,
        tmp_path,
    )
    record = torch.load(tmp_path / "full.pt")
    assert record["stage"] == 2 and len(record["rows"]) == 6


@pytest.mark.parametrize("stage", [1, 3])
def test_accelerate_sequence_parallel_matches_whole_sequences(
    client_env: dict[str, str], tmp_path: Path, stage: int
) -> None:
    # ParallelismConfig(sp_backend="deepspeed", sp_size=2): accelerate registers Ulysses attention, wraps the
    # loader and passes the mpu; the SP run's losses equal a plain SGD run on whole sequences
    # (SGD's update is linear in the gradient: SP's few-ulp gradient differences stay at that level,
    # where Adam's first steps, close to lr * sign(g), would magnify them)
    _torchrun("accelerate_sp_loop.py", str(stage), str(tmp_path), env=client_env, cwd=tmp_path)
    record = torch.load(tmp_path / "sp.pt")
    assert len(record["got"]) == len(record["expected"]) == 4
    for got, expected in zip(record["got"], record["expected"], strict=True):
        assert abs(got - expected) < 1e-5, (record["got"], record["expected"])


def test_trainer_sequence_parallel_first_loss_is_a_whole_sequence_loss(
    client_env: dict[str, str], tmp_path: Path
) -> None:
    # Trainer(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2)): Ulysses attention, the SP
    # loader and the Trainer's own token-weighted loss over the SP group; the first step sees the initial weights,
    # so its loss is one sample's whole-sequence loss (which one depends on the Trainer's shuffle)
    _torchrun("trainer_sp_run.py", str(tmp_path), env=client_env, cwd=tmp_path)
    record = torch.load(tmp_path / "trainer_sp.pt")
    assert record["sp"] == 2 and len(record["losses"]) == 4
    assert min(abs(record["losses"][0] - loss) for loss in record["initial"]) < 1e-5, record


def test_trainer_with_a_tensor_parallel_config_trains_and_counts_the_data_parallel_batch(
    client_env: dict[str, str], tmp_path: Path
) -> None:
    """autotp_size 2 on 2 ranks: one data-parallel rank, so the total batch is micro 2 x accumulation 2 = 4
    (DeepSpeed's own Trainer integration counts the world: DeepSpeed issue 7298)."""
    import json

    _torchrun("trainer_tp_run.py", str(tmp_path), env=client_env, cwd=tmp_path)
    results = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    assert results[0]["logged_total"] == 4  # "Total train batch size (w. parallel, distributed & accumulation)"
    for result in results:
        assert result["engine"] == "ShardwiseEngine" and result["tp"] == 2 and result["train_batch_size"] == 4
        assert result["losses"][-1] < result["losses"][0]
    whole = 2 * (32 * 32 * 2 + 16 * 32 * 2 + 64 * 32 * 3) * 4  # q, o; k, v; gate, up, down; fp32; 2 layers
    assert [r["split_bytes"] for r in results] == [whole // 2] * 2
    # the saved model holds whole tensors: a plain Llama of the same config loads it strictly
    from transformers import LlamaConfig, LlamaForCausalLM

    saved = load_file(tmp_path / "final" / "model.safetensors")
    assert saved["model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)
    assert saved["model.layers.1.mlp.down_proj.weight"].shape == (32, 64)
    plain = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                         tie_word_embeddings=False))
    plain.load_state_dict(saved, strict=True)


def test_trainer_with_autoep_matches_the_unconverted_model(client_env: dict[str, str], tmp_path: Path) -> None:
    import json

    _torchrun("trainer_autoep.py", "1", str(tmp_path / "dense.json"), env=client_env, cwd=tmp_path)
    _torchrun("trainer_autoep.py", "2", str(tmp_path / "ep.json"), env=client_env, cwd=tmp_path)
    dense = json.loads((tmp_path / "dense.json").read_text())
    ep = json.loads((tmp_path / "ep.json").read_text())
    assert len(dense) == len(ep) == 4
    assert max(abs(a - b) for a, b in zip(dense, ep)) <= 1e-4, (dense, ep)  # logged rounded to 4 digits
