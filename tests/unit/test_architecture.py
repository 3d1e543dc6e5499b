"""The package map, checked from the source text: no import cycles, layers point down,
``zero/`` does not import ``checkpoint/``, and ``torch.distributed`` is called through ``comm/`` only.

Nothing is imported: every file under ``src/shardwise`` is parsed with :mod:`ast`. Imports inside
functions count as much as module-level ones (a lazy import is still a dependency); imports under
``if TYPE_CHECKING:`` never run, so they count for the layers but not for the cycles.

Known violations inside ``zero/`` and ``checkpoint/`` are being removed by the work on issue 11 and
are listed below with a comment each. The lists are exact: a new violation fails, and so does an
entry that no longer exists (delete it when the code is fixed), so they cannot go stale.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "shardwise"

# ---------------------------------------------------------------------------------------------- layers
# Lowest first. A package may import its own modules and packages of LOWER layers only; packages that
# share a layer are independent of each other. Keys are the first name under ``shardwise`` (a package
# or a top-level module); "" is ``shardwise/__init__.py``, the lazy facade (it imports nothing).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("", "utils"),  # logging, lazy exports
    ("elasticity",),  # pure batch-size arithmetic, used by config
    ("config",),  # pydantic sections, "auto", the batch rule; no torch
    ("comm",),  # the one door to torch.distributed: init, topology, collectives, diagnostics
    ("precision", "optim", "schedulers", "data", "monitor", "ops", "sequence", "tensor_parallel", "moe"),  # parts that only need comm/config
    ("checkpointing",),  # activation checkpointing (deepspeed.checkpointing); read by profiling's telemetry
    ("preflight",),  # the model-free checks of initialize, shared with `config check` (builds on a probe)
    ("runtime",),  # engine counters, the non-finite step policy, the step-hook protocol
    ("zero",),  # ZeRO stages 0-3 (optimizers, reducer, FSDP2 wrapping)
    ("autoep",),  # the expert_parallel section: MoE blocks rebuilt for expert parallelism (reads zero.Init weights)
    ("checkpoint",),  # DCP save/load, resharding, DeepSpeed import
    ("profiling",),  # timers, flops profiler, telemetry (reads monitor/precision)
    ("compression",),  # compression_training: quantization, pruning, layer reduction (a step hook)
    ("data_efficiency", "autotuning"),  # curriculum/sampler/random-LTD; autotuning (metric hook, space, tuners)
    ("compilation",),  # engine.compile(): torch.compile per transformer block (zero's block notion)
    ("engine", "step_hook_factory"),  # orchestration only; the builder of the configured step hooks
    ("pipe",),  # pipeline parallelism (deepspeed.pipe): PipelineModule, topologies, schedules, PipelineEngine
    ("startup",),  # the steps of initialize() with a concern of their own: process layout, ZeRO build
    ("initialization", "launcher"),  # the two entry points: initialize() and the launcher
    ("compat",),  # deepspeed.<path> -> shardwise: the forwarding table behind the 'deepspeed' package
    ("cli",),  # the ``shardwise`` command
    ("testing",),  # the multi-process test harness (may use anything)
)
LAYER_OF = {name: level for level, names in enumerate(LAYERS) for name in names}

# ------------------------------------------------------------------------------- torch.distributed
# Names that reach the process-group API. comm/ may use all of it; elsewhere only the APIs below,
# where they are used. Anything else (dist.get_rank, is_initialized, all_reduce, broadcast, barrier,
# new_group, get_backend, get_global_rank, reduce_scatter*, all_gather*, ...) goes through comm/.
DIST_ROOTS = ("torch.distributed", "torch._C._distributed_c10d")
ALLOWED_DIST: dict[str, tuple[str, ...]] = {
    "comm": DIST_ROOTS,
    "checkpoint": ("torch.distributed.checkpoint", "torch.distributed.tensor"),  # DCP and DTensor shards
    "zero": (  # stage 3 on FSDP2
        "torch.distributed.fsdp",
        "torch.distributed.tensor",
        "torch.distributed.device_mesh",
    ),
    "launcher": ("torch.distributed.run", "torch.distributed.elastic"),  # torchrun's agent
    "pipe": ("torch.distributed.pipelining",),  # torch's pipeline stages and schedules (their p2p)
}
# testing/ is exempt: it is the harness that creates and destroys the bare process groups the code
# under test runs in (the comm layer included), so it must not depend on comm/.
DIST_EXEMPT = frozenset({"testing"})

# ------------------------------------------------------------------------- known violations (issue 11)
# Each entry is removed by the lead when the branch that fixes it is merged.
KNOWN_CYCLES: frozenset[frozenset[str]] = frozenset()
KNOWN_ZERO_IMPORTS_CHECKPOINT: frozenset[tuple[str, str]] = frozenset()
KNOWN_DIST_CALLS: frozenset[tuple[str, str]] = frozenset()
# Layer violations are only allowed inside zero/ and checkpoint/ (zero -> checkpoint, listed above).
KNOWN_LAYER_VIOLATIONS: frozenset[tuple[str, str]] = KNOWN_ZERO_IMPORTS_CHECKPOINT


# ------------------------------------------------------------------------------------- the parser
@dataclass
class Module:
    """One parsed source file and what it imports from shardwise."""

    name: str
    path: Path
    tree: ast.Module
    runtime_imports: set[str] = field(default_factory=set)  # executed (module or function level)
    type_imports: set[str] = field(default_factory=set)  # under ``if TYPE_CHECKING:``


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement at any depth, with whether it sits under ``if TYPE_CHECKING:``."""

    def walk(node: ast.AST, typing_only: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, typing_only
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), True)
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), typing_only)
            else:
                yield from walk(child, typing_only)

    yield from walk(tree, False)


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    """The shardwise modules an import statement loads (the nearest existing module of each name)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".") if is_package else module.split(".")[:-1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join([*parts, *([node.module] if node.module else [])])
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = set()
    for name in names:
        if name != "shardwise" and not name.startswith("shardwise."):
            continue
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        if name != module:
            out.add(name)
    return out


def _parse_tree() -> dict[str, Module]:
    paths = sorted(SRC.rglob("*.py"))
    modules = {_module_name(p): Module(_module_name(p), p, ast.parse(p.read_text(), str(p))) for p in paths}
    known = set(modules)
    for mod in modules.values():
        for node, typing_only in _imports(mod.tree):
            found = _targets(mod.name, mod.path.name == "__init__.py", node, known)
            (mod.type_imports if typing_only else mod.runtime_imports).update(found)
    return modules


MODULES = _parse_tree()


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


# ------------------------------------------------------------------------------------------ cycles
def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components with more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def _cycle_path(graph: dict[str, set[str]], component: list[str]) -> str:
    """One concrete loop through a component, e.g. ``a -> b -> a``."""
    members = set(component)
    start = component[0]
    path, seen = [start], {start}
    node = start
    while True:
        nxt = next(n for n in sorted(graph[node]) if n in members)
        if nxt in seen:
            return " -> ".join([*path[path.index(nxt) :], nxt])
        path.append(nxt)
        seen.add(nxt)
        node = nxt


def test_no_import_cycles() -> None:
    graph = {name: mod.runtime_imports for name, mod in MODULES.items()}
    components = _strongly_connected(graph)
    found = {frozenset(c) for c in components}
    new = [_cycle_path(graph, c) for c in components if frozenset(c) not in KNOWN_CYCLES]
    assert not new, "import cycles (function-level imports count):\n  " + "\n  ".join(new)
    gone = [sorted(c) for c in KNOWN_CYCLES - found]
    assert not gone, f"KNOWN_CYCLES lists cycles that no longer exist; remove them: {gone}"


# ------------------------------------------------------------------------------------------ layers
def _all_imports() -> set[tuple[str, str]]:
    return {
        (name, target) for name, mod in MODULES.items() for target in mod.runtime_imports | mod.type_imports
    }


def test_every_package_has_a_layer() -> None:
    missing = sorted({_package(name) for name in MODULES} - set(LAYER_OF))
    assert not missing, f"packages without a place in LAYERS (add them where they belong): {missing}"


def test_imports_point_down_the_layers() -> None:
    found = set()
    for source, target in _all_imports():
        src_pkg, dst_pkg = _package(source), _package(target)
        if src_pkg == dst_pkg or src_pkg not in LAYER_OF or dst_pkg not in LAYER_OF:
            continue
        if LAYER_OF[dst_pkg] >= LAYER_OF[src_pkg]:
            found.add((source, target))
    new = sorted(found - KNOWN_LAYER_VIOLATIONS)
    order = " < ".join("/".join(n or "shardwise" for n in names) for names in LAYERS)
    assert not new, f"imports up (or across) the layers {order}:\n  " + "\n  ".join(
        f"{a} -> {b}" for a, b in new
    )
    gone = sorted(KNOWN_LAYER_VIOLATIONS - found)
    assert not gone, f"KNOWN_LAYER_VIOLATIONS lists imports that no longer exist; remove them: {gone}"


def test_zero_does_not_import_checkpoint() -> None:
    found = {
        (source, target)
        for source, target in _all_imports()
        if _package(source) == "zero" and _package(target) == "checkpoint"
    }
    new = sorted(found - KNOWN_ZERO_IMPORTS_CHECKPOINT)
    assert not new, (
        "zero/ imports checkpoint/ (describe the state; checkpoint/ adapts it):\n  "
        + "\n  ".join(f"{a} -> {b}" for a, b in new)
    )
    gone = sorted(KNOWN_ZERO_IMPORTS_CHECKPOINT - found)
    assert not gone, f"KNOWN_ZERO_IMPORTS_CHECKPOINT lists imports that no longer exist; remove them: {gone}"


# ------------------------------------------------------------------------------- torch.distributed
def _bindings(tree: ast.Module) -> dict[str, str]:
    """Local names bound by imports of torch.distributed (anywhere in the file) -> dotted path."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    out[alias.asname] = alias.name
                else:
                    out[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                out[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return out


def _dotted(node: ast.expr, bindings: dict[str, str]) -> str | None:
    attrs: list[str] = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in bindings:
        return None
    return ".".join([bindings[node.id], *reversed(attrs)])


def _annotation_nodes(tree: ast.Module) -> set[int]:
    """ids of every node inside a type annotation (types are not calls)."""
    roots: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            roots.append(node.annotation)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
            roots.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            roots.append(node.annotation)
    return {id(sub) for root in roots for sub in ast.walk(root)}


def _dist_uses(mod: Module) -> set[str]:
    """The torch.distributed names a module uses outside annotations (longest dotted form)."""
    bindings = _bindings(mod.tree)
    skip = _annotation_nodes(mod.tree)
    uses: set[str] = set()
    inner: set[int] = set()
    for node in ast.walk(mod.tree):
        if id(node) in skip or id(node) in inner or not isinstance(node, ast.Attribute | ast.Name):
            continue
        name = _dotted(node, bindings)
        if name is None or not name.startswith(DIST_ROOTS):
            continue
        uses.add(name)
        inner.update(id(sub) for sub in ast.walk(node) if sub is not node)
    return uses


def test_torch_distributed_only_through_comm() -> None:
    found = set()
    for name, mod in MODULES.items():
        package = _package(name)
        if package in DIST_EXEMPT or package == "comm":
            continue
        allowed = ALLOWED_DIST.get(package, ())
        for use in _dist_uses(mod):
            if not any(use == ok or use.startswith(ok + ".") for ok in allowed):
                found.add((name, use))
    new = sorted(found - KNOWN_DIST_CALLS)
    assert not new, (
        "torch.distributed used outside comm/ (add or use a shardwise.comm function):\n  "
        + "\n  ".join(f"{a}: {b}" for a, b in new)
    )
    gone = sorted(KNOWN_DIST_CALLS - found)
    assert not gone, f"KNOWN_DIST_CALLS lists uses that no longer exist; remove them: {gone}"


def test_the_checks_see_what_they_check() -> None:
    """The parser finds what the rules are about, so the rules cannot pass vacuously."""
    assert "shardwise.comm.collectives" in MODULES and "shardwise.engine" in MODULES
    assert any(t.startswith("shardwise.comm") for t in MODULES["shardwise.engine"].runtime_imports)
    # function-level and relative imports count; TYPE_CHECKING ones are kept apart
    code = (
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "def f():\n    from shardwise.checkpoint import layout, Checkpointer\n"
        "if TYPE_CHECKING:\n    import shardwise.engine\n"
    )
    known = {"shardwise.zero", "shardwise.zero.x", "shardwise.zero.sibling", "shardwise.checkpoint",
             "shardwise.checkpoint.layout", "shardwise.engine"}  # fmt: skip
    found = {
        (target, typing_only)
        for node, typing_only in _imports(ast.parse(code))
        for target in _targets("shardwise.zero.x", False, node, known)
    }
    assert found == {
        ("shardwise.zero.sibling", False),
        ("shardwise.checkpoint.layout", False),
        ("shardwise.checkpoint", False),
        ("shardwise.engine", True),
    }
    # torch.distributed uses: calls and references count, annotations do not
    sample = ast.parse(
        "import torch.distributed as dist\nimport torch\nfrom torch.distributed import barrier\n"
        "def f(g: dist.ProcessGroup):\n"
        "    dist.all_reduce(torch.ones(1)); torch.distributed.get_rank(); barrier()\n"
    )
    uses = _dist_uses(Module("x", Path("x.py"), sample))
    assert uses == {"torch.distributed.all_reduce", "torch.distributed.get_rank", "torch.distributed.barrier"}
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _strongly_connected(graph) == [["a", "b", "c"]]
    assert _cycle_path(graph, ["a", "b", "c"]) == "a -> b -> c -> a"


TESTS = Path(__file__).resolve().parents[1]
PROJECT_CHECKS = frozenset(
    {
        "test_architecture.py",
        "test_corpus.py",
        "test_package.py",
        "test_docstring_examples.py",
        "test_self_contained.py",  # no test reads outside the repository
        "test_step_order.py",  # the map's step order is the engine's
        "test_docs_examples.py",  # every docs page's example runs
        "test_deepspeed_suite_watchdog.py",  # benchmarks/deepspeed_suite.py ends sessions that hang
    }
)


def test_unit_tests_mirror_the_source_tree() -> None:
    """A unit test lives under the package it tests; only top-level modules and project checks sit flat."""
    top_level_modules = {path.stem for path in SRC.glob("*.py")}
    flat = {path.name for path in (TESTS / "unit").glob("test_*.py")}
    misplaced = sorted(
        name
        for name in flat
        if name not in PROJECT_CHECKS and name[len("test_") : -len(".py")] not in top_level_modules
    )
    assert not misplaced, f"move these under tests/unit/<package>/: {misplaced}"
    packages = {path.name for path in SRC.iterdir() if (path / "__init__.py").exists()}
    stray = sorted(
        str(path.relative_to(TESTS))
        for path in (TESTS / "unit").glob("*/test_*.py")
        if path.parent.name not in packages
    )
    assert not stray, f"these test directories name no src/shardwise package: {stray}"


def test_test_file_names_are_unique() -> None:
    """pytest collects without __init__.py files (prepend mode): two equal basenames would clash."""
    seen: dict[str, list[str]] = {}
    for path in TESTS.rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(TESTS)))
    clashes = {name: where for name, where in seen.items() if len(where) > 1}
    assert not clashes, f"rename one of each: {clashes}"


def test_every_package_and_top_level_module_is_on_the_map() -> None:
    """docs/architecture.md names every package (`name/`) and top-level module (`name.py`) of the tree."""
    text = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    names = [f"`{p.name}/`" for p in SRC.iterdir() if (p / "__init__.py").exists()]
    names += [f"`{p.name}`" for p in SRC.glob("*.py") if p.name != "__init__.py"]
    missing = sorted(name for name in names if name not in text)
    assert not missing, f"add these to docs/architecture.md: {missing}"


def test_the_map_names_the_packages_that_hold_step_hooks() -> None:
    """The packages ``step_hook_factory.py`` imports its ``build_*_hook`` functions from are the ones
    docs/architecture.md lists under "Where a new feature plugs in"."""
    tree = ast.parse((SRC / "step_hook_factory.py").read_text())
    builders = {
        node.module.split(".")[1]
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        and node.module
        and any(alias.name.startswith("build_") and alias.name.endswith("_hook") for alias in node.names)
    }
    text = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    listed = re.search(r"feature's own package \(today ([^)]*)", text)
    assert listed, "docs/architecture.md no longer lists the step-hook packages"
    named = set(re.findall(r"`(\w+)/`", listed.group(1)))
    assert named == builders, f"the map lists {sorted(named)}; step_hook_factory.py builds from {sorted(builders)}"
