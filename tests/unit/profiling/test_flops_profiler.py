"""The flops profiler against analytic counts: Linear stacks, convolutions, a GPT with attention."""

from __future__ import annotations

import itertools
import logging
import re

import pytest
import torch
from torch import nn

from shardwise.profiling.flops_profiler import FlopsProfiler, format_count, format_time, get_model_profile
from shardwise.testing.models import GPTConfig, TinyGPT
from shardwise.utils.logging import get_logger

B, A, H, C, D = 5, 12, 24, 10, 3


def _stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(A, H), nn.ReLU(), nn.Linear(H, C), nn.Sequential(nn.Linear(C, D), nn.Tanh())
    )


def _linear_flops(batch: int, *dims: int) -> int:
    """2 flops (a multiply and an add) per MAC; a Linear(i, o) on ``batch`` rows is batch*i*o MACs."""
    return sum(2 * batch * i * o for i, o in itertools.pairwise(dims))


def _profile(model: nn.Module, *args, **kwargs) -> FlopsProfiler:
    prof = FlopsProfiler(model)
    prof.start_profile(**kwargs)
    model(*args)
    prof.stop_profile()
    return prof


def test_linear_stack_total_matches_the_analytic_count_exactly():
    model = _stack()
    prof = _profile(model, torch.randn(B, A))
    expected = _linear_flops(B, A, H, C, D)
    assert prof.get_total_flops() == expected
    assert prof.get_total_macs() == expected // 2
    assert prof.get_total_params() == A * H + H + H * C + C + C * D + D
    per_module = {s.name: s.flops for s in prof.module_table()}
    assert per_module == {
        "(model)": expected,
        "0": 2 * B * A * H,
        "1": 0,  # element-wise work is not counted
        "2": 2 * B * H * C,
        "3": 2 * B * C * D,
        "3.0": 2 * B * C * D,
        "3.1": 0,
    }
    assert {s.name: s.depth for s in prof.module_table()} == {
        "(model)": 0, "0": 1, "1": 1, "2": 1, "3": 1, "3.0": 2, "3.1": 2,
    }  # fmt: skip
    assert [s.name for s in prof.module_table(module_depth=1)] == ["(model)", "0", "1", "2", "3"]
    root = prof.stats["(model)"]
    assert root.calls == 1 and root.latency_s > 0
    assert all(s.latency_s <= root.latency_s for s in prof.module_table())


def test_only_forwards_count_and_calls_accumulate():
    model = _stack()
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randn(B, A, requires_grad=True)).sum().backward()  # the backward is not counted
    model(torch.randn(2 * B, A))
    prof.stop_profile()
    assert prof.get_total_flops() == _linear_flops(B, A, H, C, D) + _linear_flops(2 * B, A, H, C, D)
    assert prof.stats["0"].calls == 2
    model(torch.randn(B, A))  # hooks are gone: nothing more is counted
    assert prof.get_total_flops() == 3 * _linear_flops(B, A, H, C, D)
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == 0
    prof.start_profile()
    prof.reset_profile()
    assert prof.get_total_flops() == 0
    prof.end_profile()
    assert prof.stats == {}


class _Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.layer(x))


def test_a_module_called_twice_is_charged_twice():
    prof = _profile(_Shared(), torch.randn(4, 6))
    assert prof.stats["layer"].calls == 2
    assert prof.stats["layer"].flops == prof.get_total_flops() == 2 * 2 * 4 * 6 * 6
    assert prof.get_total_params() == 6 * 6 + 6


def test_conv2d_analytic_count_and_ignored_modules():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, kernel_size=3, padding=1), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    x = torch.randn(2, 3, 6, 6)
    conv = 2 * 2 * 8 * 6 * 6 * 3 * 3 * 3  # 2 x batch x out channels x output pixels x (in channels x k x k)
    linear = 2 * 2 * (8 * 6 * 6) * 4
    assert _profile(model, x).get_total_flops() == conv + linear
    ignored = _profile(model, x, ignore_list=[nn.Conv2d])
    assert ignored.get_total_flops() == linear and "0" not in ignored.stats


def test_gpt_counts_attention_on_cpu():
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    batch, t, c, v = 3, 16, cfg.n_embd, cfg.vocab_size
    idx = torch.randint(0, v, (batch, t))
    prof = _profile(model, idx)
    rows = batch * t
    per_block = (
        2 * rows * c * 3 * c  # qkv projection
        + 2 * rows * c * c  # output projection
        + 2 * (2 * batch * t * t * c)  # q @ k^T and scores @ v over all heads (causal mask not discounted)
        + 2 * 2 * rows * c * 4 * c  # the MLP's two Linear layers
    )
    expected = cfg.n_layer * per_block + 2 * rows * c * v  # + the LM head
    assert prof.get_total_flops() == expected
    attention = prof.stats["blocks.0.attn"].flops
    assert attention == 2 * rows * c * 3 * c + 2 * rows * c * c + 4 * batch * t * t * c
    assert prof.get_total_params() == sum(p.numel() for p in model.parameters())  # tied weights once


def test_get_model_profile_returns_and_writes_the_report(tmp_path):
    model = _stack()
    path = tmp_path / "profile.txt"
    flops, macs, params = get_model_profile(
        model, input_shape=(B, A), output_file=str(path), module_depth=1, top_modules=2, as_string=False
    )
    expected = _linear_flops(B, A, H, C, D)
    assert (flops, macs, params) == (expected, expected // 2, A * H + H + H * C + C + C * D + D)
    text = path.read_text()
    assert re.search(rf"fwd flops per rank:\s+{re.escape(format_count(expected))}\n", text)
    table = text.split("per-module profile")[1].splitlines()[2:]
    assert [line.split()[0] for line in table] == ["Sequential", "0", "1", "2", "3"]  # depth <= 1
    first_linear = next(line for line in table if line.split()[0] == "0")
    assert f"{100 * 2 * B * A * H / expected:.2f}%" in first_linear  # share of total flops
    assert "depth 1:" in text and "depth 2:" not in text
    as_text = get_model_profile(model, args=[torch.randn(B, A)], print_profile=False)
    assert as_text == (format_count(expected), format_count(expected // 2, "MACs"), format_count(params))


def test_report_goes_to_the_log_without_output_file(caplog):
    get_logger().addHandler(caplog.handler)
    try:
        get_model_profile(nn.Linear(4, 4), args=[torch.randn(2, 4)], detailed=False)
    finally:
        get_logger().removeHandler(caplog.handler)
    (record,) = caplog.records
    assert record.levelno == logging.INFO and "fwd flops per rank:" in record.getMessage()
    assert "per-module profile" not in record.getMessage()


def test_recompute_factor_and_engine_context_in_the_summary():
    prof = FlopsProfiler(nn.Linear(4, 4), recompute_fwd_factor=1.0)
    prof.start_profile()
    prof.model(torch.randn(2, 4))
    prof.stop_profile()
    text = prof.format_profile(
        profile_step=3,
        context={"world_size": 2, "dp_size": 2, "mp_size": 1, "batch_size": 2, "bwd_latency_s": 0.002,
                 "step_latency_s": 0.001},
    )  # fmt: skip
    assert "Profile summary at step 3" in text and "bwd flops = 3 x fwd flops" in text
    flops = 2 * 2 * 4 * 4
    assert re.search(
        rf"bwd FLOPS per rank = 3 x fwd flops / bwd latency:\s+{re.escape(format_count(3 * flops / 0.002, 'FLOPS'))}",
        text,
    )
    assert re.search(r"data parallel size:\s+2\n", text) and "iter latency" in text


def test_a_forward_that_raises_leaves_no_profiling_behind():
    class Boom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.lin(x)
            raise RuntimeError("boom")

    model = Boom()
    prof = FlopsProfiler(model)
    prof.start_profile()
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(2, 3))
    prof.stop_profile()
    # the dispatch mode was left: a new profile of another model counts from zero
    assert _profile(_stack(), torch.randn(B, A)).get_total_flops() == _linear_flops(B, A, H, C, D)


def test_argument_errors_and_formatting():
    with pytest.raises(ValueError, match="input_shape"):
        get_model_profile(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="mode"):
        get_model_profile(nn.Linear(2, 2), input_shape=(1, 2), mode="backward")
    assert format_time(1.5) == "1.5 s" and format_time(0.0015) == "1.5 ms" and format_time(1.5e-6) == "1.5 us"
    assert format_count(2_500_000, "FLOPS") == "2.5 MFLOPS"
