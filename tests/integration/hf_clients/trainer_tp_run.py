"""Trainer with a ``tensor_parallel`` ds_config on shardwise (through the 'deepspeed' package).

usage: torchrun --nproc-per-node 2 trainer_tp_run.py OUT_DIR
A tiny random Llama built from a config, autotp_size 2 on 2 ranks (so one data-parallel rank),
micro batch 2, accumulation 2: the total batch is 4, not micro x accumulation x world = 8.
Writes OUT_DIR/result-<rank>.json: the Trainer's logged total batch size, the engine's
train_batch_size, the losses, and the bytes of this rank's split weights; and the saved model in
OUT_DIR/final.
"""

from __future__ import annotations

import json
import logging
import os
import sys

os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
from accelerate import PartialState

PartialState(backend="gloo")

import torch  # noqa: E402
import transformers  # noqa: E402
from tiny import token_data  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

out_dir = sys.argv[1]
data = token_data()
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                     tie_word_embeddings=False))


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return len(data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": data[i], "labels": data[i]}


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class Losses(TrainerCallback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


lines, losses = Lines(), Losses()
transformers.logging.set_verbosity_info()
transformers.logging.get_logger("transformers.trainer").addHandler(lines)
ds_config = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 1, "stage3_gather_16bit_weights_on_model_save": True},  # save_model gathers
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "tensor_parallel": {"autotp_size": 2},
}
args = TrainingArguments(
    output_dir=out_dir,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    max_steps=8,
    learning_rate=1e-2,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    deepspeed=ds_config,
    accelerator_config={"use_configured_state": True},
    seed=0,
    disable_tqdm=True,
)
trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[losses])
trainer.train()
engine = trainer.model_wrapped
logged = [int(line.rsplit("=", 1)[1].replace(",", "")) for line in lines.lines if "Total train batch size" in line]
total = logged[0] if logged else None  # the Trainer logs on the main process only
split = sum(p.numel() * p.element_size() for n, p in engine.module.named_parameters() if n.endswith("_proj.weight"))
trainer.save_model(os.path.join(out_dir, "final"))  # accelerate gathers the slices (_consolidated_16bit_state_dict)
with open(os.path.join(out_dir, f"result-{engine.global_rank}.json"), "w") as f:
    json.dump({"logged_total": total, "train_batch_size": engine.train_batch_size(), "losses": losses.losses,
               "tp": engine.autotp_size(), "split_bytes": split, "engine": type(engine).__name__}, f)
