"""One rank of ``moe_checkpoint_interop.py``'s AutoEP exchange, on either side: DeepSpeed's own AutoEP test
model (``unit.v1.moe.autoep_test_utils`` of a DeepSpeed checkout, on ``PYTHONPATH``) built by whichever
``deepspeed`` is importable (real DeepSpeed, or the package ``shardwise compat install-deepspeed`` writes).

``save DIR``: one training step, save, and keep the parameters in ``DIR/params.pt``. ``load DIR``:
scramble the parameters, load ``DIR`` (module only when ``--module-only``, the tag ``--tag``) and print
how many parameters differ from ``params.pt`` (``RECORD {...}``); ``--dump FILE`` also writes the fp32
masters and Adam moments by name, ``--resave DIR`` saves the loaded engine again."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from unit.v1.moe.autoep_test_utils import init_autoep_engine

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    """Save or load, then print this rank's record."""
    parser = argparse.ArgumentParser()
    parser.add_argument("action", choices=["save", "load"])
    parser.add_argument("dir")
    parser.add_argument("--tag", default="a")
    parser.add_argument("--module-only", action="store_true")
    parser.add_argument("--dump")
    parser.add_argument("--resave", help="after loading, save again here (tag 'a')")
    args = parser.parse_args()
    engine = init_autoep_engine(ep_size=1)
    if args.action == "save":
        dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
        loss = engine(torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(0)).to(dtype)).float().mean()
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(args.dir, tag="a")
        torch.save({n: p.detach().clone() for n, p in engine.module.named_parameters()}, f"{args.dir}/params.pt")
        return
    with torch.no_grad():
        for param in engine.module.parameters():
            param.normal_()
    engine.load_checkpoint(args.dir, tag=args.tag, load_module_only=args.module_only)
    want = torch.load(f"{args.dir}/params.pt")
    got = {n: p.detach() for n, p in engine.module.named_parameters()}
    differ = [n for n in got if n not in want or not torch.equal(got[n].float(), want[n].float())]
    if args.dump:
        from moe_checkpoint_worker import _by_global_name

        torch.save(_by_global_name(engine), args.dump)
    if args.resave:
        engine.save_checkpoint(args.resave, tag="a")
    print("RECORD " + json.dumps({"params": len(got), "differ": differ}), flush=True)


if __name__ == "__main__":
    main()
