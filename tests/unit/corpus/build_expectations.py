"""Write ``expectations.json``: shardwise's category for every corpus record.

Run after a deliberate behaviour change, then review the diff of expectations.json:

    python tests/unit/corpus/build_expectations.py

It refuses to write a record that breaks the category rules in ``categories.py``
(rejecting what DeepSpeed accepted; accepting what DeepSpeed rejected for a reason
that no accept category covers).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[2] / "src"))

from categories import accept_category, first_error_key, reject_category  # noqa: E402
from corpus_paths import corpus_dir, record_id, run_record  # noqa: E402

from shardwise.utils.logging import logger  # noqa: E402


def main() -> int:
    logger.setLevel(logging.ERROR)
    corpus = corpus_dir()
    records = [json.loads(line) for line in (corpus / "ds_ground_truth.jsonl").read_text().splitlines()]
    expectations: dict[str, dict[str, str]] = {}
    problems = []
    for record in records:
        _resolved, error = run_record(corpus, record)
        rid = record_id(record)
        if error is None:
            category = accept_category(record)
            if category is None:
                problems.append(
                    f"{rid}: accepted, but DeepSpeed's reason is not an accept category: {record['reason']}"
                )
                continue
            expectations[rid] = {"category": category}
        else:
            if record["accepted"]:
                problems.append(f"{rid}: DeepSpeed accepted it but we reject: {error}")
                continue
            expectations[rid] = {
                "category": reject_category(str(error)),
                "error_key": first_error_key(str(error)),
            }
    if problems:
        print("\n".join(problems))
        return 1
    (HERE / "expectations.json").write_text(json.dumps(expectations, indent=0, sort_keys=True) + "\n")
    print(f"wrote {len(expectations)} expectations")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
