"""Random layerwise token dropping (random-LTD): the layer wrapper and the model conversion.

A wrapped layer, in training, runs on a random subset of ``kept`` sequence positions of its
input (the same count for every sample, a different subset per sample, in their original
order); the dropped positions skip the layer (their hidden state passes through unchanged), and
the layer's outputs are scattered back in place. With ``kept`` at the full length, or in
evaluation, the layer runs on every token. The kept count is set by the engine each step from
``data_routing.random_ltd.random_ltd_schedule`` (see
:mod:`shardwise.data_efficiency.random_ltd_hook`).

**Wrapping a model** (DeepSpeed's ``convert_to_random_ltd`` is the reference): call
:func:`convert_to_random_ltd` on the model before ``initialize``, naming the class of its
transformer layers. Layers of that class are numbered in module order (each wrapper keeps its
number as ``layer_id``). Without ``layer_ids`` every layer is wrapped, as DeepSpeed does, and
``initialize`` lets only the layers listed in ``random_ltd_layer_id`` drop tokens (the others run
on every token); with ``layer_ids`` only those are wrapped, and they must be the ones the config
lists (:mod:`shardwise.data_efficiency.random_ltd_hook` checks both and names the mismatch).
DeepSpeed matches an id to a layer by finding the number in the layer's module name; here it is
the layer's position among the layers of that class.

The layer's forward must take the hidden states as its first positional argument
(``[batch, seq, hidden]`` for ``hidden_state_order: batch_seq_dim``, ``[seq, batch, hidden]``
for ``seq_batch_dim``) and return them first (alone or as the first item of a tuple). The attention mask named by ``model_mask_name`` (a keyword argument, or the
second positional one) is gathered to the kept tokens: ``[batch, ..., seq, seq]`` masks on their
last two dimensions for ``model_type: "decoder"``, ``[batch, ..., seq]`` key masks on their last
dimension for ``"encoder"``.

The wrapped layers' parameter names gain ``.random_ltd_layer`` (``blocks.1.random_ltd_layer.attn.qkv.weight``),
DeepSpeed's wrapper attribute: the checkpoints and exports of a converted model carry those names,
so load them into a model converted the same way, or drop the wrapper's part of the names with
:func:`remove_random_ltd_state_dict` / :func:`save_without_random_ltd` (DeepSpeed's helpers, with
its renaming rule) for a model that is not converted. (DeepSpeed also strips them from
``module_state_dict``; here the names follow the module tree, which DCP's sharded checkpoints rely on.)

Example:
    >>> import torch
    >>> layer = RandomLTDLayer(torch.nn.Identity())
    >>> layer.kept_tokens = 3
    >>> layer(torch.arange(6.0).view(1, 6, 1)).shape
    torch.Size([1, 6, 1])
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "RandomLTDLayer",
    "convert_to_random_ltd",
    "gather_tokens",
    "random_ltd_layers",
    "remove_random_ltd_state_dict",
    "save_without_random_ltd",
    "scatter_tokens",
]

WRAPPER_PART = ".random_ltd_layer"
"""What a wrapper adds to its layer's state-dict keys (DeepSpeed's ``RandomLayerTokenDrop`` adds the same)."""


def sample_kept_indices(batch: int, seq: int, kept: int, device: torch.device) -> torch.Tensor:
    """``[batch, kept]`` sorted positions, a uniformly random subset of ``range(seq)`` per sample."""
    scores = torch.rand(batch, seq, device=device)
    return scores.topk(kept, dim=1).indices.sort(dim=1).values


def gather_tokens(hidden: torch.Tensor, indices: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """The kept tokens of ``hidden`` (``[B, S, H]`` with seq_dim 1, ``[S, B, H]`` with seq_dim 0)."""
    if seq_dim == 0:
        return gather_tokens(hidden.transpose(0, 1), indices, 1).transpose(0, 1)
    index = indices.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    return hidden.gather(1, index)


def scatter_tokens(
    full: torch.Tensor, kept: torch.Tensor, indices: torch.Tensor, seq_dim: int
) -> torch.Tensor:
    """``full`` with the rows at ``indices`` replaced by ``kept`` (out of place)."""
    if seq_dim == 0:
        return scatter_tokens(full.transpose(0, 1), kept.transpose(0, 1), indices, 1).transpose(0, 1)
    index = indices.unsqueeze(-1).expand(-1, -1, full.shape[-1])
    return full.scatter(1, index, kept.to(full.dtype))


def gather_mask(mask: torch.Tensor, indices: torch.Tensor, model_type: str) -> torch.Tensor:
    """The attention mask restricted to the kept tokens (rows and columns for a decoder's
    ``[B, ..., S, S]`` mask, columns for an encoder's ``[B, ..., S]`` key mask). A mask shared by
    the batch (leading size 1) is expanded to the batch."""
    batch, kept = indices.shape
    if mask.shape[0] == 1 and batch > 1:
        mask = mask.expand(batch, *mask.shape[1:])
    middle = mask.shape[1:-2] if model_type == "decoder" else mask.shape[1:-1]
    view = (batch,) + (1,) * len(middle)
    if model_type == "decoder":
        seq = mask.shape[-1]
        rows = indices.view(*view, kept, 1).expand(batch, *middle, kept, seq)
        mask = mask.gather(-2, rows)
        cols = indices.view(*view, 1, kept).expand(batch, *middle, kept, kept)
        return mask.gather(-1, cols)
    cols = indices.view(*view, kept).expand(batch, *middle, kept)
    return mask.gather(-1, cols)


class RandomLTDLayer(nn.Module):
    """A layer that, in training, runs on ``kept_tokens`` random positions (see the module docstring).

    Args:
        layer: the wrapped layer (registered as ``random_ltd_layer``, DeepSpeed's attribute name).
        hidden_state_order: ``"batch_seq_dim"`` or ``"seq_batch_dim"``.
        model_type: ``"decoder"`` or ``"encoder"`` (how the mask is gathered).
        mask_name: the mask's keyword (``model_mask_name``); None: no mask is gathered.

        layer_id: the layer's number among the layers of its class, in module order (what
            ``random_ltd_layer_id`` lists); :func:`convert_to_random_ltd` sets it.
        chosen: True when the caller picked this layer (``convert_to_random_ltd``'s
            ``layer_ids``), so the config must list it too.

    Attributes:
        kept_tokens: tokens to keep (None: all); set by the random-LTD step hook.
    """

    def __init__(
        self,
        layer: nn.Module,
        hidden_state_order: str = "batch_seq_dim",
        model_type: str = "decoder",
        mask_name: str | None = None,
        layer_id: int | None = None,
        chosen: bool = False,
    ) -> None:
        super().__init__()
        self.random_ltd_layer = layer
        self.seq_dim = 0 if hidden_state_order == "seq_batch_dim" else 1
        self.model_type = model_type
        self.mask_name = mask_name
        self.layer_id = layer_id
        self.chosen = chosen
        self.kept_tokens: int | None = None

    def forward(self, hidden: torch.Tensor, *args: object, **kwargs: object) -> Any:
        """Run the layer on the kept tokens and put its output back among the dropped ones."""
        seq = hidden.shape[self.seq_dim]
        if not self.training or self.kept_tokens is None or self.kept_tokens >= seq:
            return self.random_ltd_layer(hidden, *args, **kwargs)
        batch = hidden.shape[1 - self.seq_dim]
        indices = sample_kept_indices(batch, seq, int(self.kept_tokens), hidden.device)
        if self.mask_name is not None:
            mask = kwargs.get(self.mask_name)
            if mask is not None:
                if not isinstance(mask, torch.Tensor):
                    raise TypeError(
                        f"random-LTD: the layer's {self.mask_name!r} argument is a {type(mask).__name__}, "
                        "not a tensor; pass the attention mask as a tensor"
                    )
                kwargs = {**kwargs, self.mask_name: gather_mask(mask, indices, self.model_type)}
            elif args and isinstance(args[0], torch.Tensor):
                args = (gather_mask(args[0], indices, self.model_type), *args[1:])
        out = self.random_ltd_layer(gather_tokens(hidden, indices, self.seq_dim), *args, **kwargs)
        if isinstance(out, tuple):
            return (scatter_tokens(hidden, out[0], indices, self.seq_dim), *out[1:])
        return scatter_tokens(hidden, out, indices, self.seq_dim)


def _parent_and_name(model: nn.Module, qualified: str) -> tuple[nn.Module, str]:
    parent_name, _, child = qualified.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), child


def convert_to_random_ltd(
    model: nn.Module,
    layer_class: type[nn.Module],
    layer_ids: list[int] | None = None,
    *,
    hidden_state_order: str = "batch_seq_dim",
    model_type: str = "decoder",
    mask_name: str | None = None,
) -> nn.Module:
    """Wrap the layers of ``layer_class`` whose index (in module order) is in ``layer_ids``, in place;
    every layer of the class when ``layer_ids`` is None (DeepSpeed's form: the config's
    ``random_ltd_layer_id`` then picks the layers that drop tokens).

    Returns:
        the model (its wrapped layers' parameters keep their objects; names gain ``.random_ltd_layer``).

    Raises:
        ValueError: an id is out of range, repeated, or the model has no layer of that class.

    Example:
        >>> from shardwise.testing.models import Block, GPTConfig, TinyGPT
        >>> m = convert_to_random_ltd(TinyGPT(GPTConfig(n_layer=3, n_embd=16)), Block, [1, 2])
        >>> [type(b).__name__ for b in m.blocks]
        ['Block', 'RandomLTDLayer', 'RandomLTDLayer']
        >>> every = convert_to_random_ltd(TinyGPT(GPTConfig(n_layer=3, n_embd=16)), Block)
        >>> [b.layer_id for b in every.blocks]
        [0, 1, 2]
    """
    names = [name for name, module in model.named_modules() if type(module) is layer_class]
    if not names:
        raise ValueError(f"convert_to_random_ltd: the model has no {layer_class.__name__} layer to wrap")
    chosen = layer_ids is not None
    ids = list(range(len(names))) if layer_ids is None else list(layer_ids)
    if len(set(ids)) != len(ids) or any(not 0 <= i < len(names) for i in ids):
        raise ValueError(
            f"convert_to_random_ltd: layer ids {ids} must be distinct and in [0, {len(names)}) "
            f"(the model has {len(names)} {layer_class.__name__} layers)"
        )
    for i in ids:
        parent, child = _parent_and_name(model, names[i])
        wrapped = RandomLTDLayer(
            getattr(parent, child), hidden_state_order, model_type, mask_name, layer_id=i, chosen=chosen
        )
        setattr(parent, child, wrapped)
    return model


def random_ltd_layers(model: nn.Module) -> list[RandomLTDLayer]:
    """The model's random-LTD wrappers, in module order."""
    return [module for module in model.modules() if isinstance(module, RandomLTDLayer)]


def remove_random_ltd_state_dict(state_dict: Mapping[str, Any]) -> collections.OrderedDict[str, Any]:
    """``state_dict`` with the wrappers' ``.random_ltd_layer`` taken out of every key, in order, so it
    loads into the model before conversion (DeepSpeed's helper: every occurrence in a key is removed).

    Example:
        >>> sorted(remove_random_ltd_state_dict({"blocks.1.random_ltd_layer.w": 1, "head.w": 2}))
        ['blocks.1.w', 'head.w']
    """
    return collections.OrderedDict((key.replace(WRAPPER_PART, ""), value) for key, value in state_dict.items())


def save_without_random_ltd(model: nn.Module) -> collections.OrderedDict[str, Any]:
    """The state dict of ``model`` (of ``model.module`` when it has one: an engine) without the
    wrappers' part of the keys (:func:`remove_random_ltd_state_dict`); DeepSpeed's helper."""
    inner = getattr(model, "module", model)
    return remove_random_ltd_state_dict(inner.state_dict())
