"""``shardwise checkpoint info|verify|export|to-universal|to-deepspeed|from-universal``: inspect, verify, export, convert.

``info DIR`` lists the tags of a save directory (or one tag directory) with their layout,
size and integrity (sizes and index; ``--verify`` for every checksum); ``verify DIR [--tag T]``
checks every file of every tag (or of ``T``) against the checksums recorded at save, one
line per tag, exit 0 when none is damaged and 1 otherwise; ``export DIR OUT`` streams the
model weights of the latest (or ``--tag``) checkpoint, shardwise or DeepSpeed, any stage
and world size, into one safetensors or ``torch.load`` file with memory near the largest
tensor, and refuses a damaged checkpoint; ``to-universal DIR OUT`` writes DeepSpeed's universal layout
(``latest_universal``, ``<tag>/zero/<param>/*.pt``) that DeepSpeed resumes with
``"load_universal": true`` (at stages 1-3), ``to-deepspeed DIR OUT`` writes DeepSpeed's native
ZeRO-0 layout (``latest``, ``<tag>/mp_rank_00_model_states.pt``), which a DeepSpeed stage-0 run
resumes without ``load_universal``, and ``from-universal DIR OUT`` turns one (``ds_to_universal``'s or
ours) into a shardwise checkpoint. Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# What reading a damaged or foreign checkpoint can raise; reported as one line, exit 1.
_READ_ERRORS = (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError)


def add_parser(subparsers: Any) -> None:
    """Register ``checkpoint`` and its sub-commands."""
    parser = subparsers.add_parser("checkpoint", help="inspect a checkpoint or export its weights")
    sub = parser.add_subparsers(dest="checkpoint_command", required=True)
    info = sub.add_parser("info", help="tags, world size, ZeRO stage, sizes")
    info.add_argument("dir", metavar="DIR", help="a save directory or one tag directory")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument("--verify", action="store_true", help="check every checksum (reads all files)")
    info.set_defaults(func=_info)
    verify = sub.add_parser("verify", help="check every file against its checksum; exit 1 if damaged")
    verify.add_argument("dir", metavar="DIR", help="a save directory or one tag directory")
    verify.add_argument("--tag", default=None, help="verify only this tag")
    verify.set_defaults(func=_verify)
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
    to_uni = sub.add_parser("to-universal", help="write DeepSpeed's universal checkpoint layout")
    to_uni.add_argument(
        "dir", metavar="DIR", help="a shardwise save directory (uses 'latest') or a tag directory"
    )
    to_uni.add_argument("out", metavar="OUT", help="output directory: OUT/<tag>/ and OUT/latest_universal")
    to_uni.add_argument("--tag", default=None, help="the tag to convert instead of 'latest'")
    to_uni.set_defaults(func=_to_universal)
    to_ds = sub.add_parser("to-deepspeed", help="write DeepSpeed's native ZeRO-0 checkpoint layout")
    to_ds.add_argument(
        "dir", metavar="DIR", help="a shardwise save directory (uses 'latest') or a tag directory"
    )
    to_ds.add_argument(
        "out", metavar="OUT", help="output directory: OUT/<tag>/mp_rank_00_model_states.pt and OUT/latest"
    )
    to_ds.add_argument("--tag", default=None, help="the tag to convert instead of 'latest'")
    to_ds.add_argument(
        "--ep-size", type=int, default=None,
        help="MoE models: the expert-parallel size of the DeepSpeed run that resumes (default: the saved run's)",
    )
    to_ds.set_defaults(func=_to_deepspeed)
    from_uni = sub.add_parser("from-universal", help="turn a universal checkpoint into a shardwise one")
    from_uni.add_argument(
        "dir", metavar="DIR", help="a directory with latest_universal, or a universal tag directory"
    )
    from_uni.add_argument("out", metavar="OUT", help="output save directory: OUT/<tag>/ and OUT/latest")
    from_uni.add_argument("--tag", default=None, help="the tag to convert instead of 'latest_universal'")
    from_uni.set_defaults(func=_from_universal)


def _size(num: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num < 1024 or unit == "GiB":
            return f"{num:.1f} {unit}" if unit != "B" else f"{int(num)} B"
        num /= 1024
    return f"{num:.1f} GiB"


def _info(args: argparse.Namespace) -> int:
    from shardwise.checkpoint.export import checkpoint_info

    try:
        info = checkpoint_info(args.dir, verify=args.verify)
    except _READ_ERRORS as error:
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
        if tag["integrity"] == "damaged":
            print(f"  {tag['tag']}: {tag['kind']}, DAMAGED: {'; '.join(tag['problems'])}")
            continue
        checked = "checksums ok" if args.verify else "sizes ok"
        status = checked if tag["integrity"] == "ok" else "unverified: no checksums"
        print(
            f"  {tag['tag']}: {tag['kind']}, ZeRO {tag.get('zero_stage')}, world size {tag.get('world_size')}, "
            f"step {tag.get('global_steps')}, {_size(tag['bytes'])}{extra}, {status}"
        )
    return 0


def _verify(args: argparse.Namespace) -> int:
    from shardwise.checkpoint import integrity

    try:
        tag_dirs = integrity.tag_dirs(args.dir, args.tag)
        if not tag_dirs:
            raise FileNotFoundError(f"{args.dir} holds no checkpoint")
        verdicts = [integrity.verify_tag(tag_dir) for tag_dir in tag_dirs]
    except _READ_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for verdict in verdicts:
        name = verdict.tag_dir.name
        if verdict.damaged:
            print(f"{name}: DAMAGED: {'; '.join(verdict.problems)}")
        elif verdict.status == "ok":
            print(f"{name}: ok ({verdict.detail})")
        else:
            print(f"{name}: unverified ({verdict.detail})")
    return 1 if any(v.damaged for v in verdicts) else 0


def _export(args: argparse.Namespace) -> int:
    from shardwise.checkpoint.export import export_checkpoint

    return _convert(
        lambda: export_checkpoint(
            args.dir,
            args.out,
            tag=args.tag,
            dtype=None if args.dtype == "keep" else args.dtype,
            fmt=args.fmt,
            exclude_frozen_parameters=args.exclude_frozen,
        ),
        lambda out: _size(out.stat().st_size),
    )


def _convert(convert: Callable[[], Path], describe: Callable[[Path], str] = lambda out: "") -> int:
    """Run one converter: ``wrote OUT (what)`` and 0, or the reading error on stderr and 1."""
    try:
        out = convert()
    except _READ_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    what = describe(out)
    print(f"wrote {out}" + (f" ({what})" if what else ""))
    return 0


def _to_universal(args: argparse.Namespace) -> int:
    from shardwise.checkpoint.universal_write import shardwise_to_universal

    def describe(out: Path) -> str:
        params = sum(1 for p in (out / "zero").iterdir() if p.is_dir())
        return f"{params} parameters, {_size(sum(f.stat().st_size for f in out.rglob('*') if f.is_file()))}"

    return _convert(lambda: shardwise_to_universal(args.dir, args.out, tag=args.tag), describe)


def _to_deepspeed(args: argparse.Namespace) -> int:
    from shardwise.checkpoint.deepspeed_export import export_deepspeed_stage0

    return _convert(
        lambda: export_deepspeed_stage0(args.dir, args.out, tag=args.tag, ep_size=args.ep_size),
        lambda out: "DeepSpeed ZeRO stage 0; resume it without load_universal",
    )


def _from_universal(args: argparse.Namespace) -> int:
    from shardwise.checkpoint.from_universal import universal_to_shardwise

    return _convert(lambda: universal_to_shardwise(args.dir, args.out, tag=args.tag))
