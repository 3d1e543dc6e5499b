"""Sequence parallelism: DeepSpeed-Ulysses and Arctic long-sequence training (ALST).

* :mod:`~shardwise.sequence.layout` -- pure: head and token shards of each rank;
* :mod:`~shardwise.sequence.layer` -- ``DistributedAttention`` (Ulysses around any local attention);
* :mod:`~shardwise.sequence.loss` -- the token-weighted loss over the sequence-parallel group;
* :mod:`~shardwise.sequence.tiled` -- ``TiledMLP``, ``SequenceTiledCompute``, ``TiledFusedLogitsLoss``;
* :mod:`~shardwise.sequence.parallel_state` -- the Ulysses mpu over the process layout's ``sp`` groups;
* :mod:`~shardwise.sequence.hf_attention` -- ``UlyssesSPAttentionHF`` for Hugging Face models;
* :mod:`~shardwise.sequence.data` -- ``UlyssesSPDataLoaderAdapter``.

The collectives are :mod:`shardwise.comm.sequence_exchange`'s; the groups come from the one
process layout (:mod:`shardwise.comm.mesh`). ``deepspeed.sequence.layer`` and
``deepspeed.runtime.sequence_parallel.*`` reach these modules through ``compat/table.py``.
"""
