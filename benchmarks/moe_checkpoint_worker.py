"""DeepSpeed's side of ``moe_checkpoint_interop.py``: one rank of real DeepSpeed (``DS_ACCELERATOR=cpu``)
loading (``--load``) or writing (``--save``) a stage-0 MoE checkpoint of the tiny MoE GPT of
``tests/distributed/moe_cases.py`` (the same module tree, DeepSpeed's ``MoE``), printing one JSON line
per rank (the next step's loss); ``--dump`` writes its weights and Adam moments by global name.
Never imported by shardwise; run by the driver with a DeepSpeed interpreter."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "distributed"))
from moe_cases import BATCH, batches, build_model


def build(ep_size: int, seed: int) -> nn.Module:
    """The tiny MoE GPT of ``moe_cases.build_model`` (the same module tree and names) with DeepSpeed's ``MoE``."""
    from deepspeed.moe.layer import MoE

    return build_model(ep_size, seed, moe_class=MoE)


def _by_global_name(engine) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """``{name: weight}`` and ``{name/exp_avg: ...}`` with local expert indices made global."""
    from deepspeed.moe.layer import MoE

    def global_name(name: str) -> str:
        for path, module in engine.module.named_modules():
            head = f"{path}.deepspeed_moe.experts.deepspeed_experts."
            if isinstance(module, MoE) and name.startswith(head):
                local, _, rest = name[len(head):].partition(".")
                ep_rank = torch.distributed.get_rank(module.deepspeed_moe.ep_group) if module.ep_size > 1 else 0
                return f"{head}{ep_rank * module.num_local_experts + int(local)}.{rest}"
        return name

    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    wrapper = engine.optimizer
    if hasattr(wrapper, "fp16_groups") and hasattr(wrapper, "fp32_groups_flat"):  # the fused 16-bit wrapper
        names = {id(p): n for n, p in engine.module.named_parameters()}
        for params, flat in zip(wrapper.fp16_groups, wrapper.fp32_groups_flat):
            state = wrapper.optimizer.state.get(flat, {})
            offset = 0
            for param in params:
                cut = slice(offset, offset + param.numel())
                out[global_name(names[id(param)])] = flat.detach()[cut].view(param.shape).clone()
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state:
                        out[f"{global_name(names[id(param)])}/{key}"] = state[key][cut].view(param.shape).clone()
                offset += param.numel()
        return out
    if hasattr(wrapper, "fp16_groups") and hasattr(wrapper, "fp32_groups"):  # the unfused 16-bit wrapper
        names = {id(p): n for n, p in engine.module.named_parameters()}
        for params, masters in zip(wrapper.fp16_groups, wrapper.fp32_groups):
            for param, master in zip(params, masters):
                out[global_name(names[id(param)])] = master.detach().clone()
                for key, value in wrapper.optimizer.state.get(master, {}).items():
                    if key in ("exp_avg", "exp_avg_sq"):
                        out[f"{global_name(names[id(param)])}/{key}"] = value.detach().clone()
        return out
    zero = engine.zero_optimization_stage() > 0
    for name, param in engine.module.named_parameters():
        out[global_name(name)] = (safe_get_full_fp32_param(param) if zero else param).detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            try:
                value = safe_get_full_optimizer_state(param, key) if zero else engine.optimizer.state[param][key]
            except (KeyError, ValueError):  # none (module only), or DeepSpeed cannot give it: not compared
                continue
            out[f"{global_name(name)}/{key}"] = value.detach().clone()
    return out


def main() -> None:
    """Load or save, then print this rank's record."""
    import deepspeed

    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--tag", default="t2")
    parser.add_argument("--ep", type=int, required=True)
    parser.add_argument("--save", action="store_true", help="train 3 steps and save instead of loading")
    parser.add_argument("--stage", type=int, default=0, help="ZeRO stage")
    parser.add_argument("--bf16", action="store_true", help="bf16 training (DeepSpeed's 16-bit wrapper)")
    parser.add_argument("--module-only", action="store_true", help="load with load_module_only=True")
    parser.add_argument("--dump", help="write this rank's weights and Adam moments by global name here")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    model = build(args.ep, seed=99)
    config = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": args.stage}}
    if args.bf16:
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    data = batches(rank, 4)
    if args.save:
        torch.manual_seed(7)
        for tokens in data[:3]:
            loss, _ = engine(tokens)
            engine.backward(loss)
            engine.step()
        engine.save_checkpoint(args.dir, tag=args.tag)
    else:
        engine.load_checkpoint(args.dir, tag=args.tag, load_module_only=args.module_only)
    if args.dump:
        torch.save(_by_global_name(engine), f"{args.dump}.{rank}")
    torch.manual_seed(11)
    loss, _ = engine(data[3])
    print("RECORD " + json.dumps({"rank": rank, "next_loss": loss.item()}), flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
