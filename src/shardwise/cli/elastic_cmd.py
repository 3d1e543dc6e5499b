"""``shardwise elastic FILE [--world-size N]``: the elastic batch size and the GPU counts it allows.

DeepSpeed's ``ds_elastic -c ds_config.json [-w N]`` (spec 10.5), on the pure algorithm in
:mod:`shardwise.elasticity`: prints the ``elasticity`` block, then ``final_batch_size`` and
``valid_gpus`` and, for a world size, the micro batch and gradient accumulation steps each
rank will use.

Example:
    shardwise elastic ds_config.json --world-size 8
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(subparsers: Any) -> None:
    """Register ``elastic``."""
    parser = subparsers.add_parser(
        "elastic", help="elastic batch size and valid GPU counts of a ds_config (DeepSpeed's ds_elastic)"
    )
    parser.add_argument("file", nargs="?", metavar="FILE", help="the ds_config with an 'elasticity' block")
    parser.add_argument(
        "-c", "--config", dest="config_opt", default=None, help="same as FILE (ds_elastic's flag)"
    )
    parser.add_argument(
        "-w", "--world-size", "--world_size", dest="world_size", type=int, default=0,
        help="the number of GPUs to compute the micro batch for",
    )  # fmt: skip
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from shardwise.config.loading import read_config_source
    from shardwise.elasticity import ElasticityError, compute_elastic_config, elastic_batch_for_world_size

    path = args.file or args.config_opt
    if not path:
        print("shardwise elastic: give the config file (FILE or -c FILE)", file=sys.stderr)
        return 2
    try:
        config, _ = read_config_source(path)
        block = config.get("elasticity")
        print("-" * 42 + "\nElasticity config:\n" + "-" * 42)
        print(json.dumps(block, indent=4, sort_keys=True))
        print("-" * 42)
        micro: int | None = None
        gas: int | None = None
        if args.world_size > 0:
            final, valid, micro = compute_elastic_config(
                config, world_size=args.world_size, return_microbatch=True
            )
            _, _, gas = elastic_batch_for_world_size(config, args.world_size)
            print(f"Calculated results for world size {args.world_size}:\n" + "-" * 42)
        else:
            final, valid = compute_elastic_config(config)
            print("Calculated results:\n" + "-" * 42)
    except (ElasticityError, ValueError) as exc:
        print(f"shardwise elastic: {path}: {exc}", file=sys.stderr)
        return 1
    print(f"final_batch_size .... {final}")
    print(f"valid_gpus .......... {valid}")
    if micro is not None:
        print(f"micro_batch_size .... {micro}")
        print(f"gradient_accumulation_steps .... {gas}")
    return 0
