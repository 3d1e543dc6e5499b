"""``shardwise --autotuning tune|run``: profile, prune with the memory plan, search, report.

1. **Profile** the model once (a stage-0 launch that stops after its first step): parameter
   count and activation bytes per sample (skipped when ``model_info.num_params`` is given, or
   ``model_info_path`` names an existing file).
2. **Prune**: every candidate of the tuning space (:mod:`~shardwise.autotuning.space`) whose
   predicted bytes per rank exceed the budget is recorded as ``pruned`` without a launch; on a
   GPU, a stage 2/3 where nothing fits is retried with offload. Per stage,
   ``num_tuning_micro_batch_sizes`` of the fitting micro batch sizes are kept (spread, the
   largest included).
3. **Baseline**: the config as written is measured the same way (when it holds no lists).
4. **Search** with the configured tuner, trials and early stopping; each experiment is
   launched through our launcher and recorded (:mod:`~shardwise.autotuning.records`).
5. **Report**: the summary table, ``ds_config_optimal.json`` and ``summary.json`` under
   ``results_dir``. ``run`` then trains with the best config (the launcher does that).

Example:
    >>> metric_key("flops"), score_of("latency", 20.0)
    ('FLOPS_per_gpu', -20.0)
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from shardwise.autotuning.memory_fit import ModelInfo, available_memory_per_rank, predicted_bytes
from shardwise.autotuning.records import INVALID, OK, PRUNED, ExperimentStore, Record
from shardwise.autotuning.report import summary_table, write_best
from shardwise.autotuning.runner import ExperimentLaunch, run_launch
from shardwise.autotuning.space import Candidate, build_space, spread
from shardwise.autotuning.tuners import make_tuner, run_search
from shardwise.utils.logging import logger

__all__ = ["Autotuner", "TuneRequest", "TuneResult", "metric_key", "score_of"]

BASELINE = "baseline"
"""The name of the experiment that measures the config as written."""


def metric_key(metric: str) -> str:
    """The metrics file's key for ``autotuning.metric``."""
    return {"throughput": "throughput", "latency": "latency", "flops": "FLOPS_per_gpu"}[metric]


def score_of(metric: str, value: float) -> float:
    """Higher is better: latency is negated."""
    return -value if metric == "latency" else value


@dataclass(frozen=True)
class TuneRequest:
    """Everything a tuning needs from the command line.

    Attributes:
        config_path: the script's ``--deepspeed_config`` (it may hold lists to tune).
        launch: how to launch the script.
        world_size: processes per experiment.
        ranks_per_node: processes per node (they share a node's host memory).
        on_gpu: the ranks train on GPUs.
        memory_per_rank: the budget in bytes (None: the GPU's, or host memory / ranks per node).
    """

    config_path: str
    launch: ExperimentLaunch
    world_size: int
    ranks_per_node: int
    on_gpu: bool = False
    memory_per_rank: int | None = None


@dataclass
class TuneResult:
    """What a tuning found.

    Attributes:
        best: the best experiment's record (None when nothing succeeded).
        best_config_path: ``ds_config_optimal.json`` (None when nothing succeeded).
        records: every experiment, pruned ones first.
        seconds: the tuning's wall time.
    """

    best: Record | None
    best_config_path: str | None
    records: list[Record] = field(default_factory=list)
    seconds: float = 0.0


def _load_settings(raw: Mapping[str, object]) -> Any:
    from shardwise.config import load_config

    block = raw.get("autotuning") or {}
    settings = load_config({"train_micro_batch_size_per_gpu": 1, "autotuning": block}).config.autotuning
    if settings.end_profile_step <= settings.start_profile_step:
        raise ValueError(
            f"autotuning.end_profile_step = {settings.end_profile_step} must be above start_profile_step = "
            f"{settings.start_profile_step}: the metric is measured over the steps in between. Raise it, e.g. "
            f"to {settings.start_profile_step + 2}."
        )
    return settings


def _has_lists(raw: Mapping[str, object]) -> bool:
    zero = raw.get("zero_optimization")
    return isinstance(zero, Mapping) and any(isinstance(v, list) or v == "all" for v in zero.values())


class Autotuner:
    """Runs one tuning (see the module docstring).

    Args:
        request: the command line's part.
    """

    def __init__(self, request: TuneRequest) -> None:
        from shardwise.config.loading import read_config_source

        self.raw, _ = read_config_source(request.config_path)
        self.settings = _load_settings(self.raw)
        if request.launch.arg_mappings is None and self.settings.arg_mappings:
            request = replace(
                request, launch=replace(request.launch, arg_mappings=self.settings.arg_mappings)
            )
        self.request = request
        if request.world_size % self.settings.mp_size:
            raise ValueError(
                f"autotuning.mp_size = {self.settings.mp_size} does not divide the {request.world_size} processes; "
                "give a divisor of the world size"
            )
        self.dp_size = request.world_size // self.settings.mp_size
        self.store = ExperimentStore(
            os.path.abspath(self.settings.exps_dir), os.path.abspath(self.settings.results_dir)
        )

    # ---------------------------------------------------------------------------------- experiments
    def _config_for(self, base: Mapping[str, object], folder: str) -> dict[str, Any]:
        block = dict(self.raw.get("autotuning") or {})
        block.update(
            enabled=True,
            metric=self.settings.metric,
            start_profile_step=self.settings.start_profile_step,
            end_profile_step=self.settings.end_profile_step,
            metric_path=os.path.join(folder, "metrics.json"),
            model_info={"profile": False},
        )
        block.pop("model_info_path", None)
        return {**base, "autotuning": block}

    def _experiment(self, name: str, settings: Mapping[str, object], base: Mapping[str, object]) -> Record:
        if not self.settings.overwrite:
            done = self.store.finished(name)
            if done is not None:
                logger.info("autotuning: %s already ran (%s), kept (overwrite: false)", name, done.status)
                return done
        folder = self.store.folder(name)
        config = self._config_for(base, folder)
        metrics_path = config["autotuning"]["metric_path"]
        if os.path.exists(metrics_path):
            os.remove(metrics_path)
        path = self.store.describe(name, settings, config)
        launch = self.request.launch
        outcome = run_launch(launch.command(path, config), folder, launch.timeout_s, metrics_path)
        record = Record(
            name, outcome.status, settings=dict(settings), error=outcome.error, seconds=outcome.seconds
        )
        if outcome.status == OK:
            with open(metrics_path, encoding="utf-8") as handle:
                record.metrics = json.load(handle)
            value = record.metrics.get(metric_key(self.settings.metric))
            record.metric = float(value) if value is not None else None
        self.store.save(record)
        logger.info(
            "autotuning: %s %s%s (%.1fs)",
            name,
            record.status,
            f" {self.settings.metric} {record.metric:.2f}"
            if record.metric is not None
            else f": {record.error[:200]}",
            record.seconds,
        )
        return record

    # ---------------------------------------------------------------------------------- profile
    def model_info(self) -> ModelInfo:
        """The model's size and activation bytes per sample (profiled once, or given)."""
        given = self.settings.model_info
        if given.num_params:
            logger.info(
                "autotuning: model_info.num_params = %d given; activation memory is not counted",
                given.num_params,
            )
            return ModelInfo(int(given.num_params))
        path = self.settings.model_info_path
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as handle:
                return ModelInfo.from_mapping(json.load(handle))
        folder = self.store.folder("profile_model_info")
        path = path or os.path.join(folder, "model_info.json")
        if not self.settings.overwrite and os.path.isfile(path):
            with open(path, encoding="utf-8") as handle:
                return ModelInfo.from_mapping(json.load(handle))
        low = self.settings.min_train_micro_batch_size_per_gpu
        micro = min(max(low, 2), self.settings.max_train_micro_batch_size_per_gpu)
        config = Candidate(0, micro, 1).ds_config(self.raw, self.dp_size)
        config["autotuning"] = {
            **dict(self.raw.get("autotuning") or {}),
            "enabled": True,
            "metric_path": None,
            "model_info": {"profile": True},
            "model_info_path": os.path.abspath(path),
        }
        config_path = self.store.describe("profile_model_info", {"profile": True}, config)
        outcome = run_launch(
            self.request.launch.command(config_path, config), folder, self.request.launch.timeout_s, path
        )
        if outcome.status != OK:
            raise RuntimeError(
                f"autotuning: the profiling run failed ({outcome.status}: {outcome.error}); its output is in {folder}. "
                "Fix the script, or give autotuning.model_info.num_params to skip profiling."
            )
        with open(path, encoding="utf-8") as handle:
            info = ModelInfo.from_mapping(json.load(handle))
        logger.info(
            "autotuning: model has %d trainable parameters, %.1f KiB of activations per sample",
            info.num_params,
            info.activation_mem_per_sample / 1024,
        )
        return info

    # ---------------------------------------------------------------------------------- prune
    def plan(self, info: ModelInfo, budget: int) -> tuple[list[Candidate], list[Record]]:
        """The candidates to search and the records of those the memory plan rules out."""
        from shardwise.config import ConfigError

        space = build_space(self.raw, self.settings, self.dp_size)
        keep: list[Candidate] = []
        ruled_out: list[Record] = []

        def check(candidate: Candidate) -> bool:
            config = candidate.ds_config(self.raw, self.dp_size)
            try:
                need = predicted_bytes(config, info, self.request.world_size, on_gpu=self.request.on_gpu)
            except ConfigError as exc:
                ruled_out.append(
                    Record(candidate.name, INVALID, settings=candidate.as_dict(), error=str(exc))
                )
                return False
            if need > budget:
                ruled_out.append(
                    Record(
                        candidate.name,
                        PRUNED,
                        settings=candidate.as_dict(),
                        predicted_bytes=need,
                        error=f"the plan needs {need / 2**20:.1f} MiB per rank, {budget / 2**20:.1f} MiB available",
                    )
                )
                return False
            return True

        for stage in space.stages:
            fitting = [c for c in space.candidates(stage) if check(c)]
            if not fitting and self.request.on_gpu and stage >= 2:
                offloaded = [
                    Candidate(c.stage, c.micro_batch, c.grad_accum, c.zero_extra, offload=True)
                    for c in space.candidates(stage)
                ]
                fitting = [c for c in offloaded if check(c)]
            sizes = spread(
                sorted({c.micro_batch for c in fitting}), self.settings.num_tuning_micro_batch_sizes
            )
            keep += [c for c in fitting if c.micro_batch in sizes]
        return keep, ruled_out

    # ---------------------------------------------------------------------------------- tune
    def tune(self) -> TuneResult:
        """Profile, prune, measure the baseline, search, write the report; returns the result."""
        began = time.perf_counter()
        settings = self.settings
        if settings.arg_mappings:
            self.request.launch.script_args(
                "probe.json", Candidate(0, 1, 1).ds_config(self.raw, self.dp_size)
            )
        info = self.model_info()
        budget = self.request.memory_per_rank or available_memory_per_rank(
            self.request.ranks_per_node, on_gpu=self.request.on_gpu
        )
        candidates, records = self.plan(info, budget)
        for record in records:
            self.store.save(record)
        logger.info(
            "autotuning: %d candidates to search with %s, %d ruled out by the memory plan (budget %.1f MiB per rank)",
            len(candidates),
            settings.tuner_type,
            len(records),
            budget / 2**20,
        )
        configs: dict[str, dict[str, Any]] = {}
        if not _has_lists(self.raw):
            configs[BASELINE] = dict(self.raw)
            records.append(self._experiment(BASELINE, {"as_written": True}, self.raw))
        bar = _progress(min(len(candidates), settings.tuner_num_trials))

        def evaluate(candidate: Candidate) -> float | None:
            config = candidate.ds_config(self.raw, self.dp_size)
            configs[candidate.name] = config
            record = self._experiment(candidate.name, candidate.as_dict(), config)
            records.append(record)
            bar.update(1)
            if record.metric is None:
                return None
            return score_of(settings.metric, record.metric)

        search = run_search(
            make_tuner(settings.tuner_type, candidates),
            evaluate,
            settings.tuner_num_trials,
            settings.tuner_early_stopping,
        )
        bar.close()
        if search.stopped_early:
            logger.info(
                "autotuning: stopped early: %d experiments without improvement", settings.tuner_early_stopping
            )
        measured = [r for r in records if r.status == OK and r.metric is not None]
        best = max(measured, key=lambda r: score_of(settings.metric, float(r.metric or 0.0)), default=None)
        seconds = time.perf_counter() - began
        facts = {"metric": settings.metric, "tuner": settings.tuner_type, "seconds": seconds}
        if best is not None:
            baseline = next((r for r in measured if r.name == BASELINE), None)
            facts["baseline_metric"] = baseline.metric if baseline else None
        path = write_best(
            self.store.results_dir, best, configs.get(best.name) if best else None, records, facts
        )
        print(
            summary_table(records, settings.metric, best.name if best else None), file=sys.stderr, flush=True
        )
        if path:
            logger.info("autotuning: best %s (%s %.2f); config written to %s", best.name if best else "",
                        settings.metric, best.metric if best and best.metric else 0.0, path)  # fmt: skip
        else:
            logger.error(
                "autotuning: no experiment succeeded; see the records under %s", self.store.results_dir
            )
        return TuneResult(best, path, records, seconds)


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="autotuning", unit="exp", file=sys.stderr, disable=None)
