"""Tables of the NVMe offload benchmark (``nvme_offload_bench.py``): per-step rows, memory peaks, ratios."""

from __future__ import annotations

import itertools
import math
from typing import Any

STATE_BYTES_PER_PARAM = 16  # fp32 parameter + gradient + AdamW's two moments
GB = 1e9


def summarize(results: list[dict[str, Any]], limit: dict[str, Any], ram: int) -> dict[str, Any]:
    """Per-step rows (slowest rank's time, mean loss, summed I/O) and the memory peaks, summed over ranks."""
    steps = []
    for i in range(len(results[0]["steps"])):
        rows = [r["steps"][i] for r in results]
        seconds = max(row["seconds"] for row in rows)
        io = {k: sum(row["io"][k] for row in rows) for k in rows[0]["io"]}
        # through the file layer: direct/libaio I/O shows in read_bytes only, buffered I/O in rchar
        moved_read = sum(max(row["io"]["read_bytes"], row["io"]["rchar"]) for row in rows)
        moved_write = sum(max(row["io"]["write_bytes"], row["io"]["wchar"]) for row in rows)
        dev = rows[0]["device"]  # machine-wide: every rank sees the same device counters
        steps.append(
            {
                "seconds": seconds,
                "loss": sum(row["loss"] for row in rows) / len(rows),
                **io,
                "moved_read": moved_read,
                "moved_write": moved_write,
                "read_Bps": io["read_bytes"] / seconds,
                "write_Bps": io["write_bytes"] / seconds,
                **dev,
                "dev_read_Bps": dev["dev_read"] / seconds,
                "dev_write_Bps": dev["dev_write"] / seconds,
                "moved_read_Bps": moved_read / seconds,
                "moved_write_Bps": moved_write / seconds,
            }
        )
    peaks = {
        phase: {
            key: sum(r["peaks"].get(phase, {}).get(key, 0) for r in results) for key in ("RssAnon", "VmRSS")
        }
        for phase in ("build", "model", "initialize", "steps", "forward", "backward", "optimizer")
    }
    hwm = sum(r["hwm"] for r in results)
    return {
        "params": results[0]["params"],
        "build_s": max(r["build_s"] for r in results),
        "build_io": {k: sum(r["build_io"][k] for r in results) for k in results[0]["build_io"]},
        "steps": steps,
        "peaks": peaks,
        "hwm_build": sum(r["hwm_build"] for r in results),
        "hwm": hwm,
        "hwm_over_ram": hwm / ram,
        "swap_bytes": max(r["swap_bytes"] for r in results),
        "loss_down": all(b["loss"] < a["loss"] for a, b in itertools.pairwise(steps)),
        "versions": results[0]["versions"],
    }


def _pct(value: float, limit: dict[str, Any], key: str) -> str:
    lim = limit.get(key)
    return f"{100 * value / lim:5.1f}%" if lim else "   - "


def print_report(rows: dict[str, Any], limit: dict[str, Any], ram: int) -> None:
    """The disk limit, then per framework the per-step table and the memory peaks, then the ratios."""
    if "error" in limit:
        print(f"disk limit ({limit['tool']}): could not measure: {limit['error']}")
    elif limit:
        print(
            f"disk limit ({limit['tool']}, {limit['file_bytes'] / GB:.1f} GB file, 64 MiB blocks): "
            f"direct write {limit['write_direct'] / GB:.2f} GB/s, read {limit['read_direct'] / GB:.2f} GB/s; "
            f"buffered write {limit['write_buffered'] / GB:.2f} GB/s, read {limit['read_buffered'] / GB:.2f} GB/s"
        )
    for name, row in rows.items():
        print(f"\n== {name}")
        if isinstance(row, str):
            print(f"   {row}")
            continue
        n = row["params"]
        print(
            f"   {n / 1e9:.3f}B parameters, model state {STATE_BYTES_PER_PARAM * n / GB:.1f} GB "
            f"= {STATE_BYTES_PER_PARAM * n / ram:.2f}x RAM ({ram / 2**30:.1f} GiB); build {row['build_s']:.1f} s, "
            f"build I/O read {row['build_io']['read_bytes'] / GB:.2f} GB, write {row['build_io']['write_bytes'] / GB:.2f} GB"
        )
        print(
            "   step  time s     loss | proc rd GB  wr GB | sys rd GB  wr GB | moved rd GB/s (%lim)  wr GB/s (%lim)"
            " | device rd GB/s (%lim)  wr GB/s (%lim)"
        )
        for i, s in enumerate(row["steps"]):
            print(
                f"   {i:4d} {s['seconds']:7.2f} {s['loss']:8.4f} | {s['read_bytes'] / GB:10.3f} {s['write_bytes'] / GB:6.3f}"
                f" | {s['rchar'] / GB:9.3f} {s['wchar'] / GB:6.3f}"
                f" | {s['moved_read_Bps'] / GB:13.3f} ({_pct(s['moved_read_Bps'], limit, 'read_direct')})"
                f" {s['moved_write_Bps'] / GB:7.3f} ({_pct(s['moved_write_Bps'], limit, 'write_direct')})"
                f" | {s['dev_read_Bps'] / GB:14.3f} ({_pct(s['dev_read_Bps'], limit, 'read_direct')})"
                f" {s['dev_write_Bps'] / GB:7.3f} ({_pct(s['dev_write_Bps'], limit, 'write_direct')})"
            )
        p = row["peaks"]
        print(
            f"   peak RssAnon: build {p['build']['RssAnon'] / 2**30:.2f} GiB, steps {p['steps']['RssAnon'] / 2**30:.2f} GiB;"
            f" peak VmRSS: build {p['build']['VmRSS'] / 2**30:.2f}, steps {p['steps']['VmRSS'] / 2**30:.2f} GiB;"
            f" VmHWM {row['hwm'] / 2**30:.2f} GiB = {100 * row['hwm_over_ram']:.1f}% of RAM"
            f" (after build {row['hwm_build'] / 2**30:.2f}); loss going down: {'yes' if row['loss_down'] else 'NO'}"
        )
        print(
            "   peak RssAnon by part: "
            + ", ".join(
                f"{part} {p[part]['RssAnon'] / 2**30:.2f} GiB"
                for part in ("model", "initialize", "forward", "backward", "optimizer")
            )
        )
        print(f"   swap files on disk after the steps: {row['swap_bytes'] / GB:.2f} GB")
    print(
        "\n   proc rd/wr: /proc/<pid>/io read_bytes/write_bytes (storage I/O the ranks caused; page-cache hits,"
        "\n   and rewrites of pages still dirty in the page cache, count nothing); sys rd/wr: rchar/wchar (bytes"
        "\n   through read/write system calls, cached or not, gloo's socket writes included with 2 ranks; libaio"
        "\n   and page faults on memory maps count nothing); moved: per rank the larger of the two, i.e. bytes"
        "\n   to/from the swap files whichever way they go; device: /sys/dev/block/M:m/stat of the swap disk,"
        "\n   the whole machine's I/O on it in the step (page-cache write-back included: exact on a quiet"
        "\n   machine). %lim: of the direct (O_DIRECT) limit. Sums over ranks; step time: the slower rank."
    )
    sw, ds = rows.get("shardwise"), rows.get("deepspeed")
    if isinstance(sw, dict) and isinstance(ds, dict):

        def mean(row: dict[str, Any], key: str) -> float:
            tail = row["steps"][1:] or row["steps"]  # step 0 pays first-touch costs
            return float(sum(s[key] for s in tail)) / len(tail)

        print("\nshardwise / deepspeed (steps after the first):")
        for label, key in (
            ("step time", "seconds"),
            ("disk read bytes/step", "read_bytes"),
            ("disk write bytes/step", "write_bytes"),
            ("moved read bytes/step", "moved_read"),
            ("moved write bytes/step", "moved_write"),
            ("device read bytes/step", "dev_read"),
            ("device write bytes/step", "dev_write"),
        ):
            a, b = mean(sw, key), mean(ds, key)
            print(f"   {label:26s} {a:14.4g} / {b:14.4g} = {a / b if b else math.inf:.2f}")
        for label, a, b in (
            ("peak RssAnon (steps)", sw["peaks"]["steps"]["RssAnon"], ds["peaks"]["steps"]["RssAnon"]),
            ("VmHWM", sw["hwm"], ds["hwm"]),
            ("swap files on disk", sw["swap_bytes"], ds["swap_bytes"]),
        ):
            print(
                f"   {label:26s} {a / 2**30:12.2f} Gi / {b / 2**30:12.2f} Gi = {a / b if b else math.inf:.2f}"
            )
