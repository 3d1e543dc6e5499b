"""``"auto"`` resolution (``shardwise.config.auto``): overrides, each rule in the module
docstring, the errors when no rule applies, and the provenance recorded for each value."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from shardwise.config import ConfigError, ResolutionContext, Source, load_config
from shardwise.config.auto import LITERAL_AUTO_FIELDS

TBS, MBS, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
BASE = {TBS: 8}

# A typical Hugging Face Trainer ZeRO-3 file: "auto" everywhere the Trainer fills in.
HF_ZERO3 = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def _walk_autos(tree: Any, prefix: str = "") -> list[str]:
    """Every dotted path whose value is the string "auto" (any case), lists included."""
    found = []
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list):
        items = ((str(i), v) for i, v in enumerate(tree))
    else:
        return found
    for key, value in items:
        path = f"{prefix}{key}"
        if isinstance(value, str) and value.strip().lower() == "auto":
            found.append(path)
        found.extend(_walk_autos(value, path + "."))
    return found


# ------------------------------------------------------------------ overrides


def test_override_fills_auto() -> None:
    cfg = load_config(
        {**BASE, "zero_optimization": {"stage": "auto"}}, overrides={"zero_optimization.stage": 2}
    )
    assert cfg.config.zero_stage == 2
    prov = cfg.sources["zero_optimization.stage"]
    assert prov.source is Source.OVERRIDE and "auto" in prov.note


def test_override_fills_missing_key() -> None:
    cfg = load_config(
        BASE, overrides={"zero_optimization.stage": 3, "optimizer.type": "AdamW", "optimizer.params.lr": 0.02}
    )
    assert cfg.config.zero_stage == 3
    assert cfg.config.optimizer.params == {"lr": 0.02}
    for key in ("zero_optimization.stage", "optimizer.type", "optimizer.params.lr"):
        assert cfg.sources[key].source is Source.OVERRIDE


def test_override_equal_to_file_is_fine() -> None:
    cfg = load_config({**BASE, "gradient_clipping": 0.5}, overrides={"gradient_clipping": 0.5})
    assert cfg.config.gradient_clipping == 0.5
    assert cfg.sources["gradient_clipping"].source is Source.OVERRIDE


def test_override_conflicting_with_file_is_an_error() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, "zero_optimization": {"stage": 2}}, overrides={"zero_optimization.stage": 3})
    err = info.value
    assert err.key == "zero_optimization.stage"
    assert "2" in err.rule and "3" in err.rule
    assert '"auto"' in err.fix and "fix:" in str(err)


def test_override_of_auto_is_case_insensitive() -> None:
    cfg = load_config({**BASE, "gradient_clipping": " AUTO "}, overrides={"gradient_clipping": 0.25})
    assert cfg.config.gradient_clipping == 0.25


def test_override_of_a_block_records_its_leaves_as_override() -> None:
    # a dotted override may carry a whole block; the values it brings came from the caller
    cfg = load_config(
        {**BASE, "zero_optimization": {"stage": 2}},
        overrides={"zero_optimization.offload_optimizer": {"device": "cpu"}},
    )
    assert cfg.config.zero_optimization.offload_optimizer_device == "cpu"
    assert cfg.sources["zero_optimization.offload_optimizer.device"].source is Source.OVERRIDE


def test_context_overrides_merge_with_keyword_overrides() -> None:
    ctx = ResolutionContext(overrides={"gradient_clipping": 0.3})
    cfg = load_config(
        {**BASE, "gradient_clipping": "auto", "steps_per_print": "auto"},
        context=ctx,
        overrides={"steps_per_print": 7},
    )
    assert (cfg.config.gradient_clipping, cfg.config.steps_per_print) == (0.3, 7)


# ------------------------------------------------------------------ batch autos


def test_micro_batch_auto_from_loader() -> None:
    ctx = ResolutionContext(world_size=2, loader_batch_size=3)
    cfg = load_config({TBS: "auto", MBS: "auto", GAS: "auto"}, context=ctx)
    assert (
        cfg.config.train_batch_size,
        cfg.config.train_micro_batch_size_per_gpu,
        cfg.config.gradient_accumulation_steps,
    ) == (
        6,
        3,
        1,
    )
    assert cfg.sources[MBS].source is Source.AUTO and "data loader" in cfg.sources[MBS].note
    assert cfg.sources[TBS].source is Source.DERIVED
    assert cfg.sources[GAS].source is Source.AUTO
    assert not any(MBS in w for w in cfg.warnings)


def test_micro_batch_auto_defaults_to_one_with_warning() -> None:
    cfg = load_config({MBS: "auto", GAS: 2}, world_size=2)
    assert (
        cfg.config.train_batch_size,
        cfg.config.train_micro_batch_size_per_gpu,
        cfg.config.gradient_accumulation_steps,
    ) == (
        4,
        1,
        2,
    )
    assert cfg.sources[MBS].source is Source.AUTO and "default 1" in cfg.sources[MBS].note
    warning = next(w for w in cfg.warnings if MBS in w)
    assert "overrides={'train_micro_batch_size_per_gpu': N}" in warning


def test_train_batch_auto_alone_uses_default_micro_batch() -> None:
    cfg = load_config({TBS: "auto"}, world_size=2)
    assert (
        cfg.config.train_batch_size,
        cfg.config.train_micro_batch_size_per_gpu,
        cfg.config.gradient_accumulation_steps,
    ) == (
        2,
        1,
        1,
    )
    assert cfg.sources[TBS].source is Source.DERIVED
    assert any(MBS in w for w in cfg.warnings)


def test_train_batch_auto_with_explicit_micro_batch() -> None:
    cfg = load_config({TBS: "auto", MBS: 4, GAS: 2}, world_size=3)
    assert cfg.config.train_batch_size == 24
    assert cfg.sources[TBS].source is Source.DERIVED and cfg.sources[MBS].source is Source.FILE
    assert cfg.warnings == []


def test_micro_batch_auto_with_explicit_train_batch_is_derived() -> None:
    cfg = load_config({TBS: 16, MBS: "auto", GAS: 2}, world_size=2)
    assert cfg.config.train_micro_batch_size_per_gpu == 4
    assert cfg.sources[MBS].source is Source.DERIVED
    assert cfg.warnings == []


def test_gas_auto_derived_when_train_and_micro_given() -> None:
    cfg = load_config({TBS: 16, MBS: 2, GAS: "auto"}, world_size=2)
    assert cfg.config.gradient_accumulation_steps == 4
    assert cfg.sources[GAS].source is Source.DERIVED


def test_gas_auto_defaults_to_one_otherwise() -> None:
    cfg = load_config({MBS: 2, GAS: "auto"}, world_size=2)
    assert (cfg.config.train_batch_size, cfg.config.gradient_accumulation_steps) == (4, 1)
    assert cfg.sources[GAS].source is Source.AUTO and "default 1" in cfg.sources[GAS].note


def test_batch_override_replaces_auto() -> None:
    cfg = load_config({TBS: "auto", MBS: "auto"}, world_size=2, overrides={TBS: 16})
    assert (cfg.config.train_batch_size, cfg.config.train_micro_batch_size_per_gpu) == (16, 8)
    assert cfg.sources[TBS].source is Source.OVERRIDE


# ------------------------------------------------------------------ scalar and section autos


def test_gradient_clipping_auto() -> None:
    cfg = load_config({**BASE, "gradient_clipping": "auto"})
    assert cfg.config.gradient_clipping == 1.0
    assert cfg.sources["gradient_clipping"].source is Source.AUTO


def test_bf16_enabled_auto_is_false() -> None:
    cfg = load_config({**BASE, "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}})
    assert (
        cfg.config.bf16.enabled is False
        and cfg.config.fp16.enabled is False
        and cfg.config.precision == "fp32"
    )
    assert cfg.sources["bf16.enabled"].source is Source.AUTO


def test_zero_stage_auto_is_zero() -> None:
    cfg = load_config({**BASE, "zero_optimization": {"stage": "auto"}})
    assert cfg.config.zero_stage == 0
    assert cfg.sources["zero_optimization.stage"].source is Source.AUTO


def test_auto_in_nested_section_takes_the_field_default() -> None:
    cfg = load_config(
        {
            **BASE,
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_count": "auto"}},
            "steps_per_print": "auto",
        }
    )
    assert cfg.config.zero_optimization.offload_param.buffer_count == 5
    assert cfg.config.steps_per_print is None


@pytest.mark.parametrize(
    ("hidden", "expected"),
    # 0.9 * 4096**2 = 15099494.4: truncated to an int
    [(1000, (1_000_000, 900_000, 10_000)), (4096, (16_777_216, 15_099_494, 40_960))],
)
def test_bucket_sizes_from_hidden_size(hidden: int, expected: tuple[int, int, int]) -> None:
    zero = {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    }
    cfg = load_config({**BASE, "zero_optimization": zero}, context=ResolutionContext(hidden_size=hidden))
    z = cfg.config.zero_optimization
    assert (
        z.reduce_bucket_size,
        z.stage3_prefetch_bucket_size,
        z.stage3_param_persistence_threshold,
    ) == expected
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        prov = cfg.sources[f"zero_optimization.{key}"]
        assert prov.source is Source.AUTO and str(hidden) in prov.note


def test_bucket_size_short_alias_auto_uses_hidden_size() -> None:
    cfg = load_config(
        {**BASE, "zero_optimization": {"stage": 3, "prefetch_bucket_size": "auto"}},
        context=ResolutionContext(hidden_size=100),
    )
    assert cfg.config.zero_optimization.stage3_prefetch_bucket_size == 9000


def test_bucket_sizes_without_hidden_size_take_section_defaults() -> None:
    zero = {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    }
    cfg = load_config({**BASE, "zero_optimization": zero})
    z = cfg.config.zero_optimization
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (
        500_000_000,
        50_000_000,
        100_000,
    )
    prov = cfg.sources["zero_optimization.reduce_bucket_size"]
    assert prov.source is Source.AUTO and "section default" in prov.note


# ------------------------------------------------------------------ optimizer params


def test_optimizer_params_from_client_hparams() -> None:
    ctx = ResolutionContext(
        optimizer_hparams={"lr": 5e-5, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
    )
    opt = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
    cfg = load_config({**BASE, "optimizer": opt}, context=ctx)
    assert cfg.config.optimizer.params == {"lr": 5e-5, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    assert isinstance(cfg.config.optimizer.params["betas"], list)
    prov = cfg.sources["optimizer.params.lr"]
    assert prov.source is Source.AUTO and "optimizer passed to initialize" in prov.note


@pytest.mark.parametrize(
    ("opt_type", "expected"),
    [
        ("AdamW", {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}),
        ("adam", {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}),
        ("Lamb", {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}),
        ("Lion", {"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.0}),
        ("Adagrad", {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0}),
    ],
)
def test_optimizer_params_from_default_table(opt_type: str, expected: dict[str, Any]) -> None:
    params = dict.fromkeys(expected, "auto")
    cfg = load_config({**BASE, "optimizer": {"type": opt_type, "params": params}})
    assert cfg.config.optimizer.params == expected
    assert cfg.sources["optimizer.params.lr"].source is Source.AUTO


def test_client_hparams_win_over_the_default_table() -> None:
    cfg = load_config(
        {**BASE, "optimizer": {"type": "AdamW", "params": {"lr": "auto", "eps": "auto"}}},
        context=ResolutionContext(optimizer_hparams={"lr": 0.5}),
    )
    assert cfg.config.optimizer.params == {"lr": 0.5, "eps": 1e-8}


def test_torch_optimizer_defaults_from_signature() -> None:
    cfg = load_config(
        {
            **BASE,
            "optimizer": {"type": "RMSprop", "params": {"lr": 0.01, "alpha": "auto", "momentum": "auto"}},
        }
    )
    assert cfg.config.optimizer.params == {"lr": 0.01, "alpha": 0.99, "momentum": 0}
    assert cfg.sources["optimizer.params.alpha"].source is Source.AUTO


def test_sgd_lr_auto_follows_torch_signature() -> None:
    # torch.optim.SGD's lr was required in old torch releases and defaults to 1e-3 since 2.x;
    # the rule reads the installed signature, so both behaviours are checked here.
    lr_param = inspect.signature(torch.optim.SGD).parameters["lr"]
    source = {**BASE, "optimizer": {"type": "SGD", "params": {"lr": "auto", "momentum": "auto"}}}
    if lr_param.default is inspect.Parameter.empty:
        with pytest.raises(ConfigError) as info:
            load_config(source)
        assert info.value.key == "optimizer.params.lr"
    else:
        cfg = load_config(source)
        assert cfg.config.optimizer.params == {"lr": lr_param.default, "momentum": 0}
        assert cfg.config.optimizer.params["lr"] == 1e-3


def test_optimizer_param_without_any_default_is_an_error() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "frobnicate": "auto"}}})
    err = info.value
    assert err.key == "optimizer.params.frobnicate"
    assert "'AdamW'" in err.rule and "overrides={'optimizer.params.frobnicate'" in err.fix


def test_unknown_optimizer_type_auto_param_is_an_error() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, "optimizer": {"type": "MyOwnOptimizer", "params": {"lr": "auto"}}})
    assert info.value.key == "optimizer.params.lr" and "'MyOwnOptimizer'" in str(info.value)


def test_lion_has_no_eps() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, "optimizer": {"type": "Lion", "params": {"eps": "auto"}}})
    assert info.value.key == "optimizer.params.eps"


# ------------------------------------------------------------------ scheduler params


def test_warmup_max_lr_derived_from_file_optimizer_lr() -> None:
    cfg = load_config(
        {
            **BASE,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
        }
    )
    assert cfg.config.scheduler.params["warmup_max_lr"] == 3e-4
    prov = cfg.sources["scheduler.params.warmup_max_lr"]
    assert prov.source is Source.DERIVED and "lr" in prov.note


def test_warmup_max_lr_follows_optimizer_lr_that_was_itself_auto() -> None:
    # the optimizer is resolved before the scheduler, so the chain works
    cfg = load_config(
        {
            **BASE,
            "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
        },
        context=ResolutionContext(optimizer_hparams={"lr": 7e-5}),
    )
    assert cfg.config.optimizer.params["lr"] == 7e-5
    assert cfg.config.scheduler.params["warmup_max_lr"] == 7e-5


def test_warmup_max_lr_from_client_hparams_without_config_optimizer() -> None:
    cfg = load_config(
        {**BASE, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}},
        context=ResolutionContext(optimizer_hparams={"lr": 0.02}),
    )
    assert cfg.config.scheduler.params["warmup_max_lr"] == 0.02
    assert cfg.sources["scheduler.params.warmup_max_lr"].source is Source.DERIVED


def test_warmup_max_lr_default_without_any_lr() -> None:
    cfg = load_config({**BASE, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}})
    assert cfg.config.scheduler.params["warmup_max_lr"] == 1e-3
    assert cfg.sources["scheduler.params.warmup_max_lr"].source is Source.AUTO


def test_one_cycle_autos() -> None:
    cfg = load_config(
        {
            **BASE,
            "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": "auto", "cycle_max_lr": "auto"}},
        },
        context=ResolutionContext(optimizer_hparams={"lr": 0.05}),
    )
    assert cfg.config.scheduler.params == {"cycle_min_lr": 0.0, "cycle_max_lr": 0.05}


def test_total_num_steps_from_planned_steps() -> None:
    cfg = load_config(
        {**BASE, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}},
        context=ResolutionContext(total_training_steps=1234),
    )
    assert cfg.config.scheduler.params["total_num_steps"] == 1234
    assert cfg.sources["scheduler.params.total_num_steps"].source is Source.DERIVED
    assert not any("total_num_steps" in w for w in cfg.warnings)


def test_total_num_steps_default_with_warning() -> None:
    cfg = load_config({**BASE, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}})
    assert cfg.config.scheduler.params["total_num_steps"] == 10_000
    assert cfg.sources["scheduler.params.total_num_steps"].source is Source.AUTO
    warning = next(w for w in cfg.warnings if "total_num_steps" in w)
    assert "10000" in warning and "overrides=" in warning


def test_total_num_steps_default_is_at_least_the_warmup() -> None:
    cfg = load_config(
        {
            **BASE,
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {"total_num_steps": "auto", "warmup_num_steps": 20_000},
            },
        }
    )
    assert cfg.config.scheduler.params["total_num_steps"] == 20_000


def test_scheduler_defaults_table() -> None:
    params = {
        "warmup_min_lr": "auto",
        "warmup_num_steps": "auto",
        "warmup_type": "auto",
        "cos_min_ratio": "auto",
    }
    cfg = load_config({**BASE, "scheduler": {"type": "WarmupCosineLR", "params": params}})
    assert cfg.config.scheduler.params == {
        "warmup_min_lr": 0.0,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
        "cos_min_ratio": 0.0001,
    }


def test_scheduler_param_without_default_is_an_error() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, "scheduler": {"type": "WarmupLR", "params": {"mystery": "auto"}}})
    assert info.value.key == "scheduler.params.mystery" and "fix:" in str(info.value)


# ------------------------------------------------------------------ free-form dicts


@pytest.mark.parametrize(
    ("block", "path"),
    [
        (
            {
                "compression_training": {
                    "weight_quantization": {
                        "different_groups": {"wq1": {"params": {"start_bits": "auto", "target_bits": 8}}}
                    }
                }
            },
            "compression_training.weight_quantization.different_groups.wq1.params.start_bits",
        ),
        (
            {"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": "auto"}}}},
            "compression_training.weight_quantization.shared_parameters.enabled",
        ),
        ({"tensor_parallel": {"partition_config": {"x": "auto"}}}, "tensor_parallel.partition_config.x"),
        ({"expert_parallel": {"size": "auto"}}, "expert_parallel.size"),
    ],
)
def test_auto_in_free_form_dict_is_an_error(block: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, **block})
    err = info.value
    assert err.key == path
    assert "auto" in str(err) and f"overrides={{'{path}'" in err.fix


def test_free_form_auto_can_be_filled_by_override() -> None:
    path = "tensor_parallel.partition_config.x"
    cfg = load_config({**BASE, "tensor_parallel": {"partition_config": {"x": "auto"}}}, overrides={path: 3})
    assert cfg.config.tensor_parallel.partition_config == {"x": 3}


def test_literal_auto_fields_are_kept() -> None:
    cfg = load_config(
        {**BASE, "pipeline": {"stages": "auto"}, "data_types": {"keep_in_fp32_modules": "auto"}}
    )
    assert cfg.config.pipeline.stages == "auto" and cfg.config.data_types.keep_in_fp32_modules == "auto"


# ------------------------------------------------------------------ the whole HF file


def test_hf_file_resolves_completely_with_provenance() -> None:
    ctx = ResolutionContext(
        world_size=2,
        hidden_size=768,
        loader_batch_size=8,
        total_training_steps=500,
        optimizer_hparams={"lr": 5e-5, "betas": (0.9, 0.98), "eps": 1e-6, "weight_decay": 0.01},
    )
    cfg = load_config(HF_ZERO3, context=ctx)
    assert (
        cfg.config.train_batch_size,
        cfg.config.train_micro_batch_size_per_gpu,
        cfg.config.gradient_accumulation_steps,
    ) == (
        16,
        8,
        1,
    )
    assert cfg.config.precision == "fp32" and cfg.config.gradient_clipping == 1.0
    assert cfg.config.optimizer.params == {
        "lr": 5e-5,
        "betas": [0.9, 0.98],
        "eps": 1e-6,
        "weight_decay": 0.01,
    }
    assert cfg.config.scheduler.params == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 5e-5,
        "warmup_num_steps": 1000,
        "total_num_steps": 500,
    }
    z = cfg.config.zero_optimization
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (
        589_824,
        530_841,
        7680,
    )
    assert z.sub_group_size == 1_000_000_000 and isinstance(z.sub_group_size, int)

    leftovers = [p for p in _walk_autos(cfg.to_ds_dict()) if p not in LITERAL_AUTO_FIELDS]
    assert leftovers == []
    assert set(_walk_autos(cfg.to_ds_dict())) <= LITERAL_AUTO_FIELDS

    src = {k: v.source for k, v in cfg.sources.items()}
    assert src[MBS] is Source.AUTO and src[GAS] is Source.AUTO and src[TBS] is Source.DERIVED
    assert src["optimizer.params.lr"] is Source.AUTO
    assert src["scheduler.params.warmup_max_lr"] is Source.DERIVED
    assert src["scheduler.params.total_num_steps"] is Source.DERIVED
    assert src["zero_optimization.reduce_bucket_size"] is Source.AUTO
    assert src["gradient_clipping"] is Source.AUTO and src["bf16.enabled"] is Source.AUTO
    assert src["zero_optimization.stage"] is Source.FILE and src["steps_per_print"] is Source.FILE
    assert src["zero_optimization.offload_optimizer.device"] is Source.FILE
    assert src["zero_optimization.round_robin_gradients"] is Source.DEFAULT
    assert src["aio.block_size"] is Source.DEFAULT
    # every resolved leaf has a recorded source
    assert set(cfg.sources) == set(cfg.flat())


def test_hf_file_without_context_still_resolves_with_warnings() -> None:
    cfg = load_config(HF_ZERO3, world_size=4)
    assert [p for p in _walk_autos(cfg.to_ds_dict()) if p not in LITERAL_AUTO_FIELDS] == []
    assert cfg.config.train_batch_size == 4
    assert cfg.config.optimizer.params["lr"] == 1e-3 and cfg.config.scheduler.params["warmup_max_lr"] == 1e-3
    assert any(MBS in w for w in cfg.warnings) and any("total_num_steps" in w for w in cfg.warnings)
