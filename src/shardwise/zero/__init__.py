"""ZeRO: flat buffers, partition maths, bucketed gradient reduction, the sharded optimizer."""

from shardwise.zero.partition import BucketPlan, FlatLayout, Slot, plan_layout

__all__ = ["BucketPlan", "FlatLayout", "Slot", "plan_layout"]
