"""DeepSpeed's AutoEP+AutoTP gradient-correction API (``deepspeed.module_inject.auto_ep_folding``'s
``mark_*`` / ``reduce_*`` functions and strategy names): importable, refusing when called.

DeepSpeed corrects folded gradients after backward, per parameter family (router AVERAGE over TP,
partial router SUM, routed experts divided by tp_size). shardwise's folded layer computes every
gradient exactly on every TP lane in autograd (:mod:`shardwise.autoep.folded`: Megatron's f/g around
the lane's share of the routed assignments), so there is no such step to mark for or call.
"""

from __future__ import annotations

from shardwise.compat.unavailable import unavailable_function

_INSTEAD = ("shardwise's folded AutoEP layer gives every parameter its exact gradient on every tensor-parallel "
            "lane during backward (shardwise.autoep.folded), so no per-family gradient correction runs after it; "
            "drop the call")
FUNCTIONS = (
    "mark_autoep_folding_router_parameter",
    "mark_autoep_folding_partial_router_parameter",
    "mark_autoep_folding_sp_sharded_layernorm_parameter",
    "autoep_folding_gradient_reduction_strategy",
    "reduce_autoep_folding_gradient",
    "apply_folding_correction_to_grad_buffer",
    "is_autoep_folding_gradient_corrected",
    "clear_autoep_folding_gradient_corrected",
)
"""The correction functions, each a refusal naming itself."""
for _name in FUNCTIONS:
    globals()[_name] = unavailable_function(f"deepspeed.module_inject.auto_ep_folding.{_name}", _INSTEAD)
AUTOEP_FOLDING_GRAD_REDUCE_SKIP = "skip"  # DeepSpeed's names of those corrections (importable; nothing reads them)
AUTOEP_FOLDING_GRAD_REDUCE_SUM = "sum"
AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE = "average"
AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL = "expert_tp_cancel"
