"""How much of DeepSpeed's Python API real client code reaches through shardwise's ``deepspeed``.

Two measures, printed as markdown tables:

* ``--clients DIR ...``: every ``deepspeed`` name a client's sources use (``import deepspeed.x``,
  ``from deepspeed.x import y``, ``deepspeed.x.y`` attribute chains), found with ``ast`` (nothing
  is executed), and whether the ``deepspeed`` importable here resolves it. Run it with the
  compatibility package on the path (``shardwise compat install-deepspeed --target T`` then
  ``PYTHONPATH=T``), or with DeepSpeed itself installed to see the control side.
* ``--engine-control PYTHON``: the public attributes of DeepSpeed's ``DeepSpeedEngine`` (listed by
  ``PYTHON``, which has DeepSpeed installed) that an engine built here lacks. Their presence only;
  each one's behaviour is tested where it is implemented.

Example::

    PYTHONPATH=/tmp/swsite python benchmarks/client_api_coverage.py \
        --clients /work/clients/megatron-deepspeed /work/clients/openrlhf \
        --engine-control /work/venv-ds/bin/python
"""

from __future__ import annotations

import argparse
import ast
import collections
import importlib
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

Use = tuple[str, str | None]  # (module path, attribute or None for a plain import)


def _python_files(root: Path) -> Iterator[Path]:
    for dirpath, _, names in os.walk(root, followlinks=True):
        for name in names:
            if name.endswith(".py"):
                yield Path(dirpath) / name


def _attribute_chain(node: ast.Attribute) -> list[str] | None:
    parts: list[str] = []
    current: ast.expr = node
    while isinstance(current, ast.Attribute):
        parts.append(current.attr)
        current = current.value
    if isinstance(current, ast.Name) and current.id == "deepspeed":
        return list(reversed(parts))
    return None


def uses_in(source: str) -> Iterator[Use]:
    """The ``deepspeed`` names one file's source uses (a file that does not parse uses none)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "deepspeed":
                for alias in node.names:
                    if alias.name != "*":
                        yield node.module, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "deepspeed":
                    yield alias.name, None
        elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "ctx", None), ast.Store):
            chain = _attribute_chain(node)
            if chain:
                # deepspeed.a.b.c -> the longest importable module prefix is decided at resolve time
                yield ".".join(["deepspeed", *chain[:-1]]), chain[-1]


def client_uses(root: Path) -> collections.Counter[Use]:
    """Every use in a client tree, counted."""
    counts: collections.Counter[Use] = collections.Counter()
    for path in _python_files(root):
        counts.update(uses_in(path.read_text(errors="ignore")))
    return counts


def _chain_resolves(module_path: str, name: str | None) -> bool:
    """``deepspeed.a.Class.ATTR``: import the longest module prefix, then read the rest as attributes."""
    parts = module_path.split(".") + ([name] if name else [])
    for cut in range(len(parts) - 1, 0, -1):
        try:
            value: object = importlib.import_module(".".join(parts[:cut]))
        except Exception:
            continue
        try:
            for attr in parts[cut:]:
                value = getattr(value, attr)
        except AttributeError:
            return False
        return True
    return False


def resolves(use: Use) -> bool:
    """Whether ``deepspeed`` here provides it: the module imports and has the attribute (or the
    attribute is itself a submodule)."""
    module_path, name = use
    try:
        module = importlib.import_module(module_path)
    except Exception:  # any import failure: an attribute chain through a class (a.b.Class.ATTR)?
        return _chain_resolves(module_path, name)
    if name is None:
        return True
    try:
        getattr(module, name)
        return True
    except AttributeError:
        pass
    try:
        importlib.import_module(f"{module_path}.{name}")
        return True
    except Exception:
        return False


def _engine_names(control_python: str) -> list[str]:
    script = (
        "import warnings, torch\nwarnings.filterwarnings('ignore')\n"
        "from deepspeed.runtime.engine import DeepSpeedEngine as E\n"
        "base = set(dir(torch.nn.Module))\n"
        "print('\\n'.join('NAME:' + n for n in dir(E) if not n.startswith('_') and n not in base))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the control's own deepspeed
    out = subprocess.run(
        [control_python, "-c", script], capture_output=True, text=True, check=True, env=env
    ).stdout
    return [line[5:] for line in out.splitlines() if line.startswith("NAME:")]


def missing_engine_names(control_python: str) -> tuple[list[str], int]:
    """DeepSpeedEngine's public names an engine built here (1 rank, gloo) lacks, and how many there are."""
    import torch

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    import deepspeed  # the compatibility package on PYTHONPATH

    names = _engine_names(control_python)
    engine, *_ = deepspeed.initialize(
        model=torch.nn.Linear(4, 4),
        config={"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
    )
    missing = []
    for name in names:
        try:
            getattr(engine, name)
        except AttributeError:
            missing.append(name)
    return missing, len(names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", nargs="*", type=Path, default=[], help="client source trees")
    parser.add_argument("--engine-control", help="a python with DeepSpeed installed")
    parser.add_argument("--list", action="store_true", help="list every unresolved name")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.clients:
        print("| client | distinct names used | resolve | do not |")
        print("|---|---|---|---|")
        details = []
        for root in args.clients:
            counts = client_uses(root)
            bad = sorted(((c, u) for u, c in counts.items() if not resolves(u)), key=lambda t: (-t[0], t[1]))
            print(f"| {root.name} | {len(counts)} | {len(counts) - len(bad)} | {len(bad)} |")
            details.append((root.name, bad))
        if args.list:
            for name, bad in details:
                for count, (module_path, attr) in bad:
                    print(f"{name}: {count} x {module_path}{'' if attr is None else '.' + attr}")
    if args.engine_control:
        missing, total = missing_engine_names(args.engine_control)
        print(f"\nDeepSpeedEngine public names: {total}; missing here: {len(missing)}")
        if args.list and missing:
            print(" ".join(missing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
