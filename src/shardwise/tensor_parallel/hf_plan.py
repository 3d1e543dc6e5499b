"""A transformers model's own tensor-parallel plan (``_tp_plan``) as layer specs (pure).

transformers declares, per model class, which submodules are ``colwise`` / ``rowwise`` and so
on, as glob patterns over module names (``layers.*.self_attn.q_proj``). The plan is read from
the model config's ``base_model_tp_plan``, the class's ``_tp_plan`` and the instance's, in that
order; a ``model.``-prefixed entry already given without the prefix is not repeated.

Styles map to splits as DeepSpeed maps them: ``colwise`` -> column; ``colwise_rep`` /
``colwise_gather_output`` -> column with the output gathered; ``rowwise`` -> row;
``embedding_rowwise`` -> left whole; ``replicated_with_grad_allreduce`` -> left whole with the
gradient summed over the tensor-parallel ranks. Any other style rejects the plan (applying half
of a column/row pair would be wrong), naming the fix.

Example:
    >>> specs = specs_from_hf_plan({"layers.*.self_attn.o_proj": "rowwise", "lm_head": "colwise_rep"})
    >>> [(s.partition_type, s.gather_output) for s in specs]
    [('row', False), ('column', True)]
    >>> specs[0].matches("model.layers.2.self_attn.o_proj.weight")
    True
"""

from __future__ import annotations

from collections.abc import Mapping

from shardwise.tensor_parallel.specs import LayerSpec

__all__ = ["HF_STYLES", "hf_tp_plan", "specs_from_hf_plan"]

HF_STYLES = frozenset(
    {"colwise", "colwise_rep", "colwise_gather_output", "rowwise", "replicated_with_grad_allreduce",
     "embedding_rowwise"}
)


def hf_tp_plan(model: object) -> dict[str, str] | None:
    """The merged ``_tp_plan`` of a transformers model, or None when it declares none."""
    config = getattr(model, "config", None)
    plans = (
        getattr(config, "base_model_tp_plan", None) if config is not None else None,
        getattr(type(model), "_tp_plan", None),
        getattr(model, "__dict__", {}).get("_tp_plan"),
    )
    merged: dict[str, str] = {}
    seen: set[str] = set()
    for plan in plans:
        if not isinstance(plan, Mapping):
            continue
        for pattern, style in plan.items():
            bare = pattern.removeprefix("model.")
            if pattern.startswith("model.") and bare in seen:
                continue
            merged[pattern] = style
            seen.add(bare)
    return merged or None


def _regex(glob: str) -> str:
    regex = ".*" + glob.replace(".", r"\.").replace("*", ".*")
    return regex + (r"$" if regex.endswith(r"\.weight") else r"\.weight$")


def specs_from_hf_plan(plan: Mapping[str, str]) -> tuple[LayerSpec, ...]:
    """The layer specs of a transformers ``_tp_plan``.

    Raises:
        ValueError: a style shardwise does not split by (the whole plan is refused).
    """
    unknown = sorted({s for s in plan.values() if str(s).lower() not in HF_STYLES})
    if unknown:
        raise ValueError(
            f"the model's _tp_plan uses style(s) {unknown}: shardwise splits only {sorted(HF_STYLES)}, and "
            "applying part of a plan could split one half of a column/row pair; give "
            "tensor_parallel.partition_config.layer_specs for this model instead"
        )
    specs = []
    for glob, style in plan.items():
        style = str(style).lower()
        if style.startswith("colwise"):
            specs.append(LayerSpec((_regex(glob),), "column", gather_output=style != "colwise"))
        elif style == "rowwise":
            specs.append(LayerSpec((_regex(glob),), "row"))
        else:
            specs.append(LayerSpec((_regex(glob),), "skip", grad_allreduce=style == "replicated_with_grad_allreduce"))
    return tuple(specs)
