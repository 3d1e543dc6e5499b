"""``engine.compile()``: ``torch.compile`` per transformer block, at every ZeRO stage.

The unit compiled is the unit stage 3 shards with FSDP2 (torchtitan's approach): each *block* of
:func:`shardwise.zero.wrap_policy.repeated_blocks`. Only a block's ``forward`` is compiled; its
module hooks (FSDP2's gathers, ``overlap_comm``'s waits, profilers) stay eager around the graph,
and ZeRO's reductions run in gradient hooks outside it. :mod:`.plan` chooses what is compiled,
:mod:`.options` checks the backend and ``compile_kwargs``, :mod:`.compiler` does it and acts on the
``compile`` config section.
"""

from shardwise.compilation.compiler import ModelCompiler
from shardwise.compilation.plan import CompilePlan, plan_compile

__all__ = ["CompilePlan", "ModelCompiler", "plan_compile"]
