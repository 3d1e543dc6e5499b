"""get_accelerator(): DeepSpeed's accelerator interface with DeepSpeed's CPU semantics."""

from __future__ import annotations

import pytest
import torch

from shardwise.compat import accelerator as accelerator_module
from shardwise.compat import cpu_accelerator
from shardwise.compat.accelerator import CpuAccelerator, get_accelerator, is_current_accelerator_supported


@pytest.fixture
def cpu() -> CpuAccelerator:
    return CpuAccelerator()


def test_device_placement_on_cpu(cpu: CpuAccelerator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    cpu.set_device(3)  # a no-op, as DeepSpeed's CPU accelerator
    cpu.synchronize()
    assert (cpu.device_name(), cpu.device_name(1), cpu.current_device_name()) == ("cpu", "cpu", "cpu")
    assert cpu.current_device() == 3 and cpu.device() is None
    assert cpu.communication_backend_name() == "gloo" and cpu.is_available()
    assert cpu.is_synchronized_device() and cpu.use_host_timers()


def test_device_count_is_local_size_else_numa_nodes(cpu: CpuAccelerator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert cpu.device_count() == 4
    monkeypatch.delenv("LOCAL_SIZE")
    assert cpu.device_count() == cpu_accelerator._numa_nodes_with_cores() >= 1


def test_rng_round_trip(cpu: CpuAccelerator) -> None:
    cpu.manual_seed(7)
    state = cpu.get_rng_state()
    first = torch.rand(3)
    cpu.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)
    cpu.manual_seed_all(7)
    assert cpu.initial_seed() == 7 and cpu.default_generator() is torch.default_generator
    assert cpu.random() is torch.random


def test_memory_statistics_follow_resident_memory(cpu: CpuAccelerator) -> None:
    before = cpu.memory_allocated()
    assert before > 0 and cpu.max_memory_allocated() >= before
    block = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched
    assert cpu.max_memory_allocated() >= before + 32 * 1024 * 1024
    del block
    stats = cpu.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"] > 0
    cpu.reset_peak_memory_stats()
    assert cpu.max_memory_reserved() <= cpu.memory_reserved() + 16 * 1024 * 1024
    assert cpu.total_memory() >= cpu.available_memory() > 0
    cpu.empty_cache()


def test_streams_events_and_graphs_are_absent_on_cpu(cpu: CpuAccelerator) -> None:
    assert cpu.Stream is None and cpu.Event is None
    assert cpu.current_stream() is None and cpu.default_stream() is None
    with cpu.stream(None):
        pass
    with cpu.capture_to_graph(cpu.create_graph()):
        pass
    assert cpu.lazy_call(lambda: 5) == 5


def test_dtypes_and_tensors(cpu: CpuAccelerator) -> None:
    fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    assert cpu.is_bf16_supported() and cpu.is_fp16_supported() is fp16
    assert cpu.supported_dtypes() == [torch.float, torch.bfloat16, *([torch.float16] if fp16 else [])]
    t = cpu.FloatTensor([1.5])
    assert t.dtype == torch.float32 and cpu.on_accelerator(t)
    assert cpu.pin_memory(t) is t and not cpu.is_pinned(t)
    assert not cpu.on_accelerator(torch.empty(1, device="meta"))


def test_op_builders_and_environment(cpu: CpuAccelerator) -> None:
    assert cpu.get_op_builder("CPUAdamBuilder")().is_compatible()
    assert cpu.get_op_builder("NoSuchBuilder").NAME == "deepspeed_not_implemented"
    with pytest.raises(NotImplementedError, match="build_extension"):
        cpu.build_extension()
    env: dict[str, str] = {}
    cpu.set_visible_devices_envs(env, [0, 2])
    assert env == {"CUDA_VISIBLE_DEVICES": "0,2"}
    with pytest.raises(ValueError, match=r"no_such_backend.*not a torch\.compile backend"):
        cpu.set_compile_backend("no_such_backend")


def test_get_accelerator_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accelerator_module, "_ACCELERATOR", None)
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ValueError, match="DS_ACCELERATOR='xpu'"):
        get_accelerator()
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert get_accelerator()._name == "cpu" and get_accelerator() is get_accelerator()
    assert is_current_accelerator_supported()


def test_cuda_accelerator_names() -> None:
    """What needs no GPU: the names and backend DeepSpeed's CUDA accelerator reports."""
    from shardwise.compat.cuda_accelerator import CudaAccelerator

    cuda = CudaAccelerator()
    assert (cuda.device_name(), cuda.device_name(1)) == ("cuda", "cuda:1")
    assert cuda.communication_backend_name() == "nccl" and not cuda.is_synchronized_device()
    assert cuda.export_envs() == ["NCCL"] and cuda.is_fp16_supported()
    assert cuda.FloatTensor.keywords == {"dtype": torch.float, "device": "cuda"}
