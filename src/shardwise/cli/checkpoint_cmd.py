"""``shardwise checkpoint info|export``: inspect checkpoints and export their weights.

``info DIR`` lists the tags of a save directory (or one tag directory) with their layout
and size; ``export DIR OUT`` streams the model weights of the latest (or ``--tag``)
checkpoint, shardwise or DeepSpeed, any stage and world size, into one safetensors or
``torch.load`` file with memory near the largest tensor.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(subparsers: Any) -> None:
    """Register ``checkpoint`` and its sub-commands."""
    parser = subparsers.add_parser("checkpoint", help="inspect a checkpoint or export its weights")
    sub = parser.add_subparsers(dest="checkpoint_command", required=True)
    info = sub.add_parser("info", help="tags, world size, ZeRO stage, sizes")
    info.add_argument("dir", metavar="DIR", help="a save directory or one tag directory")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=_info)
    export = sub.add_parser("export", help="write the model weights to one file, tensor by tensor")
    export.add_argument("dir", metavar="DIR", help="a save directory (uses 'latest') or a tag directory")
    export.add_argument(
        "out", metavar="OUT", help="output file, or a directory for model.safetensors/pytorch_model.bin"
    )
    export.add_argument("--tag", default=None, help="the tag to export instead of 'latest'")
    export.add_argument("--dtype", choices=["fp32", "bf16", "fp16", "keep"], default="fp32")
    export.add_argument("--format", dest="fmt", choices=["safetensors", "pt"], default=None)
    export.add_argument("--exclude-frozen", action="store_true", help="leave out frozen parameters")
    export.set_defaults(func=_export)


def _size(num: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num < 1024 or unit == "GiB":
            return f"{num:.1f} {unit}" if unit != "B" else f"{int(num)} B"
        num /= 1024
    return f"{num:.1f} GiB"


def _info(args: argparse.Namespace) -> int:
    from shardwise.checkpoint.export import checkpoint_info

    try:
        info = checkpoint_info(args.dir)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    if not info["tags"]:
        print(f"{info['dir']}: no checkpoints")
        return 1
    print(f"{info['dir']}  (latest: {info['latest']})")
    for tag in info["tags"]:
        params = tag.get("trainable_parameters")
        extra = (
            f", {params:,} trainable + {tag.get('frozen_parameters') or 0:,} frozen params" if params else ""
        )
        print(
            f"  {tag['tag']}: {tag['kind']}, ZeRO {tag.get('zero_stage')}, world size {tag.get('world_size')}, "
            f"step {tag.get('global_steps')}, {_size(tag['bytes'])}{extra}"
        )
    return 0


def _export(args: argparse.Namespace) -> int:
    from shardwise.checkpoint.export import export_checkpoint

    try:
        out = export_checkpoint(
            args.dir,
            args.out,
            tag=args.tag,
            dtype=None if args.dtype == "keep" else args.dtype,
            fmt=args.fmt,
            exclude_frozen_parameters=args.exclude_frozen,
        )
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({_size(out.stat().st_size)})")
    return 0
