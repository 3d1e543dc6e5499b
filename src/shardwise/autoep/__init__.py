"""AutoEP: DeepSpeed's ``expert_parallel`` section, a model's MoE blocks rebuilt for expert parallelism.

- :mod:`~shardwise.autoep.config`: the section (:class:`AutoEPConfig`), its checks, HF defaults.
- :mod:`~shardwise.autoep.presets`: the model families (Mixtral, Qwen3-MoE, DeepSeek-V2/V3...), the
  detected-layer record :class:`MoELayerSpec`.
- :mod:`~shardwise.autoep.detect`: ``AutoEP``: finds the blocks, replaces them.
- :mod:`~shardwise.autoep.layer`: ``AutoEPMoELayer`` (router, this rank's experts, the all-to-all),
  built from :mod:`~shardwise.autoep.router`, :mod:`~shardwise.autoep.experts` and
  :mod:`~shardwise.autoep.repack` (the source weights, gathered when ZeRO-3 construction partitioned them).
- :mod:`~shardwise.autoep.fused_layout`: which way round a fused gate/up expert tensor is stored.
- :mod:`~shardwise.autoep.tp_dispatch` (with :mod:`~shardwise.autoep.tp_consistency`): AutoEP folded
  with AutoTP: each routed assignment dispatched by one tensor-parallel lane, the output restored on all.
- :mod:`~shardwise.autoep.convert`: what ``initialize`` does with the section.
- :mod:`~shardwise.autoep.universal`: expert optimizer-state fragments into DeepSpeed's universal layout.
"""
