"""``shardwise.pipe``: pipeline parallelism with DeepSpeed's API (``deepspeed.pipe``).

* :class:`PipelineModule`, :class:`LayerSpec`, :class:`TiedLayerSpec` -- the model as a list of layers
  cut into stages (:mod:`.module`, :mod:`.spec`, :mod:`.partition`, tied weights in :mod:`.tied`);
* :class:`ProcessTopology`, :class:`PipeDataParallelTopology`, :class:`PipeModelDataParallelTopology`
  -- rank arithmetic (:mod:`.topology`); :class:`PipelineParallelGrid` -- their groups, read from
  :mod:`shardwise.comm.mesh` (:mod:`.grid`);
* :mod:`.schedule` -- DeepSpeed's instruction schedules; :mod:`.executor` -- the schedules that run
  (``torch.distributed.pipelining``: DeepSpeed's 1F1B by default, GPipe, interleaved 1F1B, zero bubble);
* :class:`~shardwise.pipe.engine.PipelineEngine` -- what ``initialize`` returns for a PipelineModule
  (``train_batch``, ``eval_batch``).
"""

from __future__ import annotations

from shardwise.pipe.grid import PipelineParallelGrid
from shardwise.pipe.module import PipelineError, PipelineModule
from shardwise.pipe.spec import LayerSpec, TiedLayerSpec
from shardwise.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineError",
    "PipelineModule",
    "PipelineParallelGrid",
    "ProcessTopology",
    "TiedLayerSpec",
]
