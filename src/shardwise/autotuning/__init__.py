"""Autotuning: ``shardwise --autotuning tune|run`` finds the fastest config that fits.

The parts, one concern each:

- :mod:`~shardwise.autotuning.metric_hook`: inside an experiment, the step hook that measures
  the metric between ``start_profile_step`` and ``end_profile_step`` (or profiles the model)
  and writes it to a JSON file, then ends the run;
- :mod:`~shardwise.autotuning.space`: the candidate experiments (ZeRO stage, micro batch,
  gradient accumulation, the config's own lists of values);
- :mod:`~shardwise.autotuning.memory_fit`: the memory plan's prediction per candidate, and
  the pruning of those that cannot fit before anything is launched;
- :mod:`~shardwise.autotuning.records`: experiments on disk (resumable);
- :mod:`~shardwise.autotuning.cost_model` and :mod:`~shardwise.autotuning.tuners`: the
  search (gridsearch, random, model_based), trials and early stopping;
- :mod:`~shardwise.autotuning.runner`: one experiment through our own launcher;
- :mod:`~shardwise.autotuning.report`: the summary table and the best config file;
- :mod:`~shardwise.autotuning.autotuner`: the orchestration of ``tune`` and ``run``.

Nothing here is imported by ``import shardwise``.
"""
