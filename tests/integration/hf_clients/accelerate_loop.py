"""An accelerate loop with the client's AdamW and a warm-up scheduler built before ``prepare``.

usage: torchrun --nproc-per-node 2 accelerate_loop.py STAGE OUT_DIR [resume]
   or: accelerate launch --use_deepspeed --deepspeed_config_file F ... accelerate_loop.py launched OUT_DIR
(``launched``: the config comes from ``accelerate launch``, not from the script.)
Checks at every step that the optimizer object that steps is the client's AdamW and that the
learning rate it applies is the scheduler's; saves the state after step 3 (accelerate save_state),
with ``resume`` loads it and runs steps 4-6. Rank 0 writes OUT_DIR/<run>.pt: per-step LRs and the
final weights.
"""

from __future__ import annotations

import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs
from tiny import tiny_gpt2, token_data
from transformers import get_linear_schedule_with_warmup

stage, out_dir, resume = sys.argv[1], sys.argv[2], "resume" in sys.argv[3:]
plugin = None  # launched: accelerate launch's --deepspeed_config_file
if stage != "launched":
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": int(stage)},
    }
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config)
accelerator = Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
model = tiny_gpt2()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(token_data(48)), batch_size=2)
client = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
scheduler = get_linear_schedule_with_warmup(client, num_warmup_steps=4, num_training_steps=40)
engine, optimizer, loader, scheduler = accelerator.prepare(model, client, loader, scheduler)
assert type(engine).__name__ == "ShardwiseEngine", type(engine)
assert engine.optimizer.optimizer is client, "the client's AdamW must be the optimizer that steps"
if resume:
    accelerator.load_state(os.path.join(out_dir, "state"))
    assert engine.optimizer.optimizer is client, "load_state must keep the client's AdamW"
start = 3 if resume else 0
rows = []
for step, (tokens,) in enumerate(loader):
    if step < start:
        continue
    loss = engine(input_ids=tokens, labels=tokens).loss
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    applied = [group["lr"] for group in engine.optimizer.optimizer.param_groups]
    assert applied == scheduler.get_last_lr() == engine.get_lr(), (step, applied, scheduler.get_last_lr())
    rows.append((step, applied[0], float(loss)))
    if step == 2 and not resume:
        accelerator.save_state(os.path.join(out_dir, "state"))
    if step == 5:
        break
weights = {k: v.detach().clone() for k, v in engine._zero3_consolidated_16bit_state_dict().items()}
if accelerator.is_main_process:
    record = {"rows": rows, "weights": weights, "stage": engine.zero_optimization_stage()}
    torch.save(record, os.path.join(out_dir, "resume.pt" if resume else "full.pt"))
accelerator.end_training()
