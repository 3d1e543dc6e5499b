"""Block-sparse self-attention with DeepSpeed's names (``deepspeed.ops.sparse_attention``).

Layouts (:class:`SparsityConfig` and its five modes) are pure, vectorised and cached per
sequence length; :class:`SparseSelfAttention` computes attention on the layout's blocks only
(see :mod:`.block_sparse` for how and why); :func:`sparse_attention_from_config` builds it from
a ds_config ``sparse_attention`` section.
"""

from shardwise.ops.sparse_attention.bert_sparse_self_attention import BertSparseSelfAttention
from shardwise.ops.sparse_attention.block_mask import layout_block_mask
from shardwise.ops.sparse_attention.from_config import (
    SparseAttentionBuilder,
    sparse_attention_from_config,
    sparsity_config_from_section,
)
from shardwise.ops.sparse_attention.sparse_attention_utils import SparseAttentionUtils
from shardwise.ops.sparse_attention.sparse_self_attention import SparseSelfAttention
from shardwise.ops.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

__all__ = [
    "BSLongformerSparsityConfig",
    "BertSparseSelfAttention",
    "BigBirdSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "SparseAttentionBuilder",
    "SparseAttentionUtils",
    "SparseSelfAttention",
    "SparsityConfig",
    "VariableSparsityConfig",
    "layout_block_mask",
    "sparse_attention_from_config",
    "sparsity_config_from_section",
]
