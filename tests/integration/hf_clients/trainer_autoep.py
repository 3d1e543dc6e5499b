"""Trainer with AutoEP on shardwise through the 'deepspeed' compatibility package.

usage: torchrun --nproc-per-node 2 trainer_autoep.py AUTOEP_SIZE OUT_JSON
A tiny random Mixtral, 4 optimizer steps at ZeRO 1 (the Trainer's own AdamW, built before
``deepspeed.initialize``); ``AUTOEP_SIZE`` 1 leaves ``expert_parallel`` out. Rank 0 writes the losses.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
from accelerate import PartialState

PartialState(backend="gloo")  # on CPU accelerate counts the processes only with a backend

import torch  # noqa: E402
from tiny import token_data  # noqa: E402
from transformers import MixtralConfig, MixtralForCausalLM, Trainer, TrainingArguments  # noqa: E402

size, out = int(sys.argv[1]), sys.argv[2]
data = token_data()
config = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_optimization": {"stage": 1},
}
if size > 1:
    config["expert_parallel"] = {"enabled": True, "autoep_size": size, "preset_model": "mixtral"}


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return len(data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": data[i], "labels": data[i]}


torch.manual_seed(0)
model = MixtralForCausalLM(
    MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        output_router_logits=True,
    )
)
args = TrainingArguments(
    output_dir=os.path.dirname(out),
    per_device_train_batch_size=2,
    max_steps=4,
    learning_rate=1e-2,
    save_strategy="no",
    logging_steps=1,
    report_to=[],
    deepspeed=config,
    accelerator_config={"use_configured_state": True},
    seed=0,
    disable_tqdm=True,
)
trainer = Trainer(model=model, args=args, train_dataset=Tokens())
trainer.train()
converted = sum(type(m).__name__ == "AutoEPMoELayer" for m in model.modules())
assert converted == (2 if size > 1 else 0), converted
if torch.distributed.get_rank() == 0:
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    with open(out, "w") as f:
        json.dump(losses, f)
