"""deepspeed.comm's logging decorator and helpers (shardwise.comm.op_logging), launcher readers and
constants; positions and sizes as DeepSpeed 0.19.8's helpers give them for the same signatures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from shardwise.comm import constants, launcher_env
from shardwise.comm import op_logging as t
from shardwise.comm.comms_logger import COMMS_LOGGER, configure, get_logged_comm_ops, reset_log


def ag(tensor_list, tensor, group=None, async_op=False, prof=False, log_name="all_gather", debug=None):  # type: ignore[no-untyped-def]
    return None


def a2a(output_tensor_list, input_tensor_list, group=None):  # type: ignore[no-untyped-def]
    return None


def rs(output, input_list, op=None, group=None):  # type: ignore[no-untyped-def]
    return None


def bar(group=None, async_op=False):  # type: ignore[no-untyped-def]
    return None


def arc(tensors, op=None):  # type: ignore[no-untyped-def]
    return None


def bi(p2p_op_list, prof=False):  # type: ignore[no-untyped-def]
    return None


def ga(tensor, gather_list=None, dst=0):  # type: ignore[no-untyped-def]
    return None


class _Op:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def test_signature_readers_agree_with_deepspeed() -> None:
    assert [t.get_tensor_position(f) for f in (ag, a2a, rs, bar, arc, bi)] == [1, 1, 1, -1, 0, 0]
    assert t.get_msg_size_from_args(ag, [torch.ones(4)], torch.ones(4)) == 16
    assert t.get_msg_size_from_args(a2a, [torch.ones(2)], [torch.ones(3), torch.ones(2, dtype=torch.float16)]) == 16
    assert t.get_msg_size_from_args(bar) == 0 and t.get_msg_size_from_args(ga, tensor=torch.ones(5)) == 20
    assert t.get_msg_size_from_args(bi, [_Op(torch.ones(3)), _Op(torch.ones(2, dtype=torch.float64))]) == 28
    assert t.get_tensor_kwarg(rs, {"input_list": [1]}) == [1]
    assert t.get_default_args(ag) == {"group": None, "async_op": False, "prof": False, "log_name": "all_gather",
                                      "debug": None}
    assert t.get_debug_log_name({"log_name": "x"}, False) == "x"
    assert t.get_debug_log_name({"log_name": "x"}, True).startswith("x | [Caller Func: ")


@pytest.fixture
def logger_on() -> Iterator[None]:
    configure(enabled=True, prof_all=False, prof_ops=["listed"], debug=False, verbose=False)
    reset_log()
    yield
    configure(enabled=False, prof_all=True, prof_ops=[])
    reset_log()


def test_timed_op_records_selected_calls_under_their_log_name(logger_on: None) -> None:
    @t.timed_op
    def op(tensor: torch.Tensor, prof: bool = False, log_name: str = "listed") -> int:
        return 7

    assert op(torch.ones(2)) == 7 and op.__name__ == "op"
    op(torch.ones(3), log_name="other")  # neither prof_all nor listed: not recorded
    op(torch.ones(4), prof=True, log_name="forced")
    assert get_logged_comm_ops() == ["listed", "forced"]
    assert list(COMMS_LOGGER.records["listed"]) == [8] and list(COMMS_LOGGER.records["forced"]) == [16]


def test_launcher_readers_and_platforms() -> None:
    env = {"LOCAL_RANK": "2", "RANK": "5", "WORLD_SIZE": "8"}
    ompi = {"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}
    readers = (launcher_env.get_local_rank_from_launcher, launcher_env.get_world_rank_from_launcher,
               launcher_env.get_world_size_from_launcher)
    assert [[read(e) for read in readers] for e in (env, ompi, {})] == [[2, 5, 8], [1, 3, 4], [0, 0, 1]]
    assert launcher_env.in_aml({"AZUREML_EXPERIMENT_ID": "x"}) and not launcher_env.in_aml({})
    assert launcher_env.in_aws_sm({"SM_TRAINING_ENV": "{}"}) and launcher_env.in_dlts({"DLTS_JOB_ID": "1"})
    assert (constants.NCCL_BACKEND, constants.GLOO_BACKEND, constants.COMMS_LOGGER) == ("nccl", "gloo", "comms_logger")


def test_deepspeed_comms_logger_methods() -> None:
    from shardwise.comm.comms_logger import CommsLogger

    log = CommsLogger()
    log.start_profiling_comms()
    assert log.prof_all is True
    log.stop_profiling_comms()
    assert log.prof_all is False
    log.start_profiling_op(["a", "b"])
    log.stop_profiling_op(["a"])
    assert log.prof_ops == ["b"]
    latencies = [3.0, 1.0, 2.0]
    log.comms_dict = {"all_reduce": {1024: [3, list(latencies), [10 / x for x in latencies], [20 / x for x in latencies]]}}
    summary = log.get_operation_summary("all_reduce")
    assert summary is not None and summary[1024]["avg_latency_ms"] == 2.0 and summary[1024]["count"] == 3
    assert log.get_raw_data()["all_reduce"][1024][1] == latencies  # summarising keeps the recorded order
    log.append("broadcast", "broadcast", 4.0, 1000)
    assert log.get_operation_names() == ["all_reduce", "broadcast"] and log.get_total_operations() == 4
    assert log.get_raw_data()["broadcast"][1000][2] == [pytest.approx(1000 * 8 / 1e9 / 4e-3)]  # Gbit/s
    log.reset_data()
    assert not log.has_data() and log.get_operation_summary("all_reduce") is None


def test_trimmed_mean_rounds_the_cut_as_deepspeed() -> None:
    from shardwise.comm.comms_logger import trimmed_mean

    data = [1.0] * 13 + [100.0, 100.0]  # 15 values: round(1.5) = 2 cut from each end
    assert trimmed_mean(data, 0.1) == 1.0 and data == [1.0] * 13 + [100.0, 100.0]  # DeepSpeed's; not mutated
    assert trimmed_mean([3.0, 1.0, 2.0], 0.1) == 2.0


def test_coalesced_gather_refuses_mixed_dtypes_before_communicating() -> None:
    from shardwise.comm import torch_api

    with pytest.raises(ValueError, match="one dtype"):
        torch_api.all_gather_coalesced([torch.empty(2), torch.empty(2, dtype=torch.int64)],
                                       [torch.empty(1), torch.empty(1, dtype=torch.int64)])
