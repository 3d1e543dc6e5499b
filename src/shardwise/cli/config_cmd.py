"""``shardwise config check|explain FILE``: validate and explain ds_config files.

``check`` runs the validation ``initialize`` runs (everything but what needs the model),
prints the warnings ``initialize`` would give, and lists the settings shardwise accepts
without acting on them under their own heading. Those do not change the exit code unless
``--strict`` is given, which makes them (and unknown keys) errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from shardwise.config import ConfigError


def add_parser(subparsers: Any) -> None:
    """Register ``config`` and its sub-commands."""
    parser = subparsers.add_parser("config", help="check or explain a ds_config.json")
    sub = parser.add_subparsers(dest="config_command", required=True)
    for name, text in (
        ("check", "validate files; exit 1 if any is wrong"),
        ("explain", "show every resolved value and where it came from"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("files", nargs="+", metavar="FILE")
        p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks for the batch rule")
        p.add_argument(
            "--strict",
            action="store_true",
            help="unknown keys and settings shardwise ignores are errors, not warnings",
        )
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help='override a key (fills "auto"), e.g. --set train_micro_batch_size_per_gpu=4',
        )
        p.add_argument("--json", action="store_true", help="print the fully resolved config as JSON")
        if name == "explain":
            p.add_argument("--no-defaults", action="store_true", help="hide values left at their default")
        p.set_defaults(func=_run)


def _overrides(pairs: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set expects KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out


def _run(args: argparse.Namespace) -> int:
    from shardwise.cli.explain import explain
    from shardwise.preflight import load_checked_config
    from shardwise.utils.logging import set_log_level

    set_log_level("ERROR")  # warnings are printed below, once, next to their file
    failed = 0
    overrides = _overrides(args.set)
    for path in args.files:
        try:
            resolved = load_checked_config(
                path, world_size=args.world_size, overrides=overrides, strict=args.strict
            )
        except ConfigError as exc:
            failed += 1
            print(f"FAIL {path}\n  {str(exc).replace(chr(10), chr(10) + '  ')}", file=sys.stderr)
            continue
        if args.json:
            print(json.dumps(resolved.to_ds_dict(), indent=2, sort_keys=False))
        elif args.config_command == "explain":
            print(explain(resolved, show_defaults=not args.no_defaults))
        else:
            counts = [
                f"{len(items)} {label}"
                for items, label in (
                    (resolved.warnings, "warning(s)"),
                    (resolved.ignored, "ignored setting(s)"),
                )
                if items
            ]
            note = f" ({', '.join(counts)})" if counts else ""
            batch = resolved.batch
            print(
                f"OK   {path}: batch {batch.train_batch_size} = {batch.micro_batch_per_gpu} x "
                f"{batch.gradient_accumulation_steps} x {batch.world_size}, ZeRO {resolved.config.zero_stage}, "
                f"{resolved.config.precision}{note}"
            )
            section = resolved.config.checkpoint
            if section.snapshot_interval > 0:
                print(
                    f"     snapshots: every {section.snapshot_interval} optimizer steps into {section.snapshot_dir} "
                    f"(asynchronous; the {section.snapshot_keep} newest kept); load_checkpoint resumes from the "
                    "newest snapshot or checkpoint that verifies"
                )
            for warning in resolved.warnings:
                print(f"     warning: {warning}")
            if resolved.ignored:
                print("     accepted but ignored (--strict makes these errors):")
                for setting in resolved.ignored:
                    print(f"       - {setting.message}")
    return 1 if failed else 0
