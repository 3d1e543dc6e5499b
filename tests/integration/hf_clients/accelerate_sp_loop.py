"""accelerate with ``ParallelismConfig(sp_backend="deepspeed", sp_size=2)`` on a tiny Llama (ALST/Ulysses).

usage: torchrun --nproc-per-node 2 accelerate_sp_loop.py STAGE OUT_DIR

First every rank trains a plain copy of the model (torch SGD with gradient clipping at 1.0, whole sequences, no accelerate) on the
samples in the order the sequence-parallel run will see them; then accelerate prepares the same model
with sequence parallelism: it registers Ulysses attention (``UlyssesSPAttentionHF``), wraps the
loader in ``UlyssesSPDataLoaderAdapter`` and passes the mpu to ``deepspeed.initialize``. The loss is
ALST's token-weighted reduction over the SP group. Rank 0 writes OUT_DIR/sp.pt with both loss lists.
"""

from __future__ import annotations

import os
import sys

import torch
from accelerate import Accelerator
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import DeepSpeedPlugin, DeepSpeedSequenceParallelConfig, InitProcessGroupKwargs
from transformers import LlamaConfig, LlamaForCausalLM

stage, out_dir = int(sys.argv[1]), sys.argv[2]
STEPS, SEQ = 4, 16


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


tokens = torch.randint(0, 64, (STEPS, SEQ), generator=torch.Generator().manual_seed(0))


def collate(rows: list[tuple[torch.Tensor]]) -> dict[str, torch.Tensor]:
    ids = torch.stack([r[0] for r in rows])
    return {"input_ids": ids, "position_ids": torch.arange(SEQ).expand_as(ids).clone(), "labels": ids.clone()}


reference = tiny_llama()
plain = torch.optim.SGD(reference.parameters(), lr=0.1)
expected = []
for step in range(STEPS):
    loss = reference(**collate([(tokens[step],)])).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)  # the norm is above 1: clipping acts
    plain.step()
    plain.zero_grad()
    expected.append(loss.item())

ds_config = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,  # the gradient norm over the SP ranks must be the whole sequence's
    "zero_optimization": {"stage": stage},
    "zero_allow_untested_optimizer": True,  # SGD is element-wise: exact on ZeRO's shards
}
plugin = DeepSpeedPlugin(hf_ds_config=ds_config)
parallelism = ParallelismConfig(
    sp_backend="deepspeed",
    sp_size=2,
    sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"),
)
accelerator = Accelerator(
    deepspeed_plugin=plugin,
    parallelism_config=parallelism,
    kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
)
model = tiny_llama()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=1, collate_fn=collate)
engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
assert type(engine).__name__ == "ShardwiseEngine", type(engine)
assert type(loader).__name__ == "UlyssesSPDataLoaderAdapter", type(loader)

from deepspeed.utils import groups  # noqa: E402 - the compatibility package, after accelerate set it up

sp_group = groups._get_sequence_parallel_group()
assert groups._get_sequence_parallel_world_size() == 2 and engine.sequence_parallel_size == 2
got = []
for shard in loader:
    logits = engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
    labels = shard["shift_labels"].to(logits.device)
    local = torch.nn.functional.cross_entropy(
        logits.view(-1, logits.shape[-1]).float(), labels.view(-1), ignore_index=-100, reduction="sum"
    )
    count = (labels != -100).sum().to(local.dtype)
    # ALST's reduction: differentiable all-gather of each rank's sum, divided by the group's token count
    sums = torch.distributed.nn.functional.all_gather(local, group=sp_group)
    counts = torch.distributed.nn.functional.all_gather(count, group=sp_group)
    loss = sum(sums) / sum(counts)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    got.append(loss.item())
if accelerator.is_main_process:
    torch.save({"expected": expected, "got": got}, os.path.join(out_dir, "sp.pt"))
accelerator.end_training()
