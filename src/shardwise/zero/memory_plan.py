"""How many bytes of model state each rank holds, per ZeRO stage and offload setting.

The plan follows what shardwise actually allocates (not DeepSpeed's formulas):

| stage | params | grads | optimizer |
|---|---|---|---|
| 0 | whole, compute dtype | whole, accumulation dtype | whole state, + fp32 masters for 16-bit |
| 1 | whole | whole (flat buffer) | state / W, + fp32 masters / W for 16-bit |
| 2 | whole | shard (/ W) | state / W, + fp32 masters / W for 16-bit |
| 3 | fp32 masters / W (frozen: compute dtype / W) | fp32 / W | state / W |

Stage 3 keeps parameters below ``stage3_param_persistence_threshold`` whole (compute
dtype, fp32 gradient accumulator, fp32 master if 16-bit, whole optimizer state). Its
shards are FSDP2's: each parameter's first dimension is split in ``ceil(rows / W)`` rows,
so small parameters are padded; with a model (not a count) the plan includes that.

Offload moves the optimizer's part (state, and host staging copies of masters and
gradients for ``cpu``) off the device: ``offloaded_host`` for ``cpu``, ``offloaded_nvme``
for files (``nvme`` keeps no state in memory between steps). Stage 3's ``offload_param``
moves parameters and gradients to the host (``cpu``) or parameters to files (``nvme``,
read back for forward, backward and the step: the plan counts them in both places, as
the step sees them). Transient buffers (gathered units, reduction buckets, stage 2's
shared-memory gradient staging, which is given back after each reduction) are not model
state and are not counted.

Pure Python: a model is only asked for ``parameters()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# bytes of optimizer state per trainable element (fp32 moments), by optimizer.type
STATE_BYTES: dict[str, int] = {
    "adam": 8,
    "adamw": 8,
    "fusedadam": 8,
    "cpuadam": 8,
    "deepspeedcpuadam": 8,
    "lamb": 8,
    "fusedlamb": 8,
    "onebitadam": 8,
    "zerooneadam": 8,
    "onebitlamb": 8,
    "lion": 4,
    "fusedlion": 4,
    "adagrad": 4,
    "cpuadagrad": 4,
    "sgd": 4,
    "muon": 4,
    "rmsprop": 4,
    "adamax": 8,
    "nadam": 8,
    "radam": 8,
}
_DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


def offloaded_prefix(numels: Sequence[int], ratio: float) -> int:
    """How many leading tensors are offloaded so that about ``ratio`` of the elements are.

    Example:
        >>> offloaded_prefix([10, 10, 10, 10], 0.5)
        2
        >>> offloaded_prefix([10, 10], 1.0)
        2
    """
    if ratio >= 1.0:
        return len(numels)
    budget = ratio * sum(numels)
    total = 0
    for index, numel in enumerate(numels):
        if total + numel > budget + 1e-9:
            return index
        total += numel
    return len(numels)


@dataclass(frozen=True)
class ModelStatesMemory:
    """Model-state bytes per rank, by role and place.

    Attributes:
        stage: ZeRO stage.
        world_size: data-parallel ranks.
        trainable: trainable elements (tied parameters once).
        frozen: frozen elements.
        params: parameter bytes on the compute device.
        grads: gradient bytes on the compute device.
        optimizer: optimizer state (and separate fp32 masters) on the compute device.
        offloaded_host: bytes offload keeps in host memory.
        offloaded_nvme: bytes offload keeps in swap files.
        notes: assumptions worth reading next to the numbers.
    """

    stage: int
    world_size: int
    trainable: int
    frozen: int
    params: int
    grads: int
    optimizer: int
    offloaded_host: int = 0
    offloaded_nvme: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def device_total(self) -> int:
        """Bytes on the compute device."""
        return self.params + self.grads + self.optimizer

    @property
    def memory_total(self) -> int:
        """Bytes in memory (device and host), files excluded."""
        return self.device_total + self.offloaded_host

    def bytes_per_param(self) -> float:
        """In-memory bytes per parameter element (trainable and frozen)."""
        total = self.trainable + self.frozen
        return self.memory_total / total if total else 0.0

    def format(self) -> str:
        """A small table, one row per role (bytes and GiB)."""

        def row(name: str, value: int) -> str:
            return f"  {name:<26} {value:>16,d} B  {value / 2**30:9.3f} GiB"

        lines = [
            f"ZeRO stage {self.stage}, {self.world_size} rank(s), {self.trainable:,d} trainable + "
            f"{self.frozen:,d} frozen elements; per rank:",
            row("params (device)", self.params),
            row("gradients (device)", self.grads),
            row("optimizer state (device)", self.optimizer),
            row("offloaded to host memory", self.offloaded_host),
            row("offloaded to NVMe files", self.offloaded_nvme),
            row("total on device", self.device_total),
            row("total in memory", self.memory_total),
            f"  {'bytes per parameter':<26} {self.bytes_per_param():16.2f}",
        ]
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


@dataclass(frozen=True)
class _Counts:
    trainable: int
    frozen: int
    # per parameter (shape[0], numel, trainable): for stage-3 padding and persistence
    shapes: tuple[tuple[int, int, bool], ...] = ()


def _count(model_or_numel: Any, frozen_numel: int) -> _Counts:
    if isinstance(model_or_numel, int) and not isinstance(model_or_numel, bool):
        if model_or_numel < 0:
            raise ValueError(f"the parameter count must be >= 0, got {model_or_numel}")
        return _Counts(model_or_numel, frozen_numel)
    params: Iterable[Any] = model_or_numel.parameters()
    seen: set[int] = set()
    trainable = frozen = 0
    shapes = []
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        numel = int(p.numel())
        rows = int(p.shape[0]) if len(p.shape) > 0 else 1
        shapes.append((rows, numel, bool(p.requires_grad)))
        if p.requires_grad:
            trainable += numel
        else:
            frozen += numel
    return _Counts(trainable, frozen + frozen_numel, tuple(shapes))


def _local_numel(rows: int, numel: int, world: int) -> int:
    """Elements of the largest (rank-0) FSDP2 shard of a parameter: ``ceil(rows / W)`` rows."""
    if rows == 0:
        return 0
    return -(-rows // world) * (numel // rows)


def estimate_model_states_memory(
    model_or_numel: object,
    stage: int,
    world_size: int,
    *,
    precision: str = "fp32",
    optimizer: str = "adamw",
    offload_optimizer: str = "none",
    offload_param: str = "none",
    offload_ratio: float = 1.0,
    persistence_threshold: int = 0,
    frozen_numel: int = 0,
    grad_accum_dtype: str = "fp32",
) -> ModelStatesMemory:
    """Model-state bytes per rank for a model (or a trainable-parameter count).

    Args:
        model_or_numel: an ``nn.Module`` (tied and frozen parameters understood, stage-3
            padding exact) or the number of trainable elements.
        stage: ZeRO stage 0-3.
        world_size: data-parallel ranks.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (the compute dtype).
        optimizer: ``optimizer.type`` (state bytes per element: Adam-like 8, Lion/SGD 4).
        offload_optimizer: ``"none"``, ``"cpu"`` or ``"nvme"``.
        offload_param: ``"none"``, ``"cpu"`` or ``"nvme"`` (stage 3 only).
        offload_ratio: fraction of the optimizer offloaded (stage 3).
        persistence_threshold: stage 3: parameters below it stay whole (needs a model).
        frozen_numel: frozen elements to add (with a count).
        grad_accum_dtype: gradient accumulation dtype at stages 0-2.

    Example:
        >>> plan = estimate_model_states_memory(1_000_000, stage=3, world_size=2)
        >>> plan.params, plan.grads, plan.optimizer
        (2000000, 2000000, 4000000)
        >>> round(plan.bytes_per_param(), 2)
        8.0
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0-3, got {stage}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if precision not in _DTYPE_BYTES:
        raise ValueError(f"precision must be fp32, bf16 or fp16, got {precision!r}")
    for name, value in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if value not in ("none", "cpu", "nvme"):
            raise ValueError(f"{name} must be 'none', 'cpu' or 'nvme', got {value!r}")
    counts = _count(model_or_numel, frozen_numel)
    key = optimizer.lower().replace("_", "")
    notes: list[str] = []
    state = STATE_BYTES.get(key)
    if state is None:
        state = 8
        notes.append(f"optimizer {optimizer!r} is not in the table: assumed 8 bytes of state per element")
    p_b = _DTYPE_BYTES[precision]
    g_b = _DTYPE_BYTES[grad_accum_dtype]
    sixteen = p_b == 2
    w = world_size
    n, f = counts.trainable, counts.frozen
    if stage < 3:
        if offload_param != "none":
            notes.append("offload_param is only used at stage 3: ignored")
        if offload_optimizer != "none" and stage == 0:
            raise ValueError("optimizer offload needs stage 1, 2 or 3")
        shard = n if stage == 0 else -(-n // w)
        params = p_b * (n + f)
        grads = g_b * (n if stage < 2 else shard)
        masters = 4 * shard if sixteen else 0
        opt_state = state * shard
        host = nvme = 0
        if offload_optimizer == "cpu":
            host = opt_state + 4 * shard + g_b * shard  # state + staging masters and grads
            opt_state = 0
        elif offload_optimizer == "nvme":
            nvme = opt_state
            opt_state = 0
        return ModelStatesMemory(stage, w, n, f, params, grads, masters + opt_state, host, nvme, tuple(notes))

    # ---- stage 3
    if counts.shapes:
        persistent = [(r, m, t) for r, m, t in counts.shapes if m < persistence_threshold or r == 0]
        sharded = [(r, m, t) for r, m, t in counts.shapes if not (m < persistence_threshold or r == 0)]
        local_t = sum(_local_numel(r, m, w) for r, m, t in sharded if t)
        local_f = sum(_local_numel(r, m, w) for r, m, t in sharded if not t)
        pers_t = sum(m for r, m, t in persistent if t)
        pers_f = sum(m for r, m, t in persistent if not t)
    else:
        if persistence_threshold:
            notes.append("persistence needs the model's parameter sizes: every parameter counted as sharded")
        local_t, local_f, pers_t, pers_f = -(-n // w), -(-f // w), 0, 0
        notes.append("shards assume even splits (a model gives exact per-parameter padding)")
    shard_params = 4 * local_t + p_b * local_f
    shard_grads = 4 * local_t
    shard_state = state * local_t
    rep_params = p_b * (pers_t + pers_f)
    rep_grads = 4 * pers_t
    rep_opt = state * pers_t + (4 * pers_t if sixteen else 0)
    params, grads, opt_dev = shard_params + rep_params, shard_grads + rep_grads, shard_state + rep_opt
    host = nvme = 0
    if offload_param != "none":
        params -= shard_params
        grads -= shard_grads
        host += shard_params + shard_grads
        if offload_param == "nvme":
            nvme += shard_params  # the swap file holds every shard
            if offload_optimizer == "nvme":
                # forward, backward and the step stream them: a unit, a sub-group at a time
                host -= shard_params
                notes.append(
                    "NVMe parameters stream from their file: a unit or a sub-group in memory at a time"
                )
        # masters live on the host: their optimizer state does too, unless sent to files
        opt_dev -= shard_state
        if offload_optimizer == "nvme":
            nvme += shard_state
        else:
            host += shard_state
    elif offload_optimizer != "none":
        offloaded = local_t
        if offload_ratio < 1.0 and counts.shapes:
            # the store offloads whole tensors, the leading ones in optimizer order
            order = [
                (m if (m < persistence_threshold or r == 0) else _local_numel(r, m, w))
                for r, m, t in counts.shapes
                if t
            ]
            offloaded = sum(order[: offloaded_prefix(order, offload_ratio)])
        elif offload_ratio < 1.0:
            offloaded = round(offload_ratio * local_t)
        opt_dev -= state * offloaded
        if offload_optimizer == "cpu":
            host += state * offloaded + 4 * offloaded + 4 * offloaded  # state + staging masters, grads
        else:
            nvme += state * offloaded
    if offload_ratio < 1.0 and offload_param != "none":
        notes.append(
            "offload_optimizer.ratio is not applied with offload_param (the masters are on the host)"
        )
    return ModelStatesMemory(3, w, n, f, params, grads, opt_dev, host, nvme, tuple(notes))


def plan_from_config(
    cfg: Any, model_or_numel: Any, world_size: int, frozen_numel: int = 0
) -> ModelStatesMemory:
    """:func:`estimate_model_states_memory` with everything read from a validated config.

    Example:
        >>> from shardwise.config import load_config
        >>> cfg = load_config({"train_batch_size": 2, "zero_optimization": {"stage": 2}}).config
        >>> plan_from_config(cfg, 1000, world_size=2).grads
        2000
    """
    zero = cfg.zero_optimization
    opt = cfg.optimizer.type if cfg.optimizer is not None else "adamw"
    ratio = zero.offload_optimizer.ratio if zero.offload_optimizer is not None else 1.0
    accum = cfg.data_types.grad_accum_dtype or "fp32"
    return estimate_model_states_memory(
        model_or_numel,
        int(zero.stage),
        world_size,
        precision=cfg.precision if cfg.precision in _DTYPE_BYTES else "fp32",
        optimizer=opt,
        offload_optimizer=zero.offload_optimizer_device,
        offload_param=zero.offload_param_device if int(zero.stage) == 3 else "none",
        offload_ratio=ratio,
        persistence_threshold=int(zero.stage3_param_persistence_threshold),
        frozen_numel=frozen_numel,
        grad_accum_dtype=accum,
    )
