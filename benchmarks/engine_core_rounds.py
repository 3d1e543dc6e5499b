"""``engine_core.py --rounds N``: the grid N times, engines interleaved, ratios as median and spread.

One pass of the grid on a shared machine can put shardwise and its peers under different load, so a
single ratio says little. In rounds mode every (workload, stage, precision, GAS) group runs its
engines back to back in fresh 2-process jobs, shardwise first in even rounds and last in odd ones
(ABAB, then BABA: drift in the machine's load hits both sides alike), and the report gives, per
group, shardwise's step time over the best peer's in every round, their median and their spread
(max - min), and whether the ratio met the target in *every* round; then the medians over the
rounds of shardwise's and the best peer's step times and of shardwise's step parts
(``step_parts.py``: norm, scale, adamw, cast, gather, and with ``overlap_comm`` the forward's wait).

Two workloads by default: 64 tokens per rank per micro batch (2 x 32, the engine's own work
dominates) and 512 (4 x 128, the model's compute weighs more). References (the single-process
loss check) are skipped: this mode is about time.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

WORKLOADS: dict[int, tuple[int, int]] = {64: (2, 32), 512: (4, 128)}
"""Tokens per rank per micro batch -> (micro batch, sequence length) for the 17M GPT (context 128)."""


def workload_batch(tokens: int, model: dict[str, Any]) -> tuple[int, int]:
    """(micro batch, sequence) for ``tokens`` per rank, the sequence capped by the model's context.

    Example:
        >>> workload_batch(512, {"preset": "gpt_17m"}), workload_batch(512, {"block_size": 64})
        ((4, 128), (8, 64))
    """
    micro, seq = WORKLOADS[tokens]
    context = int(model.get("block_size", 128))
    if seq > context:
        micro, seq = tokens // context, context
    return micro, seq


ROUND_TARGET = {0: 1.0, 1: 0.90, 2: 0.90, 3: 0.90}
"""shardwise step time / best peer's, to be met in every round (stage 0 is DDP's own algorithm: level)."""


def _ordered(cases: list[Any], shardwise_first: bool) -> list[Any]:
    """Within each group keep shardwise first (A B) or move it last (B A)."""
    out: list[Any] = []
    groups: dict[Any, list[Any]] = {}
    for case in cases:
        groups.setdefault((case.seq_len, case.micro_batch, case.group), []).append(case)
    for members in groups.values():
        ours = [c for c in members if c.framework == "shardwise"]
        peers = [c for c in members if c.framework != "shardwise"]
        out.extend(ours + peers if shardwise_first else peers + ours)
    return out


def run_rounds(
    args: argparse.Namespace,
    cfg: Any,
    preset: dict[str, Any],
    wanted: set[str],
    unavailable: dict[str, str],
    triad_Bps: float | None,
) -> dict[str, Any]:
    """Run the rounds and print the report; returns every ratio (for ``--out``)."""
    import engine_core as ec  # the driver's helpers (this module is imported by it, lazily)

    ratios: dict[tuple[int, int, str, int], list[float | None]] = {}
    step_ms: dict[tuple[int, int, str, int], list[float]] = {}
    opt_triad: dict[tuple[int, int, str, int], list[float]] = {}
    local_triad: dict[tuple[int, int, str, int], list[float]] = {}
    peer_ms: dict[tuple[int, int, str, int], list[float]] = {}
    parts: dict[tuple[int, int, str, int], list[dict[str, float]]] = {}
    for round_index in range(args.rounds):
        for tokens in args.workloads:
            batch = workload_batch(tokens, preset["model"])
            workload = dict(preset, fp32_batch=batch, bf16_batch=batch)
            cases = _ordered(ec.build_grid(args, workload, wanted), shardwise_first=round_index % 2 == 0)
            order = "shardwise first" if round_index % 2 == 0 else "peers first"
            print(
                f"[rounds] round {round_index + 1}/{args.rounds}, {tokens} tokens per rank ({order})",
                flush=True,
            )
            ec.run_grid(
                cases, cfg, grouped=False, unavailable=unavailable, references={}, triad_Bps=triad_Bps
            )
            ec.evaluate(cases)
            for case in cases:
                if case.framework != "shardwise":
                    continue
                key = (tokens, case.stage, case.precision, case.gas)
                ratios.setdefault(key, []).append(
                    case.metrics.get("step_ratio") if case.status == "ok" else None
                )
                if case.status == "ok":
                    step_ms.setdefault(key, []).append(case.metrics["step_ms"])
                    if case.metrics.get("step_ratio"):
                        peer_ms.setdefault(key, []).append(
                            case.metrics["step_ms"] / case.metrics["step_ratio"]
                        )
                    parts.setdefault(key, []).append(step_parts_ms(case.metrics))
                    if case.metrics.get("opt_vs_triad") is not None:
                        opt_triad.setdefault(key, []).append(case.metrics["opt_vs_triad"])
                    if case.metrics.get("local_step_vs_triad") is not None:
                        local_triad.setdefault(key, []).append(case.metrics["local_step_vs_triad"])
    return report(ratios, step_ms, opt_triad, args.rounds, local_triad, peer_ms=peer_ms, parts=parts)


PART_ORDER = ("norm", "scale", "adamw", "cast", "gather", "wait")
"""The step parts the report shows (``step_parts.py``; ``adamw`` is the case's ``opt_ms``)."""


def step_parts_ms(metrics: dict[str, Any]) -> dict[str, float]:
    """One shardwise case's step parts in ms (median over its steps), ``adamw`` from ``opt_ms``.

    Example:
        >>> step_parts_ms({"parts_ms": {"norm": 1.0, "gather": 2.0, "total": 9.0}, "opt_ms": 5.0})
        {'norm': 1.0, 'adamw': 5.0, 'gather': 2.0}
    """
    found = dict(metrics.get("parts_ms") or {})
    if found and metrics.get("opt_ms") is not None:
        found["adamw"] = metrics["opt_ms"]
    return {p: float(found[p]) for p in PART_ORDER if p in found}


def median_parts(per_round: list[dict[str, float]]) -> dict[str, float]:
    """Per part, the median over the rounds that measured it.

    Example:
        >>> median_parts([{"norm": 1.0, "adamw": 4.0}, {"norm": 3.0, "adamw": 6.0}, {"norm": 2.0}])
        {'norm': 2.0, 'adamw': 5.0}
    """
    names = [p for p in PART_ORDER if any(p in r for r in per_round)]
    return {p: statistics.median(r[p] for r in per_round if p in r) for p in names}


def _parts_text(parts: dict[str, float]) -> str:
    return " ".join(f"{p} {v:.1f}" for p, v in parts.items()) if parts else "-"


def report(
    ratios: dict[tuple[int, int, str, int], list[float | None]],
    step_ms: dict[tuple[int, int, str, int], list[float]],
    opt_triad: dict[tuple[int, int, str, int], list[float]],
    rounds: int,
    local_triad: dict[tuple[int, int, str, int], list[float]] | None = None,
    *,
    peer_ms: dict[tuple[int, int, str, int], list[float]] | None = None,
    parts: dict[tuple[int, int, str, int], list[dict[str, float]]] | None = None,
) -> dict[str, Any]:
    """Print one line per group: ratio per round, median, spread, shardwise's and the best peer's
    step ms, the AdamW kernel's and the whole local step's (scale + AdamW + cast,
    ``step_parts.py``) %triad, target met every round; then shardwise's median step parts (ms)."""
    local_triad = local_triad or {}
    peer_ms = peer_ms or {}
    parts = parts or {}
    print()
    print(f"engine-core rounds: shardwise step time / best peer's, {rounds} interleaved rounds")
    head = (
        f"{'tokens':>6} {'stage':>5} {'prec':>4} {'GAS':>3}  {'ratio per round':<24} {'median':>6} "
        f"{'spread':>6}  {'step ms':>8} {'peer ms':>8} {'%triad':>6} {'local':>6}  target"
    )
    print(head)
    print("-" * len(head))
    rows = []
    for key in sorted(ratios):
        tokens, stage, precision, gas = key
        values = ratios[key]
        known = [v for v in values if v is not None]
        median = statistics.median(known) if known else None
        spread = max(known) - min(known) if known else None
        target = ROUND_TARGET[stage]
        every = bool(known) and len(known) == len(values) and all(v <= target for v in known)
        per_round = " ".join("  -  " if v is None else f"{v:5.2f}" for v in values)
        ms = statistics.median(step_ms[key]) if step_ms.get(key) else None
        peer = statistics.median(peer_ms[key]) if peer_ms.get(key) else None
        part_ms = median_parts(parts.get(key, []))
        triad = 100 * statistics.median(opt_triad[key]) if opt_triad.get(key) else None
        local = 100 * statistics.median(local_triad[key]) if local_triad.get(key) else None
        print(
            f"{tokens:>6} {stage:>5} {precision:>4} {gas:>3}  {per_round:<24} "
            f"{'-' if median is None else f'{median:.2f}':>6} {'-' if spread is None else f'{spread:.2f}':>6}  "
            f"{'-' if ms is None else f'{ms:.1f}':>8} {'-' if peer is None else f'{peer:.1f}':>8} "
            f"{'-' if triad is None else f'{triad:.0f}%':>6} {'-' if local is None else f'{local:.0f}%':>6}  "
            f"<= {target:.2f} every round: {'pass' if every else 'FAIL'}"
        )
        print(f"{'':>20}step parts ms (median): {_parts_text(part_ms)}")
        rows.append(
            {
                "tokens_per_rank": tokens,
                "stage": stage,
                "precision": precision,
                "gas": gas,
                "ratios": values,
                "median": median,
                "spread": spread,
                "step_ms_median": ms,
                "best_peer_step_ms_median": peer,
                "step_parts_ms_median": part_ms,
                "opt_vs_triad_median": None if triad is None else triad / 100,
                "local_step_vs_triad_median": None if local is None else local / 100,
                "target": target,
                "met_every_round": every,
            }
        )
    return {"rounds": rounds, "rows": rows}


def write(path: Path, meta: dict[str, Any], result: dict[str, Any]) -> None:
    """The rounds' numbers as JSON."""
    path.write_text(json.dumps({"meta": meta, **result}, indent=2))
    print(f"results written to {path}")
