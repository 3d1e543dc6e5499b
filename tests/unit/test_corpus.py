"""The real-world corpus: 476 public ds_config files x world sizes 1, 2, 8 x (as-is,
HF-filled), each with DeepSpeed 0.19.8's verdict. Categories are explained in
``corpus/categories.py``; the per-record expectation is data in ``corpus/expectations.json``.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "corpus"))

from categories import ACCEPT, REJECT, accept_category, reject_category
from corpus_paths import RESOLVED_FIELDS, corpus_dir, record_id, run_record

from shardwise.utils.logging import logger

FIELDS = RESOLVED_FIELDS


@pytest.fixture(scope="module")
def corpus():
    root = corpus_dir()
    records = [json.loads(line) for line in (root / "ds_ground_truth.jsonl").read_text().splitlines()]
    expectations = json.loads((Path(__file__).parent / "corpus" / "expectations.json").read_text())
    return root, records, expectations


def _ours(cfg) -> dict:
    return {
        "train_batch_size": cfg.config.train_batch_size,
        "train_micro_batch_size_per_gpu": cfg.config.train_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": cfg.config.gradient_accumulation_steps,
        "zero_stage": cfg.config.zero_stage,
        "fp16_enabled": cfg.config.fp16.enabled,
        "bf16_enabled": cfg.config.bf16.enabled,
        "gradient_clipping": cfg.config.gradient_clipping,
        "optimizer_name": cfg.config.optimizer.type.lower() if cfg.config.optimizer else None,
        "scheduler_name": cfg.config.scheduler.type if cfg.config.scheduler else None,
    }


def _theirs(resolved: dict) -> dict:
    out = {k: resolved.get(k) for k in FIELDS}
    out["optimizer_name"] = out["optimizer_name"].lower() if out["optimizer_name"] else None
    return out


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(float(a), float(b))  # type: ignore[arg-type]
    return a == b


def test_every_record_lands_in_its_expected_category(corpus):
    root, records, expectations = corpus
    logger.setLevel(logging.ERROR)
    assert len(records) == 2094 and len(expectations) == len(records)
    failures = []
    for record in records:
        rid = record_id(record)
        expected = expectations[rid]
        try:
            cfg, error = run_record(root, record)
        except Exception as exc:  # any non-ConfigError is a defect
            failures.append(f"{rid}: uncaught {type(exc).__name__}: {exc}")
            continue
        category = expected["category"]
        if category in ACCEPT:
            if error is not None:
                failures.append(f"{rid}: expected {category}, rejected: {error}")
            elif accept_category(record) != category:
                failures.append(f"{rid}: accept category {category} is not justified by DeepSpeed's verdict")
            elif category == "ds-accepted":
                ours, theirs = _ours(cfg), _theirs(record["resolved"])
                diff = {k: (ours[k], theirs[k]) for k in FIELDS if not _same(ours[k], theirs[k])}
                if diff:
                    failures.append(f"{rid}: resolved values differ from DeepSpeed (ours, theirs): {diff}")
        else:
            assert category in REJECT
            if record["accepted"]:
                failures.append(f"{rid}: expectation rejects a file DeepSpeed accepted")
            elif error is None:
                failures.append(f"{rid}: expected rejection ({category}) but it was accepted")
            else:
                message = str(error)
                if reject_category(message) != category:
                    failures.append(
                        f"{rid}: rejected as {reject_category(message)}, expected {category}: {message}"
                    )
                if f"'{expected['error_key']}'" not in message or "fix:" not in message:
                    failures.append(
                        f"{rid}: message does not name '{expected['error_key']}' with a fix: {message}"
                    )
    assert not failures, f"{len(failures)} records off:\n" + "\n".join(failures[:40])


def test_categories_cover_the_corpus_as_reviewed(corpus):
    """The reviewed split; a change here is a behaviour change to look at in expectations.json."""
    _, records, expectations = corpus
    counts: dict[str, int] = {}
    for value in expectations.values():
        counts[value["category"]] = counts.get(value["category"], 0) + 1
    assert set(counts) <= set(ACCEPT) | set(REJECT)
    # every DeepSpeed acceptance is ours too, and nothing DeepSpeed accepted is rejected
    assert counts["ds-accepted"] == sum(1 for r in records if r["accepted"])
    # every removed-section or "auto"-only rejection by DeepSpeed is accepted unless the file is wrong
    for record in records:
        category = expectations[record_id(record)]["category"]
        if accept_category(record) in ("removed-section", "auto") and category in REJECT:
            assert category in (
                "batch-mismatch",
                "missing-batch",
                "placeholder",
                "unknown-key",
                "unsupported",
            )


def test_error_messages_name_key_value_and_fix(corpus):
    root, records, _expectations = corpus
    logger.setLevel(logging.ERROR)
    by_id = {record_id(r): r for r in records}
    typo = by_id[
        "260_microsoft__DeepSpeedExamples__Megatron-LM-v1.1.5-ZeRO3__examples__ds_zero_stage_3_config.json|as_is|ws=1"
    ]
    _, error = run_record(root, typo)
    assert error is not None
    assert "'zero_optimization.stage3_param_persitence_threshold' = 100000" in str(error)
    assert "did you mean 'stage3_param_persistence_threshold'?" in str(error)
