"""ZeRO++ rows of the engine-core benchmark (``engine_core.py --zeropp``).

Stage 3, fp32, GAS 1 on 2 gloo ranks: shardwise exact, then shardwise with
``zero_quantized_weights`` + ``zero_quantized_gradients`` (qwZ + qgZ), in one job (the same two
processes, one case after the other, same data and seed). Both run with the comms logger on, so
both pay its bookkeeping and the exact run's FSDP2 all-gathers go through the logged (bit-identical)
hook; each rank reports the bytes it put on the wire per measured step, per collective. Printed:
step time (median of the measured steps, slowest rank), bytes per step, and the ratios
exact / ZeRO++; the loss gap to the exact run at the last step.
"""

from __future__ import annotations

import statistics
from typing import Any

ZEROPP = {"zero_quantized_weights": True, "zero_quantized_gradients": True}


def zeropp_specs(micro_batch: int, seq_len: int) -> list[dict[str, Any]]:
    """The two cases, as worker specs."""
    common = {"framework": "shardwise", "stage": 3, "bf16": False, "gas": 1, "micro_batch": micro_batch}
    return [
        {**common, "seq_len": seq_len, "count_bytes": True, "zero_extra": {}},
        {**common, "seq_len": seq_len, "count_bytes": True, "zero_extra": ZEROPP},
    ]


def _row(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    steps = len(ranks[0]["step_s"])
    step_s = [max(r["step_s"][i] for r in ranks) for i in range(steps)]
    wire = ranks[0].get("wire_bytes_per_step", {})
    return {
        "step_ms": 1e3 * statistics.median(step_s),
        "wire": wire,
        "total": sum(wire.values()),
        "loss": statistics.mean(r["losses"][-1] for r in ranks),
    }


def report(outcome: list[tuple[list[dict[str, Any]] | None, str]]) -> dict[str, Any]:
    """Print the two rows and the ratios; return them (for ``--out``)."""
    (exact_ranks, why_exact), (zpp_ranks, why_zpp) = outcome
    if exact_ranks is None or zpp_ranks is None:
        print(f"ZeRO++ rows failed: {why_exact or why_zpp}")
        return {"status": f"failed: {why_exact or why_zpp}"}
    exact, zpp = _row(exact_ranks), _row(zpp_ranks)
    ops = sorted(set(exact["wire"]) | set(zpp["wire"]))
    print(
        "\nZeRO++ (stage 3, fp32, GAS 1, 2 gloo ranks; bytes one rank sends per step, from the comms logger)"
    )
    header = f"  {'run':<16}{'step ms':>10}{'bytes/step':>13}" + "".join(f"{op:>26}" for op in ops)
    print(header)
    for name, row in (("exact", exact), ("qwZ + qgZ", zpp)):
        cells = "".join(f"{row['wire'].get(op, 0):>26,}" for op in ops)
        print(f"  {name:<16}{row['step_ms']:>10.1f}{row['total']:>13,}{cells}")
    bytes_cut = exact["total"] / zpp["total"] if zpp["total"] else float("inf")
    speedup = exact["step_ms"] / zpp["step_ms"]
    print(
        f"  exact / ZeRO++: bytes {bytes_cut:.2f}x, step time {speedup:.2f}x; "
        f"last-step loss {exact['loss']:.4f} vs {zpp['loss']:.4f}"
    )
    return {"status": "ok", "exact": exact, "zeropp": zpp, "bytes_cut": bytes_cut, "step_speedup": speedup}
