"""Checksums on 2 gloo ranks: every rank's files recorded (sync and async saves), and damage
to any of them refused by every rank before the load uses a byte, naming the file."""

from __future__ import annotations

import json
import shutil

import integrity_cases as cases
import pytest

from shardwise.checkpoint import integrity, layout
from shardwise.testing import run_distributed, run_distributed_cases

pytestmark = pytest.mark.distributed

FILES = [layout.DCP_METADATA, "__0_0.distcp", "__1_0.distcp", layout.SUMMARY]


def test_every_rank_files_are_checksummed_and_damage_is_refused_on_every_rank(tmp_path):
    saved = tmp_path / "saved"
    run_distributed(cases.save_sync_then_async, 2, args=(str(saved),), timeout=600)
    for tag in ("good", "bad"):  # the async save recorded its checksums like the sync one
        summary = json.loads((saved / tag / layout.SUMMARY).read_text())
        files = summary["checksums"]["files"]
        assert sorted(files) == sorted(FILES[:3]), tag
        assert files["__0_0.distcp"]["rank"] == 0 and files["__1_0.distcp"]["rank"] == 1
        assert integrity.verify_tag(saved / tag).status == "ok", tag
    cases_ = [{"name": "intact", "dir": str(saved)}]
    for name in FILES:
        root = tmp_path / name.strip("._")
        shutil.copytree(saved, root)
        path = root / "bad" / name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        cases_.append({"name": name, "dir": str(root)})
    results = run_distributed_cases(cases.load_or_error, cases_, world_size=2, timeout=600)
    intact = results[0]
    assert all(r["error"] is None and not r["untouched"] for r in intact)  # the intact copy loads
    for case, per_rank in zip(cases_[1:], results[1:]):
        for rank, result in enumerate(per_rank):
            message = result["error"]
            assert message is not None, (case["name"], rank)
            assert "checkpoint tag 'bad'" in message and case["name"] in message, message
            assert "that verifies is 'good'" in message and result["untouched"], (case["name"], rank)
