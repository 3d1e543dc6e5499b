"""Small shared helpers: the rank-aware logger."""
