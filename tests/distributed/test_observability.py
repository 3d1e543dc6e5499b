"""Observability on 2 gloo ranks: monitors read back, progress lines, timers, the comms
summary of a ZeRO-2 step, the flops profiler at profile_step, and quiet start-up.

One spawn runs every scenario (observability_cases.py); the checks read the files that
rank 0 wrote with the formats' own readers (tensorboard's EventAccumulator, csv, the
W&B offline record file) and compare them with the numbers each rank's engine reported.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import re
import struct
from typing import Any

import observability_cases as cases
import pytest

from shardwise.profiling.flops_profiler import format_count
from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed

SCENARIOS = ["monitors", "comms", "flops", "quiet"]
TIMER_EVENTS = [
    "Train/Samples/elapsed_time_ms_forward",
    "Train/Samples/elapsed_time_ms_backward",
    "Train/Samples/elapsed_time_ms_backward_inner",
    "Train/Samples/elapsed_time_ms_backward_allreduce",
    "Train/Samples/elapsed_time_ms_step",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("observability"))
    results = run_distributed_cases(cases.run_scenario, SCENARIOS, world_size=2, args=(tmp,), timeout=300)
    return tmp, dict(zip(SCENARIOS, results))


def _library_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("[shardwise]")]


def _expected_series(ranks: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """What the monitors must hold, from what each rank's engine reported."""
    rank0, rank1 = (r["record"] for r in ranks)
    out: dict[str, list[tuple[int, float]]] = {}
    for a, b in zip(rank0, rank1):
        at = a["samples"]
        # the engine's loss is the mean over ranks of each rank's window sum of loss / GAS
        out.setdefault("Train/Samples/train_loss", []).append((at, (a["window_loss"] + b["window_loss"]) / 2))
        out.setdefault("Train/Samples/lr", []).append((at, a["lr"]))
        out.setdefault("Train/Samples/loss_scale", []).append((at, a["loss_scale"]))
        out.setdefault("Train/Samples/grad_norm_pre_clip", []).append((at, a["grad_norm"]))
        out.setdefault("Train/Samples/grad_norm_post_clip", []).append((at, a["grad_norm_post_clip"]))
    out["Custom/answer"] = [(rank0[-1]["samples"], 42.0)]
    return out


def _read_csv_dir(path: str) -> dict[str, tuple[list[str], list[tuple[int, float]]]]:
    out = {}
    for name in os.listdir(path):
        with open(os.path.join(path, name), newline="") as handle:
            rows = list(csv.reader(handle))
        out[name] = (rows[0], [(int(step), float(value)) for step, value in rows[1:]])
    return out


def _read_wandb_history(run_file: str) -> tuple[dict[str, Any], list[dict]]:
    """Parse a W&B offline ``.wandb`` file (LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(run_file, "rb") as handle:
        raw = handle.read()
    assert raw[:4] == b":W&B"
    pos, block, pending, records = 7, 32768, b"", []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        pos += 7
        if kind == 0:
            break
        pending += raw[pos : pos + length]
        pos += length
        if kind in (1, 4):  # FULL or LAST
            records.append(pending)
            pending = b""
    run_info: dict[str, Any] = {}
    history = []
    for data in records:
        record = pb.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_info = {"project": record.run.project, "group": record.run.run_group}
            run_info.update({f"config.{i.key}": json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "history":
            history.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return run_info, history


def test_monitor_files_hold_what_the_engine_computed(run):
    tmp, results = run
    ranks = results["monitors"]
    assert ranks[0]["writes"] and not ranks[1]["writes"]  # only rank 0 writes
    expected = _expected_series(ranks)
    samples = [r["samples"] for r in ranks[0]["record"]]
    assert samples == [8, 16, 24, 32]  # train_batch_size 8 = 2 micro x 2 GAS x 2 ranks
    # clipping at 0.05 is active: the post-clip norm is just under the threshold
    for r in ranks[0]["record"]:
        assert r["grad_norm"] > 0.05 and r["grad_norm_post_clip"] == pytest.approx(0.05, rel=1e-4)

    # CSV: DeepSpeed's layout, exact values
    files = _read_csv_dir(f"{tmp}/csv/job")
    for name, series in expected.items():
        header, rows = files[name.replace("/", "_") + ".csv"]
        assert header == ["step", name.split("/")[-1]]
        assert rows == series, name
    for name in [*TIMER_EVENTS, "Train/Samples/samples_per_sec"]:
        header, rows = files[name.replace("/", "_") + ".csv"]
        assert [step for step, _ in rows] == samples and all(v > 0 for _, v in rows), name
    timers = {name: dict(files[name.replace("/", "_") + ".csv"][1]) for name in TIMER_EVENTS}
    _, bwd, inner, reduce, _ = (timers[n] for n in TIMER_EVENTS)
    for at in samples:  # each rank's bwd encloses its two parts, so the rank means do too
        assert bwd[at] >= inner[at] + reduce[at] - 1e-6

    # TensorBoard, through tensorboard's own reader (values stored as float32)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(f"{tmp}/tb/job")
    acc.Reload()
    assert set(expected) | set(TIMER_EVENTS) <= set(acc.Tags()["scalars"])
    for name, series in expected.items():
        got = [(e.step, e.value) for e in acc.Scalars(name)]
        assert [s for s, _ in got] == [s for s, _ in series], name
        for (_, value), (_, want) in zip(got, series):
            assert value == pytest.approx(want, rel=1e-6), name

    # W&B offline run, parsed from its record file
    (run_file,) = glob.glob(f"{tmp}/wandb/offline-run-*/run-*.wandb")
    run_info, history = _read_wandb_history(run_file)
    assert (run_info["project"], run_info["group"]) == ("shardwise-test", "obs")
    assert run_info["config.fp16"]["enabled"] and run_info["config.gradient_clipping"] == 0.05
    for name, series in expected.items():
        got = [(row["_step"], row[name]) for row in history if name in row]
        assert got == series, name


def test_progress_and_timer_lines_on_rank_0_only(run):
    _, results = run
    ranks = results["monitors"]
    assert _library_lines(ranks[1]["stderr"]) == []
    lines = _library_lines(ranks[0]["stderr"])
    progress = [line for line in lines if "step=" in line]
    timer_lines = [line for line in lines if line.split("] ", 3)[-1].startswith("time (ms)")]
    assert len(progress) == 2 and len(timer_lines) == 2  # steps_per_print 2 over 4 steps
    rec0, rec1 = ranks[0]["record"], ranks[1]["record"]
    for line, step in zip(progress, (2, 4)):
        a, b = rec0[step - 1], rec1[step - 1]
        assert f"step={step}, samples={a['samples']}," in line
        assert f"loss={(a['window_loss'] + b['window_loss']) / 2:.4f}" in line
        assert f"grad_norm_pre_clip={a['grad_norm']:.4g}" in line
        assert f"grad_norm_post_clip={a['grad_norm_post_clip']:.4g}" in line
        assert "loss_scale=256" in line and "skipped=0" in line and re.search(r"samples/s=\d", line)
    for line in timer_lines:
        assert "mean/max over 2 ranks" in line
        for phase in ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step"):
            assert re.search(rf"\| {phase}: \d+\.\d\d/\d+\.\d\d", line), phase
    assert len(lines) == 4  # nothing else at the default level


def test_wall_clock_timers_api(run):
    _, results = run
    for rank in results["monitors"]:
        timers = rank["timers"]
        assert set(timers) == {
            "fwd_microstep",
            "bwd_microstep",
            "bwd_inner_microstep",
            "bwd_allreduce_microstep",
            "step_microstep",
            "fwd",
            "bwd",
            "bwd_inner",
            "bwd_allreduce",
            "step",
        }
        assert all(v > 0 for v in timers.values())
        # the window (GAS 2) holds two micro steps' forward; the step runs once
        assert timers["fwd"] > timers["fwd_microstep"]
        assert timers["step"] == pytest.approx(timers["step_microstep"], rel=0.5)


def test_comms_summary_of_a_zero2_step(run):
    _, results = run
    # 87 parameters in two buckets: [bias 3 + weight 18 + bias 6 = 27 -> padded 28] and
    # [weight 60]; each rank's shard is 14 and 30 fp32 elements = 56 and 120 bytes.
    expected_step = {
        # stage 2 reduce-scatters every micro step (GAS 2): each bucket twice
        "reduce_scatter_tensor": {56: 2, 120: 2},
        # one all-reduce of the squared gradient norm (a 4-byte fp32 scalar)
        "all_reduce": {4: 1},
        # the updated shards gathered once per bucket
        "all_gather_into_tensor": {56: 1, 120: 1},
    }
    for rank in results["comms"]:
        init = {op: {size: row["count"] for size, row in sizes.items()} for op, sizes in rank["init"].items()}
        assert init == {"broadcast": {88 * 4: 1}}  # the padded flat parameter buffer, once
        summary = rank["step"]["summary"]
        counts = {op: {size: row["count"] for size, row in sizes.items()} for op, sizes in summary.items()}
        assert counts == expected_step
        assert rank["count"] == 7
        for sizes in summary.values():
            for size, row in sizes.items():
                assert row["msg_size_bytes"] == size and row["total_latency_ms"] > 0
                assert row["tput_avg_gbps"] > 0 and row["busbw_avg_gbps"] > 0
        assert set(rank["step"]["straggler_analysis"]) == set(expected_step)
        assert rank["step"]["metadata"]["world_size"] == 2
    table = results["comms"][0]["stderr"]
    assert "Comm. Op" in table and "reduce_scatter_tensor" in table and "120.0 B" in table
    assert _library_lines(results["comms"][1]["stderr"]) == []


def test_flops_profiler_at_profile_step(run):
    _, results = run
    rank0, rank1 = results["flops"]
    assert rank1["text"] is None  # only rank 0 profiles
    text = rank0["text"]
    assert "Profile summary at step 1" in text
    # the profiled step's two micro batches of 2 samples: 2 * 2 * 2 * (8*16 + 16*4) flops
    flops = 2 * 2 * 2 * (cases.IN * cases.HIDDEN + cases.HIDDEN * cases.OUT)
    assert re.search(rf"fwd flops per rank:\s+{re.escape(format_count(flops))}\n", text)
    assert re.search(rf"fwd MACs per rank:\s+{re.escape(format_count(flops // 2, 'MACs'))}\n", text)
    assert "bwd latency" in text and "step latency" in text  # the profiler turns the timers on
    assert text.count("Profile summary") == 1
    for rank in results["flops"]:
        assert rank["hooks_left"] == 0
        assert rank["timers"]  # forced on


def test_quiet_by_default_and_memory_report(run):
    _, results = run
    rank0, rank1 = results["quiet"]
    for name in ("default", "info", "memory"):
        assert _library_lines(rank1[name]) == [], name  # nothing from other ranks
    assert rank0["default"].strip() == ""  # default level: not a line
    info = rank0["info"].splitlines()
    assert 0 < len(info) <= 20 and all("[rank0]" in line for line in _library_lines(rank0["info"]))
    memory = rank0["memory"]
    assert "memory at start-up" in memory
    # 8*16 + 16 + 16*4 + 4 = 212 fp32 parameters; stage 2 keeps a 106-element gradient shard
    assert "params 848 B + grads 424 B" in memory
    assert len(memory.splitlines()) <= 5
    assert math.isclose(rank0["state_bytes"], 848 + 424 + 2 * 106 * 4)
