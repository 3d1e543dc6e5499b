"""Data loading for data-parallel ranks: a reshuffling, resumable loader and an endless wrapper."""

from shardwise.data.loader import (
    ROUTES,
    RepeatingLoader,
    ShardwiseDataLoader,
    build_data_loader,
    num_batches,
    resume_skip,
)

__all__ = [
    "ROUTES",
    "RepeatingLoader",
    "ShardwiseDataLoader",
    "build_data_loader",
    "num_batches",
    "resume_skip",
]
