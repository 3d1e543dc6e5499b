"""The end of a tuning: the summary table, the best config file, ``summary.json``.

Example:
    >>> from shardwise.autotuning.records import Record
    >>> rows = [Record("z0_mbs2_gas1", "ok", metric=10.0), Record("z3_mbs64_gas1", "pruned", error="needs 9 GiB")]
    >>> print(summary_table(rows, "throughput", best="z0_mbs2_gas1"))
    experiment     status  throughput  note
    z0_mbs2_gas1   ok           10.00  best
    z3_mbs64_gas1  pruned           -  needs 9 GiB
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from shardwise.autotuning.metric_hook import write_json_atomically
from shardwise.autotuning.records import OK, PRUNED, Record

__all__ = ["BEST_CONFIG", "summary_table", "write_best"]

BEST_CONFIG = "ds_config_optimal.json"
"""The best config's file name under ``results_dir`` (DeepSpeed's name)."""
UNITS = {"throughput": "samples/s", "latency": "ms/step", "flops": "FLOPS/rank"}


def summary_table(records: Sequence[Record], metric: str, best: str | None) -> str:
    """One row per experiment: name, status, metric, and the best mark or the error."""
    rows = [("experiment", "status", metric, "note")]
    for record in records:
        value = f"{record.metric:.2f}" if record.metric is not None else "-"
        note = "best" if record.name == best else record.error.replace("\n", " ")[:90]
        rows.append((record.name, record.status, value, note))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [
        f"{row[0].ljust(widths[0])}  {row[1].ljust(widths[1])}  {row[2].rjust(widths[2])}  {row[3]}".rstrip()
        for row in rows
    ]
    return "\n".join(lines)


def write_best(
    results_dir: str,
    best: Record | None,
    best_config: Mapping[str, object] | None,
    records: Sequence[Record],
    facts: Mapping[str, object],
) -> str | None:
    """Write ``ds_config_optimal.json`` (the best config, its ``autotuning`` block removed so it
    trains normally) and ``summary.json``; returns the config's path (None: nothing succeeded)."""
    path = None
    if best is not None and best_config is not None:
        config = {key: value for key, value in best_config.items() if key != "autotuning"}
        path = os.path.join(results_dir, BEST_CONFIG)
        write_json_atomically(path, config)
    counts: dict[str, int] = {}
    for record in records:
        counts[record.status] = counts.get(record.status, 0) + 1
    write_json_atomically(
        os.path.join(results_dir, "summary.json"),
        {
            **dict(facts),
            "best": best.name if best else None,
            "best_metric": best.metric if best else None,
            "best_config": path,
            "counts": counts,
            "ran": sum(1 for r in records if r.status not in (PRUNED, "invalid")),
            "pruned": counts.get(PRUNED, 0),
            "succeeded": counts.get(OK, 0),
        },
    )
    return path
