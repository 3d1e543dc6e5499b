"""A tiny distributed script for the launcher's integration tests: one mode per behaviour.

Run by the tests through ``shardwise``, ``python -m shardwise.launcher`` or ``torchrun``:

* ``env``: print every variable of the launch contract and the ``--local_rank`` argument,
  then check that an all-reduce over all ranks works (and, with ``--deepspeed_config``, the
  batch sizes the elastic config gives for this world size);
* ``raise``: rank 1 raises while rank 0 waits in a barrier;
* ``skip``: rank 1 skips an all-reduce and goes to a barrier (a collective mismatch);
* ``subset``: only rank 0 enters a sync point (``check_all_ranks_arrive``) while rank 1
  goes on to its next all-reduce, as with ``if rank == 0: save_checkpoint()``;
* ``exit``: end with torch's own ``dist.destroy_process_group()`` (shardwise's diagnostics
  are not told) and report, from an exit handler that runs after shardwise's, whether the
  diagnostics thread is still alive while the interpreter finalizes;
* ``forever``: write ``rank-<RANK>.pid`` into the working directory, then all-reduce every
  0.1 s until killed (for the tests that kill the launcher or an agent).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import threading
import time

import torch
import torch.distributed as dist

import shardwise


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["env", "raise", "skip", "subset", "exit", "forever"])
    parser.add_argument("--local_rank", type=int, default=None)
    parser.add_argument("--deepspeed_config", default=None)
    args = parser.parse_args()
    if args.mode == "exit":
        atexit.register(_report_threads_at_exit)  # registered first: runs after shardwise's own

    shardwise.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)

    if args.mode == "env":
        names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "SW_TEST_FROM_ENV_FILE"]  # fmt: skip
        info = {name: os.environ.get(name) for name in names}
        info["local_rank_arg"] = args.local_rank
        info["allreduce"] = total.item()
        if args.deepspeed_config:
            from shardwise.config import load_config

            cfg = load_config(args.deepspeed_config, world_size=world)
            info["batch"] = [
                cfg.config.train_batch_size,
                cfg.config.train_micro_batch_size_per_gpu,
                cfg.config.gradient_accumulation_steps,
            ]
        # one write() of under PIPE_BUF bytes is atomic: ranks sharing the pipe never interleave
        os.write(1, ("ENV " + json.dumps(info, sort_keys=True) + "\n").encode())
    elif args.mode == "raise":
        if rank == 1:
            raise ValueError("rank 1 exploded on purpose")
        dist.barrier()
    elif args.mode == "skip":
        if rank != 1:
            dist.all_reduce(torch.ones(4))
        dist.barrier()
    elif args.mode == "subset":
        from shardwise.comm.diagnostics import check_all_ranks_arrive

        if rank == 0:
            check_all_ranks_arrive("save_checkpoint")
        dist.all_reduce(torch.ones(4))
    elif args.mode == "exit":
        dist.barrier()
        dist.destroy_process_group()
        return
    elif args.mode == "forever":
        with open(f"rank-{rank}.pid.tmp", "w") as handle:
            handle.write(str(os.getpid()))
        os.replace(f"rank-{rank}.pid.tmp", f"rank-{rank}.pid")  # the test never reads half a pid
        while True:
            dist.all_reduce(torch.ones(4))
            time.sleep(0.1)
    shardwise.comm.destroy_process_group()


def _report_threads_at_exit() -> None:
    alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("shardwise-") and t.is_alive())
    os.write(1, ("EXIT " + json.dumps({"rank": os.environ.get("RANK"), "alive": alive}) + "\n").encode())


if __name__ == "__main__":
    main()
