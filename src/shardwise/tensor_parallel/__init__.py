"""Tensor parallelism: DeepSpeed AutoTP training on PyTorch (``tensor_parallel`` section,
``deepspeed.tp_model_init``).

Linear layers are replaced by ones holding this rank's slice of the weight
(:mod:`~shardwise.tensor_parallel.layers`), chosen by layer specs
(:mod:`~shardwise.tensor_parallel.specs`, :mod:`~shardwise.tensor_parallel.presets`), a
transformers ``_tp_plan`` (:mod:`~shardwise.tensor_parallel.hf_plan`) or DeepSpeed's name rules
(:mod:`~shardwise.tensor_parallel.partitioner`). The group is the mesh's ``tp`` dimension; ZeRO
runs over the data dimension unchanged (stage 3: FSDP2 shards the slices, a 2-D layout).

Nothing is imported here; import the submodule you need.
"""
