"""Trainer with DeepSpeed sequence parallelism (``parallelism_config`` with ``sp_backend="deepspeed"``, sp 2).

usage: torchrun --nproc-per-node 2 trainer_sp_run.py OUT_DIR
A tiny Llama (SDPA) trains 4 steps on 32-token sequences through the 'deepspeed' compatibility package:
the Trainer registers Ulysses attention, wraps its loader in UlyssesSPDataLoaderAdapter and reduces the
loss over the SP group itself. Rank 0 writes OUT_DIR/trainer_sp.pt: the logged losses, the engine's
sequence-parallel size,
and every sample's whole-sequence loss before training (the first step's loss must be one of them).
"""

from __future__ import annotations

import os
import sys

os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
from accelerate import PartialState

PartialState(backend="gloo")  # on CPU accelerate counts the processes only with a backend

import torch  # noqa: E402
from accelerate.parallelism_config import ParallelismConfig  # noqa: E402
from accelerate.utils import DeepSpeedSequenceParallelConfig  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

out_dir = sys.argv[1]
SEQ = 32
data = torch.randint(0, 64, (16, SEQ), generator=torch.Generator().manual_seed(0))


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return len(data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": data[i], "labels": data[i], "position_ids": torch.arange(SEQ)}


torch.manual_seed(0)
model = LlamaForCausalLM(
    LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
)
with torch.no_grad():  # every sample's whole-sequence loss at initialisation (before Ulysses is registered)
    initial = [model(input_ids=row[None], labels=row[None]).loss.item() for row in data]
ds_config = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 2},
}
parallelism = ParallelismConfig(
    sp_backend="deepspeed",
    sp_size=2,
    sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"),
)
args = TrainingArguments(
    output_dir=out_dir,
    per_device_train_batch_size=1,
    max_steps=4,
    learning_rate=1e-3,
    logging_steps=1,
    report_to=[],
    deepspeed=ds_config,
    parallelism_config=parallelism,
    accelerator_config={"use_configured_state": True},
    seed=0,
    disable_tqdm=True,
    save_strategy="no",
)
trainer = Trainer(model=model, args=args, train_dataset=Tokens())
trainer.train()
engine = trainer.model_wrapped
assert type(engine).__name__ == "ShardwiseEngine", type(engine)
if trainer.is_world_process_zero():
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    record = {"losses": losses, "initial": initial, "sp": engine.sequence_parallel_size}
    torch.save(record, os.path.join(out_dir, "trainer_sp.pt"))
