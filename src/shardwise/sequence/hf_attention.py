"""Ulysses for Hugging Face models: ``deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF``.

transformers calls attention through ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` with
``[bs, heads, seq, head_dim]`` tensors. :meth:`UlyssesSPAttentionHF.register_with_transformers`
replaces the entry of the requested implementation (``"sdpa"``, ``"flex_attention"``, a flash or hub
kernel) with a wrapper, so every code path transformers keys on that name still runs and only the
attention call is intercepted: the wrapper exchanges q/k/v from sequence shards to head shards
(:func:`shardwise.comm.sequence_exchange.all_to_all_dims`), gathers ``position_ids`` (causality
follows them; the local 4-D mask is dropped, as DeepSpeed does), calls the original function over
the whole sequence, and exchanges the context back.

Example (without sequence parallelism nothing is registered):
    >>> UlyssesSPAttentionHF.register_with_transformers(
    ...     model_name_or_path=None, core_attn_implementation="sdpa",
    ...     sequence_parallel_size=1, micro_batch_size=1) is None
    True
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import Any

from torch import Tensor, nn

from shardwise.comm.group_type import Group
from shardwise.comm.sequence_exchange import all_gather_cat, all_to_all_dims, group_rank, group_size
from shardwise.utils.logging import logger

__all__ = ["UlyssesSPAttentionHF"]

_HF_HEADS, _HF_SEQ = 1, 2  # [bs, heads, seq, head_dim]
_UNSUPPORTED = ("eager", "paged|eager")
_HUB_KERNEL = re.compile(r"^[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?$")


class UlyssesSPAttentionHF(nn.Module):
    """Ulysses around a transformers attention function (DeepSpeed's constructor).

    Args:
        attn: the attention function from ``ALL_ATTENTION_FUNCTIONS``.
        batch_size: micro batch size.
        attn_head_count: query heads (must be divisible by the SP size).
        attn_head_size: head dimension.
        kv_head_count: key/value heads (divisible by the SP size, or dividing it: then replicated).
        num_hidden_layers: the model's layers.
        process_group: the sequence-parallel group.
        seq_length_is_variable: whether the sequence length changes between batches.
        local_seq_length: this rank's tokens (when fixed).
        global_seq_length: the whole sequence (when fixed).
        disable_in_eval: call ``attn`` directly (full sequences) when the module is in eval mode.
    """

    def __init__(
        self,
        attn: Any,
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group: Group,
        seq_length_is_variable: bool = False,
        local_seq_length: int | None = None,
        global_seq_length: int | None = None,
        disable_in_eval: bool = False,
    ) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = group_size(process_group)
        self.sp_rank = group_rank(process_group)
        self.batch_size = batch_size
        self.attn_head_count, self.attn_head_size = attn_head_count, attn_head_size
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.disable_in_eval = disable_in_eval
        self.core_attn_implementation: str | None = None
        if attn_head_count % self.world_size:
            raise ValueError(
                f"sequence parallelism splits attention heads over ranks: {attn_head_count} query heads do not "
                f"divide among sequence_parallel_size={self.world_size}; pick a degree that divides the head count"
            )
        if kv_head_count % self.world_size and self.world_size % kv_head_count:
            raise ValueError(
                f"sequence parallelism needs the {kv_head_count} key/value heads and sequence_parallel_size="
                f"{self.world_size} to divide one another (heads are split, or replicated when fewer than ranks)"
            )
        self.local_q_head_count = attn_head_count // self.world_size
        self.kv_replication_factor = max(1, self.world_size // kv_head_count)
        self.local_kv_head_count = max(1, kv_head_count // self.world_size)

    def _check_length(self, local: int) -> None:
        if self.seq_length_is_variable:
            self.local_seq_length, self.global_seq_length = local, local * self.world_size
        elif local != self.local_seq_length:
            raise ValueError(
                f"rank {self.sp_rank}: a sequence shard of {local} tokens, but seq_length fixes it at "
                f"{self.local_seq_length}; pass seq_length_is_variable=True for varying lengths"
            )

    def _to_heads(self, x: Tensor, replicate: int) -> Tensor:
        if replicate > 1:
            x = x.repeat_interleave(replicate, dim=_HF_HEADS)
        return all_to_all_dims(x, _HF_HEADS, _HF_SEQ, self.process_group, world_size=self.world_size)

    def forward(
        self,
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Any,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Tensor, Any]:
        """The context of this rank's tokens, ``[bs, seq_local, heads * head_dim]``, and the weights."""
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        if "position_ids" not in kwargs or kwargs["position_ids"] is None:
            raise ValueError(
                "Ulysses SP needs position_ids in every forward(): after the sequence is gathered, causality "
                "follows them. Pass position_ids = torch.arange(seq_len) per sample (reset at document "
                "boundaries for packed sequences), or wrap the data loader in UlyssesSPDataLoaderAdapter"
            )
        self._check_length(query.shape[_HF_SEQ])
        kwargs["position_ids"] = all_gather_cat(kwargs["position_ids"], 1, self.process_group)
        q = self._to_heads(query, 1)
        k = self._to_heads(key, self.kv_replication_factor)
        v = self._to_heads(value, self.kv_replication_factor)
        if self.kv_replication_factor > 1:
            setattr(module, "num_key_value_groups", q.shape[_HF_HEADS] // k.shape[_HF_HEADS])  # noqa: B010 - HF's attribute
        attention_mask = self._full_length_mask(attention_mask, q)
        context, weights = self.attn(module, q, k, v, attention_mask, *args, **kwargs)
        # [bs, seq, heads_local, head_dim] -> [bs, seq_local, heads, head_dim]
        context = all_to_all_dims(context, 1, 2, self.process_group, world_size=self.world_size)
        return context.reshape(*context.shape[:2], -1), weights

    def _full_length_mask(self, attention_mask: Any, q: Tensor) -> Any:
        """A flex-attention ``BlockMask`` rebuilt (causal) for the gathered length; anything else dropped."""
        if self.core_attn_implementation != "flex_attention" or attention_mask is None:
            return None
        from torch.nn.attention.flex_attention import BlockMask, create_block_mask

        if not isinstance(attention_mask, BlockMask):
            return None
        length = q.shape[_HF_SEQ]
        return create_block_mask(
            lambda b, h, qi, ki: qi >= ki, B=q.shape[0], H=None, Q_LEN=length, KV_LEN=length, device=q.device
        )

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path: Any,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
        max_length: int | None = None,
    ) -> ModuleType | None:
        """Route ``core_attn_implementation`` through Ulysses; return the mpu (None when SP is 1).

        Args:
            model_name_or_path: a loaded model (or anything with ``.config``), or a name/path for
                ``AutoConfig.from_pretrained``.
            core_attn_implementation: the attention the model uses (``"sdpa"``, ``"flex_attention"``,
                a flash-attention name or a hub kernel ``org/name``); ``"eager"`` is refused.
            sequence_parallel_size: the SP degree (declared in the process layout).
            micro_batch_size: the micro batch size.
            seq_length: the fixed global length (with ``seq_length_is_variable=False``).
            seq_length_is_variable: lengths may change between batches.
            disable_in_eval: bypass SP in eval mode.
            max_length: deprecated spelling of ``seq_length``.

        Returns:
            :mod:`shardwise.sequence.parallel_state` (pass it to ``initialize(mpu=...)``), or None.
        """
        if sequence_parallel_size == 1:
            return None
        if max_length is not None:
            logger.warning("register_with_transformers: max_length is deprecated; use seq_length")
            seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError(
                "register_with_transformers: pass seq_length (the fixed global length) or seq_length_is_variable=True"
            )
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from shardwise.sequence import parallel_state as mpu

        mpu.initialize_sequence_parallel(sequence_parallel_size)
        loaded = hasattr(model_name_or_path, "config")
        config = model_name_or_path.config if loaded else AutoConfig.from_pretrained(model_name_or_path)
        if loaded:
            active = getattr(config, "_attn_implementation", None)
            if active is not None and active != core_attn_implementation:
                raise ValueError(
                    f"core_attn_implementation='{core_attn_implementation}' does not match model config "
                    f"attn_implementation='{active}'. Set both to the same value so the sequence-parallel "
                    "wrapper intercepts the attention the model calls."
                )
        if core_attn_implementation in _UNSUPPORTED:
            raise ValueError(
                f"{core_attn_implementation} attn_implementation isn't supported by Ulysses sequence parallelism: "
                "it needs a 4-D attention_mask over the whole sequence (O(n^2) memory). Use 'sdpa', "
                "'flex_attention', a flash-attention variant or a hub kernel."
            )
        if isinstance(core_attn_implementation, str) and _HUB_KERNEL.search(core_attn_implementation):
            from transformers.modeling_flash_attention_utils import lazy_import_flash_attention

            lazy_import_flash_attention(core_attn_implementation)
        if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(
                f"core_attn_implementation={core_attn_implementation!r} is not an attention function transformers knows; "
                f"registered ones: "
                f"{ALL_ATTENTION_FUNCTIONS.valid_keys()}"
            )
        text = config.get_text_config()
        world = mpu.get_sequence_parallel_world_size()
        uattn = cls(
            attn=ALL_ATTENTION_FUNCTIONS[core_attn_implementation],
            batch_size=micro_batch_size,
            attn_head_count=text.num_attention_heads,
            attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
            kv_head_count=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            num_hidden_layers=text.num_hidden_layers,
            process_group=mpu.get_sequence_parallel_group(),
            seq_length_is_variable=seq_length_is_variable,
            local_seq_length=None if seq_length_is_variable or seq_length is None else seq_length // world,
            global_seq_length=None if seq_length_is_variable else seq_length,
            disable_in_eval=disable_in_eval,
        )
        uattn.core_attn_implementation = core_attn_implementation

        def ulysses_attention(
            module: nn.Module,
            query: Tensor,
            key: Tensor,
            value: Tensor,
            attention_mask: Any,
            *args: Any,
            **kwargs: Any,
        ) -> tuple[Tensor, Any]:
            return uattn(module, query, key, value, attention_mask, *args, **kwargs)

        ulysses_attention.ulysses = uattn  # type: ignore[attr-defined]
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = ulysses_attention
        return mpu
