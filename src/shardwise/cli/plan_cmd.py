"""``shardwise config plan FILE --params N --world-size W``: model-state memory per rank.

Reads the config (stage, precision, optimizer, offload blocks), prints the bytes each
rank holds for parameters, gradients and optimizer state, on the device and offloaded,
and, at stage 3, what the file's ``zero_optimization`` keys do on this engine (FSDP2).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """``"7B"``, ``"125M"``, ``"1.3e9"`` or ``"350000"`` as a whole number.

    Example:
        >>> parse_count("1.3B"), parse_count("125M"), parse_count("5e8")
        (1300000000, 125000000, 500000000)
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (write 350000, 5e8, 125M or 7B)")
    value = float(match.group(1)) * _SUFFIXES[match.group(2).lower()]
    if value < 0:
        raise argparse.ArgumentTypeError(f"the count must be >= 0, got {text!r}")
    return round(value)


def _config_subparsers(subparsers: Any) -> Any:
    config_parser = subparsers.choices.get("config")
    if config_parser is None:
        raise RuntimeError("register the 'config' command (config_cmd.add_parser) before plan_cmd.add_parser")
    for action in config_parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    raise RuntimeError("the 'config' command has no sub-commands to add 'plan' to")


def add_parser(subparsers: object) -> None:
    """Register ``config plan`` under the existing ``config`` command."""
    parser = _config_subparsers(subparsers).add_parser(
        "plan", help="model-state memory per rank (params, grads, optimizer state, offload)"
    )
    parser.add_argument("file", metavar="FILE")
    parser.add_argument(
        "--params", type=parse_count, required=True, help="trainable parameters (e.g. 7B, 125M)"
    )
    parser.add_argument("--frozen", type=parse_count, default=0, help="frozen parameters (LoRA base weights)")
    parser.add_argument("--world-size", type=int, default=1, help="data-parallel ranks")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the plan for one file; exit status 1 on a config error."""
    from shardwise.config import ConfigError, load_config
    from shardwise.config.provenance import Source
    from shardwise.utils.logging import set_log_level
    from shardwise.zero.memory_plan import plan_from_config
    from shardwise.zero.stage3_settings import engine_notes

    set_log_level("ERROR")
    if args.world_size < 1:
        print(f"--world-size must be >= 1, got {args.world_size}", file=sys.stderr)
        return 1
    try:
        resolved = load_config(args.file, world_size=args.world_size)
        plan = plan_from_config(resolved.config, args.params, args.world_size, frozen_numel=args.frozen)
    except (ConfigError, ValueError) as exc:
        print(f"FAIL {args.file}\n  {str(exc).replace(chr(10), chr(10) + '  ')}", file=sys.stderr)
        return 1
    from_file = {k for k, p in resolved.sources.items() if p.source is Source.FILE}
    config = resolved.config
    notes = engine_notes(resolved.flat(), config.zero_stage, only=from_file) if config.zero_stage == 3 else {}
    if args.json:
        data = {
            "file": args.file,
            "stage": plan.stage,
            "world_size": plan.world_size,
            "trainable": plan.trainable,
            "frozen": plan.frozen,
            "bytes_per_rank": {
                "params": plan.params,
                "grads": plan.grads,
                "optimizer": plan.optimizer,
                "offloaded_host": plan.offloaded_host,
                "offloaded_nvme": plan.offloaded_nvme,
                "device_total": plan.device_total,
                "memory_total": plan.memory_total,
            },
            "notes": list(plan.notes),
            "engine_notes": notes,
        }
        print(json.dumps(data, indent=2))
        return 0
    print(
        f"{args.file}: {config.precision}, optimizer {config.optimizer.type if config.optimizer else 'AdamW (assumed)'}"
    )
    print(plan.format())
    if notes:
        print("\nHow this file's ZeRO keys act on shardwise stage 3 (FSDP2):")
        width = max(len(k) for k in notes)
        for key, note in notes.items():
            print(f"  {key.ljust(width)}  {note}")
    return 0
