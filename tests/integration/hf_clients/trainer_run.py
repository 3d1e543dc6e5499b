"""Trainer on shardwise through the 'deepspeed' compatibility package.

usage: torchrun --nproc-per-node 2 trainer_run.py DS_CONFIG OUT_DIR [resume]
Trains 6 optimizer steps (micro batch 2, accumulation 2), saves at step 3 and 6 and the final model in
OUT_DIR/final; with ``resume`` it resumes from OUT_DIR/checkpoint-3.
"""

from __future__ import annotations

import os
import sys

os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
from accelerate import PartialState

PartialState(backend="gloo")  # on CPU accelerate counts the processes only with a backend

import torch  # noqa: E402
from tiny import tiny_gpt2, token_data  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

config_path, out_dir, resume = sys.argv[1], sys.argv[2], "resume" in sys.argv[3:]
data = token_data()


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return len(data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": data[i], "labels": data[i]}


args = TrainingArguments(
    output_dir=out_dir,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    max_steps=6,
    learning_rate=1e-3,
    warmup_steps=2,
    save_strategy="steps",
    save_steps=3,
    logging_steps=1,
    report_to=[],
    deepspeed=config_path,
    accelerator_config={"use_configured_state": True},
    seed=0,
    disable_tqdm=True,
)
trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens())
trainer.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-3") if resume else None)
assert type(trainer.model_wrapped).__name__ == "ShardwiseEngine", type(trainer.model_wrapped)
trainer.save_model(os.path.join(out_dir, "final"))
