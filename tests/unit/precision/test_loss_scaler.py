"""fp16 loss scaling (spec section 5) and gradient overflow detection.

Step indexing used throughout: a "step" is one call of ``update_scale``, numbered from 0 by the
scaler's ``cur_iter`` *before* the call. ``_trace`` returns the value *after* each step. Read that
way, the spec's traces ("overflows at steps 1, 2, 3" with ten scale values) are the scale after
steps 0..9. The spec's lists also fit a second reading: the first value is the initial scale,
then steps are numbered from 1 (so overflows at cur_iter 0, 1, 2). Both readings give the same
sequences, and both are checked, so the traces pin the algorithm whichever was meant.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardwise.config.errors import ConfigError
from shardwise.precision.loss_scaler import (
    DynamicLossScaler,
    LossScaleAtMinimumError,
    LossScaler,
    NoOpLossScaler,
    StaticLossScaler,
    build_loss_scaler,
)
from shardwise.precision.overflow import all_reduce_overflow, has_inf_or_nan, overflow_flag
from shardwise.utils.logging import logger

pytestmark = pytest.mark.numeric


def _trace(scaler: LossScaler, steps: int, overflow_at: set[int]) -> tuple[list[float], list[int]]:
    """Run ``steps`` updates; step ``i`` (the scaler's cur_iter before it) overflows if i in overflow_at."""
    scales, hysteresis = [], []
    for step in range(steps):
        assert scaler.cur_iter == step
        scaler.update_scale(step in overflow_at)
        scales.append(scaler.cur_scale)
        hysteresis.append(scaler.cur_hysteresis)
    return scales, hysteresis


def _trace_with_initial(scaler: LossScaler, steps: int, overflow_at_1based: set[int]) -> list[float]:
    """The second reading: initial scale first, then steps numbered from 1."""
    scales = [scaler.cur_scale]
    for step in range(1, steps):
        scaler.update_scale(step in overflow_at_1based)
        scales.append(scaler.cur_scale)
    return scales


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


@pytest.fixture
def logs() -> Iterator[_Capture]:
    handler = _Capture()
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


# ---------------------------------------------------------------- spec 5.1 traces


def test_trace_window3_hysteresis2_overflows_at_1_2_3() -> None:
    scaler = DynamicLossScaler(initial_scale_power=4, loss_scale_window=3, hysteresis=2)
    scales, hysteresis = _trace(scaler, 10, {1, 2, 3})
    assert scales == [16, 16, 8, 4, 4, 4, 4, 8, 8, 8]
    # 16 (hyst -> 1) at step 1, and the budget is refilled to 2 when the scale doubles at step 7.
    assert hysteresis == [2, 1, 1, 1, 1, 1, 1, 2, 2, 2]
    assert scaler.last_overflow_iter == 3
    assert scaler.cur_iter == 10


def test_trace_window3_hysteresis2_second_reading() -> None:
    scaler = DynamicLossScaler(initial_scale_power=4, loss_scale_window=3, hysteresis=2)
    assert _trace_with_initial(scaler, 10, {1, 2, 3}) == [16, 16, 8, 4, 4, 4, 4, 8, 8, 8]


@pytest.mark.parametrize("window", [1, 3, 1000])
def test_trace_consecutive_hysteresis3(window: int) -> None:
    # The spec gives no window for this trace; no clean step here is past a full window
    # (each comes right after an overflow), so any window must give the same sequences.
    scaler = DynamicLossScaler(
        initial_scale_power=4, loss_scale_window=window, hysteresis=3, consecutive_hysteresis=True
    )
    scales, hysteresis = _trace(scaler, 9, {1, 2, 4, 5, 6, 7})
    assert hysteresis == [3, 2, 1, 3, 2, 1, 1, 1, 3]
    assert scales == [16, 16, 16, 16, 16, 16, 8, 4, 4]


def test_trace_consecutive_hysteresis3_second_reading() -> None:
    scaler = DynamicLossScaler(initial_scale_power=4, hysteresis=3, consecutive_hysteresis=True)
    hysteresis = [scaler.cur_hysteresis]
    scales = [scaler.cur_scale]
    for step in range(1, 9):
        scaler.update_scale(step in {1, 2, 4, 5, 6, 7})
        hysteresis.append(scaler.cur_hysteresis)
        scales.append(scaler.cur_scale)
    assert hysteresis == [3, 2, 1, 3, 2, 1, 1, 1, 3]
    assert scales == [16, 16, 16, 16, 16, 16, 8, 4, 4]


def test_non_consecutive_hysteresis_is_not_refilled_by_clean_steps() -> None:
    # Same overflow pattern without consecutive_hysteresis: the clean step 3 does not refill,
    # so the overflow at step 4 already halves.
    scaler = DynamicLossScaler(initial_scale_power=4, loss_scale_window=1000, hysteresis=3)
    scales, hysteresis = _trace(scaler, 9, {1, 2, 4, 5, 6, 7})
    assert hysteresis == [3, 2, 1, 1, 1, 1, 1, 1, 1]
    assert scales == [16, 16, 16, 16, 8, 4, 2, 1, 1]


def test_min_scale_overflow_raises_and_leaves_state() -> None:
    scaler = DynamicLossScaler(initial_scale_power=3, min_loss_scale=4, hysteresis=1)
    scaler.update_scale(True)
    assert scaler.cur_scale == 4
    with pytest.raises(LossScaleAtMinimumError) as info:
        scaler.update_scale(True)
    err = info.value
    assert isinstance(err, RuntimeError)
    assert (err.scale, err.min_loss_scale, err.iteration) == (4, 4, 1)
    text = str(err)
    for needle in ("minimum", "learning rate", "bf16", "fp16.min_loss_scale", "inf/NaN"):
        assert needle in text
    # The failing step changed nothing.
    assert (scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter) == (4, 1, 0)


def test_min_scale_raises_only_once_hysteresis_is_spent() -> None:
    scaler = DynamicLossScaler(initial_scale_power=2, min_loss_scale=4, hysteresis=2)
    scaler.update_scale(True)  # budget 2 -> 1, scale stays 4
    assert (scaler.cur_scale, scaler.cur_hysteresis) == (4, 1)
    with pytest.raises(LossScaleAtMinimumError):
        scaler.update_scale(True)


def test_halving_clamps_at_a_non_power_of_two_minimum() -> None:
    scaler = DynamicLossScaler(initial_scale_power=3, min_loss_scale=3, hysteresis=1)
    scaler.update_scale(True)
    assert scaler.cur_scale == 4
    scaler.update_scale(True)
    assert scaler.cur_scale == 3
    with pytest.raises(LossScaleAtMinimumError):
        scaler.update_scale(True)


def test_scale_doubles_every_window_without_overflow() -> None:
    # Spec 5.1: with window 1000 and no overflow the scale doubles at cur_iter 1000, 2000, ...
    scaler = DynamicLossScaler(initial_scale_power=16, loss_scale_window=1000)
    doubled_at = []
    for _ in range(2001):
        before = scaler.cur_scale
        step = scaler.cur_iter
        scaler.update_scale(False)
        if scaler.cur_scale != before:
            assert scaler.cur_scale == 2 * before
            doubled_at.append(step)
    assert doubled_at == [1000, 2000]
    assert scaler.cur_scale == 2.0**18


# ---------------------------------------------------------------- spec 5.2 (stage-0-like option)


def test_stage0_trace_with_hysteresis1_and_clamping() -> None:
    # Spec 5.2: initial 16, window 3, overflows at steps 1, 2, 3 -> 16, 8, 4, 2, 2, 2, 2, 4, 4, 4
    # (step indexing as in the module docstring: scale after steps 0..9). Hysteresis 1 makes
    # every overflow halve at once, which is exactly DeepSpeed's stage-0 scaler.
    scaler = DynamicLossScaler(
        initial_scale_power=4, loss_scale_window=3, hysteresis=1, raise_error_at_min_scale=False
    )
    scales, hysteresis = _trace(scaler, 10, {1, 2, 3})
    assert scales == [16, 8, 4, 2, 2, 2, 2, 4, 4, 4]
    assert set(hysteresis) == {1}
    second = DynamicLossScaler(
        initial_scale_power=4, loss_scale_window=3, hysteresis=1, raise_error_at_min_scale=False
    )
    assert _trace_with_initial(second, 10, {1, 2, 3}) == [16, 8, 4, 2, 2, 2, 2, 4, 4, 4]


def test_clamped_at_minimum_without_exception() -> None:
    # Spec 5.2: "min 4: 4, 4, 4, ..., with no exception".
    scaler = DynamicLossScaler(
        initial_scale_power=2, min_loss_scale=4, hysteresis=1, raise_error_at_min_scale=False
    )
    scales, _ = _trace(scaler, 6, set(range(6)))
    assert scales == [4] * 6
    assert scaler.last_overflow_iter == 5


# ---------------------------------------------------------------- static and no-op


def test_static_scaler_never_changes() -> None:
    scaler = StaticLossScaler(128)
    assert not scaler.dynamic
    scales, _ = _trace(scaler, 6, {0, 2, 3})
    assert scales == [128.0] * 6
    assert (scaler.cur_iter, scaler.last_overflow_iter) == (6, 3)
    assert scaler.scale_loss(torch.tensor(2.0)).item() == 256.0
    assert scaler.loss_scale == 128.0


def test_noop_scaler() -> None:
    scaler = NoOpLossScaler()
    loss = torch.tensor(3.0)
    assert scaler.scale_loss(loss) is loss
    scaler.update_scale(False)
    scaler.update_scale(True)
    assert (scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter) == (1.0, 2, 1)


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True, "8"])
def test_static_scale_must_be_positive_finite(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        StaticLossScaler(bad)  # type: ignore[arg-type]
    assert info.value.key == "fp16.loss_scale"


# ---------------------------------------------------------------- factory and validation


def test_factory_chooses_by_precision_and_loss_scale() -> None:
    assert isinstance(build_loss_scaler(False, loss_scale=-5, min_loss_scale=0), NoOpLossScaler)
    # A static config with min_loss_scale 0 is accepted (seen in real configs; DeepSpeed accepts it).
    static = build_loss_scaler(True, loss_scale=512, min_loss_scale=0, loss_scale_window=0)
    assert isinstance(static, StaticLossScaler)
    assert static.cur_scale == 512.0
    dynamic = build_loss_scaler(True, 0, 12, 500, 3, True, 2)
    assert isinstance(dynamic, DynamicLossScaler)
    assert dynamic.cur_scale == 4096.0
    assert (dynamic.loss_scale_window, dynamic.hysteresis, dynamic.cur_hysteresis) == (500, 3, 3)
    assert dynamic.consecutive_hysteresis and dynamic.min_loss_scale == 2.0
    assert dynamic.raise_error_at_min_scale
    assert not build_loss_scaler(True, raise_error_at_min_scale=False).raise_error_at_min_scale  # type: ignore[attr-defined]
    defaults = build_loss_scaler(True)
    assert isinstance(defaults, DynamicLossScaler)
    assert (defaults.cur_scale, defaults.loss_scale_window, defaults.hysteresis) == (65536.0, 1000, 2)
    assert (defaults.cur_iter, defaults.last_overflow_iter) == (0, -1)


@pytest.mark.parametrize("bad", [-1, math.inf, math.nan, True, "0"])
def test_factory_rejects_bad_loss_scale(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        build_loss_scaler(True, loss_scale=bad)  # type: ignore[arg-type]
    assert info.value.key == "fp16.loss_scale"


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"loss_scale_window": 0}, "fp16.loss_scale_window"),
        ({"loss_scale_window": True}, "fp16.loss_scale_window"),
        ({"loss_scale_window": 2.5}, "fp16.loss_scale_window"),
        ({"hysteresis": 0}, "fp16.hysteresis"),
        ({"min_loss_scale": 0}, "fp16.min_loss_scale"),
        ({"min_loss_scale": -1}, "fp16.min_loss_scale"),
        ({"initial_scale_power": 200}, "fp16.initial_scale_power"),
        ({"initial_scale_power": 1, "min_loss_scale": 4}, "fp16.initial_scale_power"),
        ({"consecutive_hysteresis": "yes"}, "fp16.consecutive_hysteresis"),
    ],
)
def test_dynamic_settings_are_validated(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        DynamicLossScaler(**kwargs)  # type: ignore[arg-type]
    assert info.value.key == key
    assert isinstance(info.value, ValueError)


# ---------------------------------------------------------------- state dicts


def _run_pattern(scaler: LossScaler, pattern: list[bool]) -> list[tuple[float, int, int, int]]:
    out = []
    for overflow in pattern:
        scaler.update_scale(overflow)
        out.append((scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter, scaler.cur_hysteresis))
    return out


_PATTERN = [False, True, False, True, True, False, False, False, False, True, False, False, False, False]


@pytest.mark.parametrize(
    "make",
    [
        lambda: DynamicLossScaler(initial_scale_power=10, loss_scale_window=2, hysteresis=2),
        lambda: DynamicLossScaler(
            initial_scale_power=10, loss_scale_window=3, hysteresis=3, consecutive_hysteresis=True
        ),
        lambda: StaticLossScaler(64),
        NoOpLossScaler,
    ],
)
def test_state_dict_round_trips_through_json(make: Callable[[], LossScaler]) -> None:
    original = make()
    _run_pattern(original, _PATTERN[:7])
    saved = original.state_dict()
    text = json.dumps(saved, allow_nan=False)  # plain, strict JSON
    restored = make()
    restored.load_state_dict(json.loads(text))
    assert restored.state_dict() == saved
    # Both continue identically.
    assert _run_pattern(restored, _PATTERN[7:]) == _run_pattern(original, _PATTERN[7:])


def test_dynamic_state_dict_contents() -> None:
    scaler = DynamicLossScaler(initial_scale_power=4, loss_scale_window=3, hysteresis=2)
    _trace(scaler, 3, {1, 2})
    assert scaler.state_dict() == {
        "kind": "dynamic",
        "cur_scale": 8.0,
        "cur_iter": 3,
        "last_overflow_iter": 2,
        "cur_hysteresis": 1,
        "initial_scale_power": 4,
        "loss_scale_window": 3,
        "hysteresis": 2,
        "consecutive_hysteresis": False,
        "min_loss_scale": 1.0,
        "raise_error_at_min_scale": True,
    }


def test_load_keeps_config_settings_and_clamps_state(logs: _Capture) -> None:
    old = DynamicLossScaler(initial_scale_power=4, loss_scale_window=3, hysteresis=3, min_loss_scale=1)
    _trace(old, 5, {0, 1, 2, 3})  # 16 -> (h 2) -> (h 1) -> 8 -> 4
    assert (old.cur_scale, old.cur_hysteresis) == (4, 1)
    new = DynamicLossScaler(initial_scale_power=4, loss_scale_window=5, hysteresis=2, min_loss_scale=8)
    new.load_state_dict(old.state_dict())
    assert (new.loss_scale_window, new.hysteresis, new.min_loss_scale) == (5, 2, 8.0)
    assert new.cur_scale == 8.0  # the checkpoint's 4 is below the new minimum
    assert (new.cur_iter, new.last_overflow_iter, new.cur_hysteresis) == (5, 3, 1)
    warnings = " ".join(logs.messages(logging.WARNING))
    assert "loss_scale_window 3 -> 5" in warnings
    assert "below min_loss_scale" in warnings


def test_load_from_another_kind_restores_only_counters(logs: _Capture) -> None:
    fp16 = DynamicLossScaler(initial_scale_power=4)
    _trace(fp16, 4, {1})
    bf16 = NoOpLossScaler()
    bf16.load_state_dict(fp16.state_dict())
    assert (bf16.cur_scale, bf16.cur_iter, bf16.last_overflow_iter) == (1.0, 4, 1)
    back = DynamicLossScaler(initial_scale_power=5)
    back.load_state_dict(StaticLossScaler(7).state_dict())
    assert back.cur_scale == 32.0
    assert len(logs.messages(logging.WARNING)) == 2


def test_load_rejects_incomplete_state() -> None:
    with pytest.raises(ValueError, match="missing"):
        DynamicLossScaler().load_state_dict({"cur_scale": 4.0})


# ---------------------------------------------------------------- log lines


def test_log_lines_on_overflow_and_scale_changes(logs: _Capture) -> None:
    scaler = DynamicLossScaler(initial_scale_power=4, loss_scale_window=3, hysteresis=2)
    _trace(scaler, 10, {1, 2, 3})
    info = logs.messages(logging.INFO)
    assert len(info) == 4
    assert "iteration 1" in info[0] and "hysteresis 2 -> 1" in info[0]
    assert "16 -> 8" in info[1]
    assert "8 -> 4" in info[2]
    assert "No fp16 gradient overflow for 3 iterations" in info[3] and "4 -> 8" in info[3]


def test_consecutive_restore_is_logged_only_when_it_changes(logs: _Capture) -> None:
    scaler = DynamicLossScaler(initial_scale_power=4, hysteresis=2, consecutive_hysteresis=True)
    _trace(scaler, 5, {1})
    restores = [m for m in logs.messages(logging.INFO) if "restored" in m]
    assert len(restores) == 1


# ---------------------------------------------------------------- overflow detection


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, None])
def test_has_inf_or_nan(dtype: torch.dtype, bad: float | None) -> None:
    tensors = [torch.randn(7, 3).to(dtype), torch.randn(100).to(dtype), torch.randn(5).to(dtype)]
    if bad is not None:
        tensors[1][42] = bad
    assert has_inf_or_nan(tensors) is (bad is not None)


def test_has_inf_or_nan_edge_cases() -> None:
    assert has_inf_or_nan([]) is False
    assert overflow_flag([]) is None
    # Large but finite fp16 values are not an overflow (a sum in fp16 would say they are).
    assert has_inf_or_nan([torch.full((1000,), 65504.0, dtype=torch.float16)]) is False
    # Empty and integer tensors are skipped; mixed dtypes are handled.
    mixed = [torch.empty(0), torch.arange(5), torch.ones(4, dtype=torch.float16), torch.ones(3)]
    assert has_inf_or_nan(mixed) is False
    mixed[3][1] = math.nan
    assert has_inf_or_nan(mixed) is True
    # Complex gradients: a NaN in the imaginary part counts.
    z = torch.zeros(4, dtype=torch.complex64)
    assert has_inf_or_nan([z]) is False
    z[2] = torch.tensor(complex(0.0, math.nan))
    assert has_inf_or_nan([z]) is True
    # Works on gradients that require grad, and on a generator.
    p = torch.ones(3, requires_grad=True)
    assert has_inf_or_nan(t for t in [p]) is False


def test_overflow_flag_is_an_unsynced_bool_tensor() -> None:
    flag = overflow_flag([torch.tensor([1.0, math.inf])])
    assert isinstance(flag, torch.Tensor)
    assert flag.dtype == torch.bool and flag.dim() == 0 and bool(flag)


# ---------------------------------------------------------------- all-reduce


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _pin_loopback() -> None:
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def test_all_reduce_without_process_group_returns_local_flag() -> None:
    assert not dist.is_initialized()
    assert all_reduce_overflow(True) is True
    assert all_reduce_overflow(False) is False
    assert all_reduce_overflow(None) is False
    assert all_reduce_overflow(torch.tensor(True)) is True


def test_all_reduce_on_single_rank_gloo_group(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.path.exists("/sys/class/net/lo"):
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        assert all_reduce_overflow(True) is True
        assert all_reduce_overflow(False) is False
        assert all_reduce_overflow(None, group=None) is False
        flag = overflow_flag([torch.tensor([1.0, math.nan])])
        assert flag is not None
        assert all_reduce_overflow(flag) is True
        assert bool(flag)  # the caller's tensor is untouched
        clean = overflow_flag([torch.ones(3)])
        assert clean is not None
        subgroup = dist.new_group([0], backend="gloo")
        assert all_reduce_overflow(clean, group=subgroup) is False
        float_flag = torch.tensor(1.0)
        assert all_reduce_overflow(float_flag, group=subgroup) is True
        assert float_flag.item() == 1.0
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


def _two_rank_worker(rank: int, port: int) -> None:
    # Runs in a spawned process: a failed assert here makes mp.spawn raise in the test.
    _pin_loopback()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        grads = [torch.ones(8)]
        if rank == 1:
            grads[0][3] = math.inf
        assert all_reduce_overflow(rank == 1) is True  # only rank 1 overflows: both must skip
        assert all_reduce_overflow(False) is False
        assert all_reduce_overflow(overflow_flag(grads)) is True
        assert all_reduce_overflow(overflow_flag([torch.ones(2)])) is False
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_all_reduce_is_max_across_two_gloo_ranks() -> None:
    mp.spawn(_two_rank_worker, args=(_free_port(),), nprocs=2, join=True)
