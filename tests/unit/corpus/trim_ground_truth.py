"""Write ``tests/data/corpus/ds_ground_truth.jsonl`` from the full measurement file.

The full file (``ds_ground_truth.jsonl`` of the project's shared corpus, DeepSpeed 0.19.8's verdict on
each real-world config) holds far more per record than the tests read. This keeps the provenance
(repository, path, commit), the record's identity (file, variant, world size), DeepSpeed's verdict
(accepted, reason), the resolved values ``tests/unit/test_corpus.py`` compares (``RESOLVED_FIELDS``),
and HF's filled "auto" values. Usage:
``python tests/unit/corpus/trim_ground_truth.py FULL.jsonl > tests/data/corpus/ds_ground_truth.jsonl``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus_paths import RESOLVED_FIELDS

KEEP = ("file", "repo", "path", "commit", "variant", "world_size", "accepted", "reason")


def trim(record: dict) -> dict:
    """The fields of one record that the tests read."""
    out = {k: record[k] for k in KEEP if k in record}
    if record.get("resolved") is not None:
        out["resolved"] = {k: record["resolved"].get(k) for k in RESOLVED_FIELDS}
    if record.get("hf_fill") is not None:
        out["hf_fill"] = {"filled": record["hf_fill"]["filled"]}
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as full:
        for line in full:
            print(json.dumps(trim(json.loads(line))))
