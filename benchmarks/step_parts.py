"""The parts of shardwise's optimizer step, timed separately (``engine_core.py``'s breakdown line).

At the accumulation boundary ``engine.step()`` runs the strategy's step
(:class:`shardwise.zero.sharded_optimizer.ZeroOptimizer` at stages 0-2,
:class:`shardwise.zero.stage3.Stage3Optimizer` at stage 3). Its parts, in order:

* ``norm``: the squared gradient norm and its all-reduce (``_squared_norm``);
* ``scale``: the one division that averages, unscales and clips (``_scale_gradients``; nothing
  when fused AdamW does it in its own pass, :mod:`shardwise.zero.grad_fold`);
* ``adamw``: the inner torch optimizer's step (timed by the worker's ``OptimizerStepTimer``);
* ``cast``: fp32 masters back into 16-bit parameters (``_cast_masters_to_params``, stages 0-2;
  nothing to do in fp32, where masters are views of the parameters);
* ``gather``: the stage 1-2 all-gather of the updated shards (``_gather_shards``); with
  ``overlap_comm`` only its launch (the gathers are left in flight);
* ``wait``: with ``overlap_comm`` (stages 1-2), the time the next forward's hooks (and the step)
  spent waiting for gathers still in flight (``strategy.gathers``: :mod:`shardwise.zero.async_gather`),
  counted in the step whose forward waited; not part of ``total``;
* ``total``: the whole strategy step, so ``total - sum(parts)`` is what the parts leave out.

The *local step* (the issue's "unscale, clip, AdamW, cast back") is ``scale + adamw + cast``; its
bandwidth counts the bytes one fused pass would have to move: AdamW's 7 arrays (read p, g, m, v;
write p, m, v) and the cast's 16-bit write. A separate division pass adds time, no counted bytes.

The worker wraps those methods on the engine's strategy instance (the library is not changed for
the benchmark); nothing is wrapped for other frameworks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

PARTS: dict[str, str] = {
    "_squared_norm": "norm",
    "_scale_gradients": "scale",
    "_cast_masters_to_params": "cast",
    "_gather_shards": "gather",
    "step": "total",
}
WAITS: dict[str, str] = {"wait_for": "wait", "wait_all": "wait"}  # on strategy.gathers, if any
ORDER = ("norm", "scale", "adamw", "cast", "gather", "wait", "total")


class StepPartTimer:
    """Seconds and bytes per part of the strategy's step, accumulated until :meth:`take`."""

    def __init__(self, strategy: Any) -> None:
        self.seconds: dict[str, float] = {}
        self.bytes: dict[str, int] = {}
        self._strategy = strategy
        for attr, label in PARTS.items():
            method = getattr(strategy, attr, None)
            if method is not None:
                setattr(strategy, attr, self._timed(method, label))
        gathers = getattr(strategy, "gathers", None)  # overlap_comm: the forward's waits
        for attr, label in WAITS.items():
            method = getattr(gathers, attr, None)
            if method is not None:
                setattr(gathers, attr, self._timed(method, label))

    def _timed(self, method: Callable[..., Any], label: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t0
                if label == "cast":
                    self.bytes[label] = self._cast_bytes()

        return timed

    def _cast_bytes(self) -> int:
        """The 16-bit parameter bytes the cast writes (fp32: none, masters are the parameters)."""
        total = 0
        for flat in getattr(self._strategy, "groups", []):
            if flat.master and flat.dtype != flat.master[0].dtype:
                total += sum(m.numel() for m in flat.master) * flat.param_buffer.element_size()
        return total

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        """Seconds and bytes per part since the last call."""
        seconds, self.seconds = self.seconds, {}
        return seconds, dict(self.bytes)


def summarize_parts(ranks: list[dict[str, Any]], triad_Bps: float | None) -> dict[str, Any]:
    """Per part the median over steps of the slower rank's ms; the local step's bandwidth and
    its ratio to the triad (per rank, then the mean), as ``opt_vs_triad`` is computed."""
    if not ranks or "parts_s" not in ranks[0]:
        return {}
    n = len(ranks[0]["parts_s"])
    labels = [p for p in ORDER if any(p in r["parts_s"][i] for r in ranks for i in range(n))]
    ms = {
        p: 1e3 * statistics.median(max(r["parts_s"][i].get(p, 0.0) for r in ranks) for i in range(n))
        for p in labels
    }
    ratios, bws = [], []
    for r in ranks:
        local = [
            sum(r["parts_s"][i].get(p, 0.0) for p in ("scale", "cast")) + r["opt_s"][i] for i in range(n)
        ]
        nbytes = r["opt_bytes"] + r.get("parts_bytes", {}).get("cast", 0)
        if not nbytes or statistics.median(local) <= 0:
            continue
        bw = nbytes / statistics.median(local)
        bws.append(bw)
        triad = r.get("triad_Bps") or triad_Bps
        if triad:
            ratios.append(bw / triad)
    return {
        "parts_ms": ms,
        "local_step_GBps": statistics.mean(bws) / 1e9 if bws else None,
        "local_step_vs_triad": statistics.mean(ratios) if ratios else None,
    }


def breakdown_line(metrics: dict[str, Any]) -> str | None:
    """``   step parts ms: norm 1.2 scale 3.4 adamw 20.1 ... | local step 9.1 GB/s 88% triad``."""
    parts = dict(metrics.get("parts_ms") or {})
    if not parts:
        return None
    parts["adamw"] = metrics["opt_ms"]
    text = " ".join(f"{p} {parts[p]:.1f}" for p in ORDER if p in parts)
    bw, pct = metrics.get("local_step_GBps"), metrics.get("local_step_vs_triad")
    tail = "" if bw is None else f" | local step (scale+adamw+cast) {bw:.2f} GB/s"
    tail += "" if pct is None else f" {100 * pct:.0f}% of triad"
    return f"{'':>27}step parts ms: {text}{tail}"
