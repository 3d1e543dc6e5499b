"""deepspeed.comm / deepspeed.utils / deepspeed.utils.groups / deepspeed.runtime.utils names added to the
compatibility package: where they resolve, the pure helpers' answers (DeepSpeed 0.19.8's for the same
inputs), and the refusals."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator

import pytest
import torch
from deepspeed_install import installed_deepspeed

from shardwise.compat import bwc, ds_utils, tensor_fragment, unavailable
from shardwise.compat.small_names import DeprecatedException, OnDevice
from shardwise.profiling.nvtx import instrument_w_nvtx
from shardwise.utils import logging as sw_logging


class Megatron:
    def get_tensor_model_parallel_rank(self) -> int: return 1
    def get_tensor_model_parallel_world_size(self) -> int: return 4
    def get_pipeline_model_parallel_world_size(self) -> int: return 3


class DeepSpeedTopology:
    def get_slice_parallel_rank(self) -> int: return 2
    def get_slice_parallel_world_size(self) -> int: return 2
    def get_pipe_parallel_world_size(self) -> int: return 5


class OldMpu:
    def get_model_parallel_rank(self) -> int: return 7
    def get_model_parallel_world_size(self) -> int: return 8


def test_bwc_reads_every_mpu_vintage() -> None:
    answers = [(bwc.bwc_tensor_model_parallel_rank(m), bwc.bwc_tensor_model_parallel_world_size(m),
                bwc.bwc_pipeline_parallel_world_size(m)) for m in (Megatron(), DeepSpeedTopology(), OldMpu(), None)]
    assert answers == [(1, 4, 3), (2, 2, 5), (7, 8, 1), (0, 1, 1)]
    assert bwc.bwc_pipeline_parallel_group(None) is None
    with pytest.raises(AttributeError, match="pipeline-parallel group"):
        bwc.bwc_pipeline_parallel_group(OldMpu())


def test_recursive_attributes_and_nvtx() -> None:
    net = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(1, 1)))
    ds_utils.recursive_setattr(net, "0.0", torch.nn.ReLU())
    assert isinstance(ds_utils.recursive_getattr(net, "0.0"), torch.nn.ReLU)

    @instrument_w_nvtx
    def add(a: int, b: int) -> int:
        return a + b

    assert add(2, 3) == 5 and add.__qualname__.endswith("add")


def test_log_dist_rank_rule(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert sw_logging.dist_message("hi") == sw_logging.dist_message("hi", ranks=[0]) == "[Rank -1] hi"  # DeepSpeed's
    monkeypatch.setenv("RANK", "1")
    assert sw_logging.dist_message("hi") is None and sw_logging.dist_message("hi", ranks=[0]) is None
    assert sw_logging.dist_message("hi", ranks=[1]) == sw_logging.dist_message("hi", ranks=[-1]) == "[Rank 1] hi"
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    sw_logging.logger.addHandler(handler)
    level = sw_logging.logger.level
    sw_logging.logger.setLevel(logging.INFO)
    try:
        sw_logging.log_dist("shown", ranks=[1])
        sw_logging.log_dist("hidden", ranks=[0])
        sw_logging.log_dist_once("once", ranks=[1])
        sw_logging.log_dist_once("once", ranks=[1])
    finally:
        sw_logging.logger.removeHandler(handler)
        sw_logging.logger.setLevel(level)
    assert seen == ["[Rank 1] shown", "[Rank 1] once"]


def test_update_full_grad_on_parameters_holding_their_gradient() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, 2.0, 3.0])
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    tensor_fragment.safe_update_full_grad_vectorized([p, frozen], lambda grad, param: grad * 2 + param)
    assert p.grad.tolist() == [3.0, 5.0, 7.0] and frozen.grad is None


def test_refusals_name_the_deepspeed_name_and_the_way() -> None:
    with pytest.raises(unavailable.UnavailableDeepSpeedName, match=r"deepspeed.comm.initialize_mesh_device.*ensure_layout"):
        unavailable.initialize_mesh_device((2,), ("dp",))
    with pytest.raises(unavailable.UnavailableDeepSpeedName, match=r"set_tensor_model_parallel_world_size.*mesh"):
        unavailable.set_tensor_model_parallel_world_size(2)
    with pytest.raises(unavailable.UnavailableDeepSpeedName, match=r"TorchBackend.*init_distributed"):
        unavailable.TorchBackend("gloo", None, None, 0, 1)


@pytest.fixture(scope="module")
def deepspeed_package(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    with installed_deepspeed(tmp_path_factory.mktemp("ds")) as package:  # once for the module's tests
        yield package


def test_names_resolve_to_shardwise_objects(deepspeed_package: object) -> None:
    from shardwise.comm import comms_logger, object_api, op_logging, point_to_point, torch_api
    from shardwise.compat import runtime_utils
    from shardwise.precision import tensor_norms
    from shardwise.profiling import named_timers
    from shardwise.runtime import script_helpers

    expected = {
        "deepspeed.comm": {"all_to_all": torch_api.all_to_all, "P2POp": point_to_point.P2POp,
                           "all_gather_object": object_api.all_gather_object, "timed_op": op_logging.timed_op,
                           "ProcessGroup": torch.distributed.ProcessGroup, "NCCL_BACKEND": "nccl",
                           "set_backend": unavailable.set_backend},
        "deepspeed.comm.comm": {"gather": torch_api.gather},
        "deepspeed.comm.utils": {"get_msg_size_from_args": op_logging.get_msg_size_from_args},
        "deepspeed.comm.reduce_op": {"ReduceOp": torch.distributed.ReduceOp},
        "deepspeed.utils": {"OnDevice": OnDevice, "get_full_hp_param": tensor_fragment.get_full_hp_param,
                            "instrument_w_nvtx": instrument_w_nvtx, "log_dist": sw_logging.log_dist,
                            "recursive_getattr": ds_utils.recursive_getattr,
                            "bwc_tensor_model_parallel_world_size": bwc.bwc_tensor_model_parallel_world_size,
                            "DeprecatedException": DeprecatedException, "get_caller_func": op_logging.get_caller_func},
        "deepspeed.utils.init_on_device": {"OnDevice": OnDevice},
        "deepspeed.utils.timer": {"SynchronizedWallClockTimer": named_timers.SynchronizedWallClockTimer,
                                  "trim_mean": comms_logger.trimmed_mean},
        "deepspeed.utils.groups": {"log_dist": sw_logging.log_dist,
                                   "set_tensor_model_parallel_rank": unavailable.set_tensor_model_parallel_rank},
        "deepspeed.runtime.utils": {"clip_tensors_by_global_norm": tensor_norms.clip_tensors_by_global_norm,
                                    "set_random_seed": script_helpers.set_random_seed,
                                    "memory_status": runtime_utils.memory_status,
                                    "CheckOverflow": unavailable.CheckOverflow},
    }
    for path, names in expected.items():
        module = importlib.import_module(path)
        for name, value in names.items():
            assert getattr(module, name) == value, f"{path}.{name}"
    assert importlib.import_module("deepspeed.utils").dist.get_rank is importlib.import_module("shardwise.comm").get_rank


def test_on_device_builds_on_meta() -> None:
    with OnDevice(dtype=torch.float16, device="meta"):
        layer = torch.nn.Linear(4, 2)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.float16
    assert torch.get_default_dtype() == torch.float32
