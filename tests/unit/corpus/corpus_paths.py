"""Where the corpus lives and how one record is run through shardwise."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shardwise.config import ConfigError, ResolvedConfig, load_config

#: the corpus the repository carries: the configs and DeepSpeed 0.19.8's verdicts (trimmed to what the
#: tests read by ``trim_ground_truth.py`` beside this file)
BUNDLED = Path(__file__).resolve().parents[2] / "data" / "corpus"


#: the resolved values test_corpus.py compares with DeepSpeed's (and the ones the trimmed file keeps)
RESOLVED_FIELDS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_stage",
    "fp16_enabled",
    "bf16_enabled",
    "gradient_clipping",
    "optimizer_name",
    "scheduler_name",
)


def corpus_dir() -> Path:
    """``$SHARDWISE_CORPUS`` (another copy, e.g. the full measurement) or the repository's own copy."""
    env = os.environ.get("SHARDWISE_CORPUS")
    path = Path(env) if env else BUNDLED
    if not (path / "ds_ground_truth.jsonl").is_file():
        raise FileNotFoundError(
            f"corpus not found at {path}; set SHARDWISE_CORPUS to the folder holding ds_ground_truth.jsonl"
        )
    return path


def record_id(record: dict[str, Any]) -> str:
    """A stable id for one record: file, variant and world size."""
    return f"{record['file']}|{record['variant']}|ws={record['world_size']}"


def run_record(corpus: Path, record: dict[str, Any]) -> tuple[ResolvedConfig | None, ConfigError | None]:
    """Load the record's file the way DeepSpeed was given it.

    The HF variant is the same file with HF's filled values passed as overrides: they
    replace exactly the "auto" values HF filled, as the HF trainer does.
    """
    overrides = record["hf_fill"]["filled"] if record["variant"] == "hf_auto_filled" else None
    try:
        return load_config(
            corpus / "configs" / record["file"], world_size=record["world_size"], overrides=overrides
        ), None
    except ConfigError as exc:
        return None, exc
