"""The parts of :func:`shardwise.initialize` that are a concern of their own, one module each.

``initialization.py`` runs the steps in order; the steps that grew past a few lines live here:
:mod:`~shardwise.startup.process_layout` (joining the process group and declaring the process
layout from the config, an mpu, ``mesh_param``, MoE layers and AutoEP; the tensor-parallel split)
and :mod:`~shardwise.startup.zero_setup` (placing the model and building the ZeRO optimizer; the
optimizer ``initialize`` returns).
"""
