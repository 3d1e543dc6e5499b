"""One rank of ``moe_checkpoint_interop.py``'s AutoEP exchange, on either side: DeepSpeed's own AutoEP test
model (``unit.v1.moe.autoep_test_utils`` of a DeepSpeed checkout, on ``PYTHONPATH``) built by whichever
``deepspeed`` is importable (real DeepSpeed, or the package ``shardwise compat install-deepspeed`` writes).

``save DIR``: save at once and keep the parameters in ``DIR/params.pt``. ``load DIR``: scramble the
parameters, load ``DIR`` (module only when ``--module-only``) and print how many parameters differ
from ``params.pt`` (``RECORD {...}``)."""

from __future__ import annotations

import argparse
import json

import torch
from unit.v1.moe.autoep_test_utils import init_autoep_engine


def main() -> None:
    """Save or load, then print this rank's record."""
    parser = argparse.ArgumentParser()
    parser.add_argument("action", choices=["save", "load"])
    parser.add_argument("dir")
    parser.add_argument("--module-only", action="store_true")
    args = parser.parse_args()
    engine = init_autoep_engine(ep_size=1)
    if args.action == "save":
        engine.save_checkpoint(args.dir, tag="a")
        torch.save({n: p.detach().clone() for n, p in engine.module.named_parameters()}, f"{args.dir}/params.pt")
        return
    with torch.no_grad():
        for param in engine.module.parameters():
            param.normal_()
    engine.load_checkpoint(args.dir, tag="a", load_module_only=args.module_only)
    want = torch.load(f"{args.dir}/params.pt")
    got = {n: p.detach() for n, p in engine.module.named_parameters()}
    differ = [n for n in got if n not in want or not torch.equal(got[n].float(), want[n].float())]
    print("RECORD " + json.dumps({"params": len(got), "differ": differ}), flush=True)


if __name__ == "__main__":
    main()
