"""Model-side operators configured from ds_config sections (``sparse_attention``).

Nothing here is imported by ``import shardwise``; each subpackage imports torch itself.
"""
