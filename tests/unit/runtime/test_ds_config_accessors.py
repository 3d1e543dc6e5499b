"""DeepSpeed's config accessors on shardwise's engine return what DeepSpeed's engine returns.

``tests/data/deepspeed_engine_accessors.json`` holds DeepSpeed 0.19.8's answers, recorded by
``benchmarks/record_deepspeed_accessors.py`` from real ``DeepSpeedEngine`` s (CPU, world size 1) for
hand-written configs covering each section and real corpus files. Each test builds a shardwise engine
from the same config (the same client optimizer, when DeepSpeed got one) and compares every accessor.
Where shardwise answers differently on purpose, :data:`DIFFERENCES` names the value and why; a
listed difference that no longer occurs fails too, so the list stays true.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise
from shardwise.config import load_config
from shardwise.data_efficiency import convert_to_random_ltd
from shardwise.runtime.ds_config_accessors import DeepSpeedConfigAccessors
from shardwise.testing.in_process_group import torn_down_process_group

RECORD = json.loads(
    (Path(__file__).resolve().parents[2] / "data" / "deepspeed_engine_accessors.json").read_text()
)
PROPERTIES = frozenset({"communication_data_type"})

# (accessor, config name or "*") -> (shardwise's value as JSON, why it differs from DeepSpeed's)
DIFFERENCES: dict[tuple[str, str], tuple[Any, str]] = {
    ("compile_zero_optimization_stage", "*"): (
        False,
        "DeepSpeed 0.19.8 raises TypeError ('z1' in None) when compile.passes is unset; shardwise answers "
        "False (no ZeRO DeepCompile pass is named)",
    ),
}
# Fields of a dict/model accessor that differ on purpose: accessor -> {field: why}; compared without them.
FIELD_DIFFERENCES: dict[str, dict[str, str]] = {
    "tensor_parallel_config": {
        "dtype": "shardwise: None unless written (the model keeps its dtype); DeepSpeed: torch.float16",
        "tensor_parallel": "DeepSpeed's nested TPConfig object; shardwise keeps the written 'tp' dict instead",
        "tp": "shardwise's written 'tp' block (DeepSpeed's 'tensor_parallel' above)",
        "tp_grain_size": "shardwise's top-level copy of tp.tp_grain_size",
    },
}


def _recorder() -> Any:
    """The recorder's module (plain Python at import: it runs in DeepSpeed's interpreter), for its JSON rules."""
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "record_deepspeed_accessors.py"
    spec = importlib.util.spec_from_file_location("record_deepspeed_accessors", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


jsonable = _recorder().jsonable  # pydantic as model_dump, enums as values, tuples as lists, dtypes/paths as str


def same(expected: Any, actual: Any) -> bool:
    """Equal JSON values of the same type (True is not 1, 1 is not 1.0), recursively."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        return expected.keys() == actual.keys() and all(same(expected[k], actual[k]) for k in expected)
    if isinstance(expected, list) and isinstance(actual, list):
        return len(expected) == len(actual) and all(same(e, a) for e, a in zip(expected, actual, strict=True))
    return type(expected) is type(actual) and expected == actual


def shardwise_values(case: dict[str, Any]) -> dict[str, Any]:
    """Every recorded accessor on a shardwise engine built like DeepSpeed's for ``case``."""
    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Linear(4, 2)
    if case["values"]["random_ltd_enabled"]:
        # shardwise checks random_ltd_layer_id against the model's wrapped layers at initialize (DeepSpeed
        # later, at its first forward): give this case four wrapped layers; no accessor reads the model
        model = convert_to_random_ltd(
            torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(4))), torch.nn.Linear
        )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3) if case["client_optimizer"] else None
    engine, *_ = shardwise.initialize(
        model=model,
        model_parameters=model.parameters(),
        optimizer=optimizer,
        config=copy.deepcopy(case["config"]),
    )
    cwd = os.getcwd()
    return {
        name: jsonable(getattr(engine, name) if name in PROPERTIES else getattr(engine, name)(), cwd)
        for name in RECORD["accessors"]
    }


def test_record_is_deepspeed_0_19_8_and_names_every_accessor() -> None:
    assert RECORD["deepspeed_version"] == "0.19.8"
    assert len(RECORD["configs"]) >= 8
    missing = [name for name in RECORD["accessors"] if not hasattr(DeepSpeedConfigAccessors, name)]
    assert missing == []


@pytest.fixture(scope="module")
def shardwise_answers() -> Iterator[dict[str, dict[str, Any]]]:
    """Every case's shardwise values, from engines built in one process group (one rendezvous for the
    module, not one per case); the group is torn down afterwards as ``tests/conftest.py`` does."""
    with torn_down_process_group():
        yield {case["name"]: shardwise_values(case) for case in RECORD["configs"]}


@pytest.mark.parametrize("case", RECORD["configs"], ids=[case["name"] for case in RECORD["configs"]])
def test_accessors_match_deepspeed(
    case: dict[str, Any], shardwise_answers: dict[str, dict[str, Any]]
) -> None:
    actual = shardwise_answers[case["name"]]
    mismatches = {}
    for name, expected in case["values"].items():
        got = actual[name]
        difference = DIFFERENCES.get((name, case["name"])) or DIFFERENCES.get((name, "*"))
        if difference is not None:
            assert same(difference[0], got), f"{name}: listed difference no longer holds ({got!r})"
            continue
        for field in FIELD_DIFFERENCES.get(name, {}):
            expected = {k: v for k, v in expected.items() if k != field}
            got = {k: v for k, v in got.items() if k != field}
        if not same(expected, got):
            mismatches[name] = {"deepspeed": expected, "shardwise": got}
    assert mismatches == {}


class _ConfigOnly(DeepSpeedConfigAccessors):
    """The accessors over a loaded config and a stand-in strategy: for what DeepSpeed cannot record at
    world size 1 on CPU (NVMe offload needs its aio op; its checkpoint writer fails at world size 1)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._config = load_config({"train_micro_batch_size_per_gpu": 1, **config})
        self.optimizer = object()


def test_nvme_offload_and_writer_accessors_read_their_blocks(tmp_path: Path) -> None:
    nvme = _ConfigOnly(
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
            },
            "checkpoint": {"writer": {"type": "python"}},
        }
    )
    assert nvme.zero_use_cpu_optimizer() and nvme.zero_nvme_offload_optimizer()
    assert not nvme.zero_cpu_offload()
    assert nvme.checkpoint_writer_enabled()
    # the block's default; 0.9 is DeepSpeed's accessor constant without a block
    assert nvme.cpuadam_cores_perc() == 0.8
    plain = _ConfigOnly({})
    assert plain.communication_data_type == torch.float32
    with pytest.raises(AttributeError, match=r"communication_data_type.*in the config"):
        plain.communication_data_type = torch.bfloat16
    assert not (
        plain.zero_nvme_offload_optimizer() or plain.checkpoint_writer_enabled() or plain.compile_autotp()
    )
