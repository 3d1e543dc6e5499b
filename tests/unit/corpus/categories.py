"""The corpus categories: what we expect shardwise to make of each real-world config.

Every record of ``ds_ground_truth.jsonl`` (a file, a world size, and either the file as
it is or HF's "auto"-filled variant, with DeepSpeed 0.19.8's verdict) lands in exactly
one category. ``expectations.json`` holds the category per record; ``build_expectations.py``
writes it and checks the rules below before writing, so a reviewer reads the rules here
and the per-file decisions there.

Accepted by shardwise:
  ds-accepted      DeepSpeed accepted it; we must resolve the same batch triple, ZeRO
                   stage, fp16/bf16, clipping, optimizer and scheduler.
  auto             DeepSpeed crashed only because "auto" reached its arithmetic (it
                   never resolves "auto"); we resolve it by the documented rules.
  removed-section  the file uses a section DeepSpeed 0.19.8 removed (compression,
                   sparse attention, elasticity, amp, legacy curriculum, PLD, MoQ);
                   we accept it with its documented meaning.
  misplaced-key    harmless keys of another section: fp16-only loss-scale keys inside
                   bf16, apex's opt_level inside fp16. Ignored with a warning.
  legacy-key       keys older DeepSpeed releases read (compile.disable, grad_hooks).
  too-strict       DeepSpeed rejects a sensible value (a fractional min_loss_scale,
                   which older releases took); we accept it.

Rejected by shardwise (and by DeepSpeed), with an error naming ``error_key``:
  batch-mismatch   train_batch_size != micro x accumulation x world at this world size
                   (including values that would make a derived size 0).
  missing-batch    neither train_batch_size nor train_micro_batch_size_per_gpu.
  placeholder      an unfilled template variable ("CONFIG_BATCH_SIZE", "ZERO_STAGE").
  unknown-key      a typo or foreign key inside a strict section (did-you-mean given).
  invalid-value    a value outside its allowed range or type.
  unsupported      a feature we cannot run (MiCS sharding, the Nebula service,
                   an elastic config that has no batch for this world size).
"""

from __future__ import annotations

import re

ACCEPT = ("ds-accepted", "auto", "removed-section", "misplaced-key", "legacy-key", "too-strict")
REJECT = ("batch-mismatch", "missing-batch", "placeholder", "unknown-key", "invalid-value", "unsupported")

# DeepSpeed's rejection reason -> the accept category it justifies
_DS_REASON_TO_ACCEPT = [
    (re.compile(r"TypeError: .*'str'"), "auto"),
    (re.compile(r"has been removed|Legacy top-level|integration has been removed"), "removed-section"),
    (re.compile(r"BF\d+Config\.\w+: Extra inputs|FP\d+Config\.(fp16_)?opt_level: Extra"), "misplaced-key"),
    (re.compile(r"CompileConfig\.disable|grad_hooks: Extra"), "legacy-key"),
    (
        re.compile(r"min_loss_scale: Input should be a valid integer, got a number with a fractional part"),
        "too-strict",
    ),
]


def accept_category(record: dict) -> str | None:
    """The accept category DeepSpeed's verdict allows for a record we accept, or None."""
    if record["accepted"]:
        return "ds-accepted"
    for pattern, category in _DS_REASON_TO_ACCEPT:
        if pattern.search(record["reason"]):
            return category
    return None


def reject_category(message: str) -> str:
    """Classify one of our ConfigError messages (its first problem)."""
    first = message.split("\n  fix:")[0]
    if "problems in the config" in first:
        first = message.split("\n")[1]
    if "placeholder" in first:
        return "placeholder"
    if "neither train_batch_size nor train_micro_batch_size_per_gpu" in first:
        return "missing-batch"
    if re.search(r"must equal train_micro|is smaller than|would get 0", first):
        return "batch-mismatch"
    if "unknown key" in first:
        return "unknown-key"
    if re.search(r"MiCS|Nebula|elasticity", first):
        return "unsupported"
    return "invalid-value"


def first_error_key(message: str) -> str:
    """The key path our message names first."""
    match = re.search(
        r"'([\w.\[\]-]+)'", message.split("fix:")[0] if "problems" not in message else message.split("\n")[1]
    )
    return match.group(1) if match else ""
