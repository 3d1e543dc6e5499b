"""``shardwise.compilation`` in one process: what is compiled, the checks before compiling, the
``compile`` section's keys that act, and the refusals. The engine at stages 0-3 on 2 ranks:
tests/distributed/test_compile_blocks.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import shardwise
from shardwise.compilation import ModelCompiler, plan_compile
from shardwise.compilation.compiler import DEEPCOMPILE_NOT_COMPILED
from shardwise.config import ConfigError, load_config
from shardwise.config.sections.features import CompileConfig
from shardwise.moe.experts import Experts
from shardwise.moe.layer import MOELayer, TopKGate
from shardwise.testing.models import GPTConfig, TinyGPT
from shardwise.utils.logging import logger

SMALL = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


@pytest.fixture
def logged() -> Iterator[list[tuple[int, str]]]:
    records: list[tuple[int, str]] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append((record.levelno, record.getMessage()))

    handler = _Keep(level=logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class _MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.moe = MOELayer(TopKGate(8, 2, min_capacity=16), Experts(nn.Linear(8, 8), 2), "ep_size_1", 1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class _OwnCompile(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2))
        self.called_with: dict | None = None

    def compile(self, *args: object, **kwargs: object) -> None:
        self.called_with = dict(kwargs)


def test_the_blocks_are_the_repeated_transformer_blocks() -> None:
    plan = plan_compile(TinyGPT(SMALL))
    assert plan.targets == ["blocks.0", "blocks.1"] and not plan.whole_module


def test_without_a_repeated_block_the_whole_forward_compiles_and_says_so(logged) -> None:
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))  # repeated bare Linears: no block
    x = torch.randn(3, 4)
    expected = mlp(x)
    compiler = ModelCompiler(CompileConfig())
    compiler.compile(mlp, backend="eager")
    assert compiler.plan is not None and compiler.plan.whole_module and compiler.plan.targets == [""]
    assert any(level == logging.WARNING and "no repeated block found in Sequential" in m for level, m in logged)
    assert torch.equal(mlp(x), expected)


def test_a_model_with_its_own_compile_does_it_itself() -> None:
    model = _OwnCompile()
    compiler = ModelCompiler(CompileConfig())
    compiler.compile(model, backend="eager", compile_kwargs={"dynamic": False})
    assert compiler.plan is not None and compiler.plan.own_compile
    assert model.called_with == {"backend": "eager", "dynamic": False}


def test_blocks_forward_compiled_hooks_left_eager_names_unchanged() -> None:
    from torch._dynamo.testing import CompileCounter

    model = TinyGPT(SMALL)
    names = [n for n, _ in model.named_parameters()]
    seen: list[int] = []
    model.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(int(args[0].sum().item() != 0)))
    idx = torch.randint(0, SMALL.vocab_size, (2, SMALL.block_size))
    expected = model(idx, idx)
    counter = CompileCounter()
    ModelCompiler(CompileConfig()).compile(model, backend=counter)
    for _ in range(2):
        assert torch.equal(model(idx, idx), expected)
    # the hook's .item() ran eagerly every call: no graph break, one graph for both blocks
    assert seen == [1, 1, 1] and counter.frame_count == 1
    assert [n for n, _ in model.named_parameters()] == names


def test_autoep_non_moe_keeps_the_expert_layers_eager() -> None:
    from torch._dynamo.testing import EagerAndRecordGraphs

    torch.manual_seed(0)
    model = nn.Sequential(nn.ModuleList([_MoEBlock(), _MoEBlock()]))
    model.forward = lambda x: model[0][1](model[0][0](x))  # type: ignore[method-assign]
    plan = plan_compile(model, keep_moe_eager=True)
    assert plan.targets == ["0.0", "0.1"] and plan.eager == ("0.0.moe", "0.1.moe")
    x = torch.randn(2, 4, 8)
    expected = model(x)
    recorder = EagerAndRecordGraphs()
    ModelCompiler(CompileConfig(autoep_non_moe=True)).compile(model, backend=recorder)
    assert torch.equal(model(x), expected)
    nodes = [node.name for graph in recorder.graphs for node in graph.graph.nodes]
    assert any("norm" in n for n in nodes)  # the block around the MoE layer is compiled
    assert not any("moe" in n or "gate" in n or "expert" in n for n in nodes)  # the MoE layer is not


def test_arguments_are_checked_before_anything_compiles(logged) -> None:
    compiler = ModelCompiler(CompileConfig())
    model = TinyGPT(SMALL)
    with pytest.raises(ValueError, match=r"backend = 'inductr': not a torch.compile backend .*inductor"):
        compiler.compile(model, backend="inductr")
    with pytest.raises(ValueError, match=r"compile_kwargs\['fullgrph'\] = True: not a torch.compile argument"):
        compiler.compile(model, compile_kwargs={"fullgrph": True})
    with pytest.raises(NotImplementedError, match="schedule"):
        compiler.compile(model, schedule=[(0, ["z3"])])
    with pytest.raises(NotImplementedError, match="compiled_autograd_enabled"):
        compiler.compile(model, compiled_autograd_enabled=True)
    assert not compiler.is_compiled
    compiler.compile(model, backend="eager", compile_kwargs={"backend": "inductor"})
    assert any("overridden by the backend argument" in m for _, m in logged)
    first = model.blocks[0].forward
    compiler.compile(model, backend="aot_eager")  # a second call does nothing, as in DeepSpeed
    assert model.blocks[0].forward is first


def test_deepcompile_without_compile_warns_once_as_deepspeed(logged) -> None:
    compiler = ModelCompiler(CompileConfig(deepcompile=True))
    compiler.before_forward()
    compiler.before_forward()
    assert [m for _, m in logged if "DeepCompile" in m] == [DEEPCOMPILE_NOT_COMPILED]
    quiet = ModelCompiler(CompileConfig(deepcompile=True))
    quiet.compile(TinyGPT(SMALL), backend="eager")
    logged.clear()
    quiet.before_forward()
    assert not [m for _, m in logged if "has not been called" in m]


def test_debug_log_turns_on_torchs_graph_break_and_recompile_logs() -> None:
    from torch._logging._internal import log_state

    try:
        ModelCompiler(CompileConfig(debug_log=True)).compile(TinyGPT(SMALL), backend="eager")
        assert log_state.is_artifact_enabled("graph_breaks") and log_state.is_artifact_enabled("recompiles")
    finally:
        torch._logging.set_logs()


def test_passes_are_refused_by_name() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"train_micro_batch_size_per_gpu": 1, "compile": {"deepcompile": True, "passes": ["z1", "autotp"]}})
    errors = getattr(info.value, "errors", [info.value])
    (error,) = [e for e in errors if e.key == "compile.passes"]
    assert error.value == ["z1", "autotp"]
    assert "'z1' is DeepCompile's ZeRO-1/2 pass" in error.rule and "zero_optimization.stage 1 or 2" in error.rule
    assert "tensor_parallel.autotp_size" in error.rule and "engine.compile()" in error.fix
    assert load_config({"train_micro_batch_size_per_gpu": 1, "compile": {"passes": []}}).ignored == []


def test_legacy_disable_false_compiles_at_initialize() -> None:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "compile": {"disable": False, "backend": "eager", "kwargs": {"dynamic": False}},
    }
    assert load_config(config).ignored == []  # backend and kwargs act when disable is false
    engine, *_ = shardwise.initialize(model=TinyGPT(SMALL), config=config)
    assert engine.is_compiled and engine.compiler.plan.targets == ["blocks.0", "blocks.1"]
    idx = torch.randint(0, SMALL.vocab_size, (2, SMALL.block_size))
    engine.backward(engine(idx, idx))
    engine.step()
