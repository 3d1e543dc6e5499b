"""``SparseAttentionUtils``: fit a BERT/RoBERTa-style model to sparse attention (DeepSpeed's helpers)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from shardwise.ops.sparse_attention.bert_sparse_self_attention import BertSparseSelfAttention
from shardwise.ops.sparse_attention.sparsity_config import SparsityConfig
from shardwise.utils.logging import logger


def _encoder(model: nn.Module, what: str) -> tuple[str, Any]:
    for name in ("bert", "roberta"):
        if hasattr(model, name):
            return name, getattr(model, name)
    raise ValueError(
        f"{what} supports models with a .bert or .roberta attribute; {type(model).__name__} has neither"
    )


class SparseAttentionUtils:
    """Static helpers: pad to the block size, unpad, extend position embeddings, swap attention layers."""

    @staticmethod
    def extend_position_embedding(model: Any, max_position: int) -> Any:
        """Tile the position embeddings of ``model.bert``/``model.roberta`` up to ``max_position``.

        RoBERTa keeps its two offset rows in front. ``model.config.max_position_embeddings`` is updated.
        """
        kind, encoder = _encoder(model, "extend_position_embedding")
        weight = encoder.embeddings.position_embeddings.weight
        offset = 2 if kind == "roberta" else 0
        original = weight.shape[0] - offset
        if max_position <= original:
            raise ValueError(f"max_position={max_position} must exceed the current {original} positions")
        multiples = max(1, max_position // original)
        extended = weight.new_empty(offset + original * multiples, weight.shape[1])
        extended[:offset] = weight[:offset]
        extended[offset:] = weight[offset:].repeat(multiples, 1)
        encoder.embeddings.position_embeddings.weight.data = extended
        model.config.max_position_embeddings = max_position + offset
        logger.info("Extended position embeddings to %d", original * multiples)
        return model

    @staticmethod
    def update_tokenizer_model_max_length(tokenizer: Any, max_position: int) -> Any:
        """Set the tokenizer's ``model_max_length`` (and its ``init_kwargs`` entry) to ``max_position``."""
        tokenizer.model_max_length = max_position
        tokenizer.init_kwargs["model_max_length"] = max_position
        return tokenizer

    @staticmethod
    def replace_model_self_attention_with_sparse_self_attention(
        model: Any, max_position: int, sparsity_config: SparsityConfig
    ) -> Any:
        """Swap every ``encoder.layer[i].attention.self`` of a BERT/RoBERTa model for sparse attention."""
        kind, encoder = _encoder(model, "replace_model_self_attention_with_sparse_self_attention")
        model.config.max_position_embeddings = max_position + (2 if kind == "roberta" else 0)
        SparseAttentionUtils.replace_self_attention_layer_with_sparse_self_attention_layer(
            model.config, encoder.encoder.layer, sparsity_config, max_position
        )
        return model

    @staticmethod
    def replace_self_attention_layer_with_sparse_self_attention_layer(
        config: Any, layers: Any, sparsity_config: SparsityConfig, max_seq_length: int | None = None
    ) -> Any:
        """Give each layer a :class:`BertSparseSelfAttention` that reuses its query/key/value projections."""
        for layer in layers:
            sparse = BertSparseSelfAttention(config, sparsity_config, max_seq_length)
            sparse.query = layer.attention.self.query
            sparse.key = layer.attention.self.key
            sparse.value = layer.attention.self.value
            layer.attention.self = sparse
        return layers

    @staticmethod
    def pad_to_block_size(
        block_size: int,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        token_type_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        pad_token_id: int,
        model_embeddings: Any,
    ) -> tuple[int, Any, Any, Any, Any, Any]:
        """Pad the sequence dimension to a multiple of ``block_size``.

        Returns ``(pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)``;
        the padding is masked out (``attention_mask`` 0), ``inputs_embeds`` are extended with
        ``model_embeddings(pad_token_id)``. Call :meth:`unpad_sequence_output` on the output.
        """
        if input_ids is not None:
            batch_size, seq_len = input_ids.shape
        elif inputs_embeds is not None:
            batch_size, seq_len = inputs_embeds.shape[:-1]
        else:
            raise ValueError("pad_to_block_size needs input_ids or inputs_embeds")
        pad_len = (block_size - seq_len % block_size) % block_size
        if pad_len == 0:
            return 0, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds
        if inputs_embeds is not None:
            pad_ids = torch.full(
                (batch_size, pad_len), pad_token_id, dtype=torch.long, device=inputs_embeds.device
            )
            inputs_embeds = torch.cat([inputs_embeds, model_embeddings(pad_ids)], dim=-2)
        if input_ids is not None:
            input_ids = F.pad(input_ids, (0, pad_len), value=pad_token_id)
        if position_ids is not None:
            position_ids = F.pad(position_ids, (0, pad_len), value=pad_token_id)
        if attention_mask is not None:
            attention_mask = F.pad(attention_mask, (0, pad_len), value=0)
        if token_type_ids is not None:
            token_type_ids = F.pad(token_type_ids, (0, pad_len), value=0)
        return pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds

    @staticmethod
    def unpad_sequence_output(pad_len: int, sequence_output: torch.Tensor) -> torch.Tensor:
        """Drop the ``pad_len`` positions :meth:`pad_to_block_size` added."""
        return sequence_output[:, :-pad_len] if pad_len > 0 else sequence_output
