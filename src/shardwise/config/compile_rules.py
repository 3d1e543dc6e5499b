"""The ``compile`` section's refusals: DeepCompile's graph passes, by name (model-free, so
``shardwise config check`` reports them as ``initialize`` does).

DeepSpeed's DeepCompile rewrites the compiled graph with passes named in ``compile.passes``.
shardwise has no such passes: ``engine.compile()`` compiles each transformer block with
``torch.compile`` and the ZeRO stage, sequence and tensor parallelism run outside the graph,
chosen by their own keys. A config that asks for a pass is refused, naming the key that gives
the same parallelism here.

Example:
    >>> from shardwise.config.model import ShardwiseConfig
    >>> (err,) = compile_errors(ShardwiseConfig(compile={"passes": ["z3"]}))
    >>> err.key, err.value
    ('compile.passes', ['z3'])
"""

from __future__ import annotations

from shardwise.config.errors import ConfigError
from shardwise.config.model import ShardwiseConfig

DEEPCOMPILE_PASSES: dict[str, tuple[str, str]] = {
    "z1": ("DeepCompile's ZeRO-1/2 pass (gradient reduction put into the compiled backward)", "zero_optimization.stage 1 or 2"),
    "z3": ("DeepCompile's ZeRO-3 pass (parameter gathers put into the compiled graph)", "zero_optimization.stage 3"),
    "autosp": ("DeepCompile's automatic sequence-parallelism pass", "sequence_parallel_size (Ulysses)"),
    "autotp": ("DeepCompile's automatic tensor-parallelism pass", "tensor_parallel.autotp_size"),
}
"""Each pass DeepSpeed 0.19.8 knows: what it is, and the key that gives its parallelism here."""


def compile_errors(cfg: ShardwiseConfig) -> list[ConfigError]:
    """``compile.passes``: refused when it names any pass (an empty list asks for none)."""
    passes = cfg.compile.passes or []
    if not passes:
        return []
    described = []
    for name in passes:
        if name in DEEPCOMPILE_PASSES:
            what, instead = DEEPCOMPILE_PASSES[name]
            described.append(f"'{name}' is {what}; here {instead} does that outside the graph")
        else:
            described.append(f"'{name}' is not a DeepCompile pass either (DeepSpeed knows {', '.join(DEEPCOMPILE_PASSES)})")
    rule = (
        "names DeepCompile graph passes, which shardwise does not have: engine.compile() compiles each "
        "transformer block with torch.compile and ZeRO runs outside the compiled graph (" + "; ".join(described) + ")"
    )
    fix = "remove compile.passes and call engine.compile(); choose the parallelism with the keys named"
    return [ConfigError("compile.passes", rule, fix, value=list(passes))]
