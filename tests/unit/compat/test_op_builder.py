"""deepspeed.ops.op_builder: builders report truthfully which torch-based ops shardwise has."""

from __future__ import annotations

import pytest

from shardwise.compat import op_builder


def test_torch_based_ops_are_compatible_and_load_their_module() -> None:
    builder = op_builder.CPUAdamBuilder()
    assert builder.is_compatible() and builder.NAME == "cpu_adam"
    assert builder.absolute_name() == "deepspeed.ops.cpu_adam_op"
    assert hasattr(builder.load(), "DeepSpeedCPUAdam")
    assert op_builder.COMPATIBLE_OPS["fused_adam"] and op_builder.COMPATIBLE_OPS["fused_lamb"]


def test_compiled_only_ops_say_so_and_name_the_alternative() -> None:
    assert not op_builder.COMPATIBLE_OPS["async_io"]
    with pytest.raises(NotImplementedError, match=r"'async_io'.*nvme"):
        op_builder.AsyncIOBuilder().load()
    with pytest.raises(NotImplementedError, match="builds no C"):
        op_builder.CPUAdamBuilder().builder()


def test_every_builder_is_listed_once() -> None:
    names = [b.NAME for b in op_builder.BUILDERS]
    assert len(names) == len(set(names)) == len(op_builder.COMPATIBLE_OPS)
