"""Mixture of experts with expert parallelism (DeepSpeed's ``deepspeed.moe``).

- :mod:`~shardwise.moe.gating`: top-1/top-2/top-k routing, capacity, the balancing loss (pure maths
  plus one MAX all-reduce when tokens are not dropped).
- :mod:`~shardwise.moe.dispatch`: tokens to expert slots and back; the all-to-all with autograd.
- :mod:`~shardwise.moe.experts`, :mod:`~shardwise.moe.layer`: ``Experts``, ``TopKGate``,
  ``MOELayer``, ``MoE``.
- :mod:`~shardwise.moe.utils`: ``is_moe_param`` and the optimizer-group split.
- :mod:`~shardwise.moe.parallelism`: the expert-parallel group from ``shardwise.comm.mesh``;
  :mod:`~shardwise.moe.declare`: a model's MoE layers declared to it (``initialize`` calls it).

ZeRO reduces expert parameters' gradients over the expert-data-parallel group
(``shardwise.zero.reduction_domain``).
"""
