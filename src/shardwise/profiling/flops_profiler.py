"""The flops profiler: params, FLOPs, MACs and forward latency per module (spec 3.10, 11.5).

FLOPs come from ``torch.utils.flop_counter.FlopCounterMode``, which counts the
operations that dominate a model's cost (matrix multiplies, convolutions, attention)
from their shapes: ``2 * m * n * k`` for an ``(m, k) @ (k, n)`` product, so a
``Linear(i, o)`` on ``b`` rows costs ``2 * b * i * o``. Element-wise work (bias adds,
activations, norms, softmax) is not counted. Every counted op does one multiply and one
add per MAC, so ``MACs = flops / 2``. The CPU flash-attention kernel that
``scaled_dot_product_attention`` uses on CPU is added to torch's table.

Per-module numbers come from forward hooks: a module's flops are the counter's
increase between its pre-hook and its hook, its latency the wall-clock time between
them (with a device synchronisation on accelerators), summed over calls. Only the
forward is counted; the summary derives the backward as ``2 x`` forward (plus
``recompute_fwd_factor`` x forward for activation recomputation), as DeepSpeed does.

Two ways to use it:

* from the config: ``"flops_profiler": {"enabled": true, "profile_step": 1}`` profiles the
  forwards of the optimizer step taken while ``engine.global_steps == profile_step`` on
  rank 0 and logs (or writes to ``output_file``) the report at its boundary;
* standalone: :func:`get_model_profile`, or :class:`FlopsProfiler` with
  ``start_profile()`` / ``stop_profile()`` around forwards.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> flops, macs, params = get_model_profile(model, args=[torch.randn(3, 4)], print_profile=False,
    ...                                         as_string=False)
    >>> flops == 2 * 3 * (4 * 8 + 8 * 2), macs == flops // 2, params == 4 * 8 + 8 + 8 * 2 + 2
    (True, True, True)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count
from torch.utils.hooks import RemovableHandle

from shardwise.profiling.flops_report import FlopsReport, format_count, format_time

__all__ = [
    "FlopsProfiler",
    "ModuleStats",
    "format_count",
    "format_time",
    "get_model_profile",
]


def _cpu_flash_attention_flop(
    query_shape: Sequence[int],
    key_shape: Sequence[int],
    value_shape: Sequence[int],
    *args: object,
    **kwargs: object,
) -> int:
    """FLOPs of the CPU flash-attention kernel: the same two batched products as on GPU."""
    return int(sdpa_flop_count(query_shape, key_shape, value_shape))


_EXTRA_FORMULAS: dict[object, Callable[..., int]] = {}
if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
    _EXTRA_FORMULAS[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_flash_attention_flop


@dataclass
class ModuleStats:
    """What the profiler measured for one module (summed over its calls)."""

    name: str
    type_name: str
    depth: int
    params: int
    flops: int = 0
    latency_s: float = 0.0
    calls: int = 0
    _starts: list[tuple[int, float]] = field(default_factory=list, repr=False)

    @property
    def macs(self) -> int:
        """Multiply-accumulates: every counted op is one multiply plus one add per MAC."""
        return self.flops // 2


class FlopsProfiler(FlopsReport):
    """Profile the forward passes of a model, module by module.

    Args:
        model: the module to profile (its submodules are reported by their names).
        recompute_fwd_factor: extra forward cost of activation recomputation, as a
            fraction of the forward (0.0: none; 1.0: every activation recomputed).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> prof = FlopsProfiler(nn.Linear(4, 2))
        >>> prof.start_profile()
        >>> _ = prof.model(torch.randn(3, 4))
        >>> prof.stop_profile()
        >>> prof.get_total_flops(), prof.get_total_params()
        (48, 10)
        >>> prof.end_profile()
    """

    def __init__(self, model: nn.Module, recompute_fwd_factor: float = 0.0) -> None:
        self.model = model
        self.recompute_fwd_factor = recompute_fwd_factor
        self.stats: dict[str, ModuleStats] = {}
        self._handles: list[RemovableHandle] = []
        self._counter: FlopCounterMode | None = None
        self._excluded = 0  # flops inside ignored modules
        self._ignore_depth = 0
        self._ignore_start = 0
        self._sync: Callable[[], None] | None = None
        self.active = False

    # ------------------------------------------------------------------ counting
    def _raw(self) -> int:
        counter = self._counter
        return 0 if counter is None else int(counter.get_total_flops())

    def _effective(self) -> int:
        """Flops so far in this root call, without those inside ignored modules."""
        return self._raw() - self._excluded

    def _clock(self) -> float:
        if self._sync is not None:
            self._sync()
        return time.perf_counter()

    def _enter_root(self, module: nn.Module, args: object) -> None:
        # A fresh counter per root call: FlopCounterMode resets on entry, so the
        # module totals below are accumulated in ModuleStats, not in the counter.
        self._counter = FlopCounterMode(display=False, custom_mapping=_EXTRA_FORMULAS)
        self._counter.__enter__()
        self._excluded = 0

    def _exit_root(self, module: nn.Module, args: object, output: object) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None

    def _pre(self, stats: ModuleStats) -> Callable[..., None]:
        def hook(module: nn.Module, args: object) -> None:
            stats._starts.append((self._effective(), self._clock()))

        return hook

    def _post(self, stats: ModuleStats) -> Callable[..., None]:
        def hook(module: nn.Module, args: object, output: object) -> None:
            if not stats._starts:
                return
            flops0, t0 = stats._starts.pop()
            stats.flops += self._effective() - flops0
            stats.latency_s += self._clock() - t0
            stats.calls += 1

        return hook

    def _ignored_pre(self, module: nn.Module, args: object) -> None:
        if self._ignore_depth == 0:
            self._ignore_start = self._raw()
        self._ignore_depth += 1

    def _ignored_post(self, module: nn.Module, args: object, output: object) -> None:
        self._ignore_depth -= 1
        if self._ignore_depth == 0:
            self._excluded += self._raw() - self._ignore_start

    # ------------------------------------------------------------------ control
    def start_profile(self, ignore_list: Sequence[type[nn.Module]] | None = None) -> None:
        """Attach the hooks; every later forward of the model is profiled until :meth:`stop_profile`.

        Args:
            ignore_list: module types whose work is left out (their flops do not count
                towards their parents either; their time does, being inside them).
        """
        if self.active:
            return
        ignored = tuple(ignore_list or ())
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        module = getattr(torch, device.type, None) if device.type != "cpu" else None
        self._sync = getattr(module, "synchronize", None) if module is not None else None
        self.stats = {}
        root = self.model
        # root counter hooks first, so the per-module hooks of the root run inside the counter
        self._handles.append(root.register_forward_pre_hook(self._enter_root))
        for name, module in root.named_modules():
            if ignored and isinstance(module, ignored):
                self._handles.append(module.register_forward_pre_hook(self._ignored_pre))
                self._handles.append(module.register_forward_hook(self._ignored_post, always_call=True))
                continue
            key = name or "(model)"
            stats = ModuleStats(
                name=key,
                type_name=type(module).__name__,
                depth=0 if not name else name.count(".") + 1,
                params=sum(p.numel() for p in module.parameters()),
            )
            self.stats[key] = stats
            self._handles.append(module.register_forward_pre_hook(self._pre(stats)))
            self._handles.append(module.register_forward_hook(self._post(stats), always_call=True))
        self._handles.append(root.register_forward_hook(self._exit_root, always_call=True))
        self.active = True

    def stop_profile(self) -> None:
        """Detach the hooks; the measurements stay readable."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._counter is not None:  # a forward raised before its exit hook ran
            self._counter.__exit__(None, None, None)
            self._counter = None
        self.active = False

    def reset_profile(self) -> None:
        """Zero the measurements (hooks stay attached)."""
        for stats in self.stats.values():
            stats.flops = 0
            stats.latency_s = 0.0
            stats.calls = 0
            stats._starts.clear()

    def end_profile(self) -> None:
        """Detach the hooks and forget the measurements."""
        self.stop_profile()
        self.stats = {}

    # ------------------------------------------------------------------ totals
    def _root(self) -> ModuleStats | None:
        return self.stats.get("(model)")

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Forward FLOPs of every profiled call of the model."""
        root = self._root()
        flops = 0 if root is None else root.flops
        return format_count(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Forward MACs (``flops / 2``)."""
        root = self._root()
        macs = 0 if root is None else root.macs
        return format_count(macs, "MACs") if as_string else macs

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameters of the model (shared parameters once)."""
        params = sum(p.numel() for p in self.model.parameters())
        return format_count(params) if as_string else params

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Seconds spent in the profiled forwards."""
        root = self._root()
        seconds = 0.0 if root is None else root.latency_s
        return format_time(seconds) if as_string else seconds

    # ------------------------------------------------------------------ report
    def module_table(self, module_depth: int = -1) -> list[ModuleStats]:
        """Per-module stats in model order, down to ``module_depth`` (-1: every depth)."""
        return [s for s in self.stats.values() if module_depth < 0 or s.depth <= module_depth]

    def top_modules(self, top: int, module_depth: int = -1) -> dict[int, dict[str, list[ModuleStats]]]:
        """Per depth, the ``top`` modules by params, MACs and latency."""
        by_depth: dict[int, list[ModuleStats]] = {}
        for stats in self.module_table(module_depth):
            by_depth.setdefault(stats.depth, []).append(stats)
        out: dict[int, dict[str, list[ModuleStats]]] = {}
        for depth, items in sorted(by_depth.items()):
            out[depth] = {
                "params": sorted(items, key=lambda s: -s.params)[:top],
                "MACs": sorted(items, key=lambda s: -s.macs)[:top],
                "fwd latency": sorted(items, key=lambda s: -s.latency_s)[:top],
            }
        return out

def get_model_profile(
    model: nn.Module,
    input_shape: Sequence[int] | None = None,
    args: Sequence[object] | None = None,
    kwargs: dict[str, object] | None = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: Sequence[type[nn.Module]] | None = None,
    mode: str = "forward",
) -> tuple[int | str, int | str, int | str]:
    """Profile one forward of ``model`` outside training; returns ``(flops, macs, params)``.

    Args:
        model: the model (left in its current mode and device).
        input_shape: build one input ``torch.ones(input_shape)`` in the model's dtype and
            device (for models taking a single float tensor); else use ``args``/``kwargs``.
        args, kwargs: the forward's arguments.
        print_profile: log the report (or write it to ``output_file``).
        detailed: include the per-module table.
        module_depth: deepest level reported (-1: all).
        top_modules: modules per depth in the aggregated part.
        warm_up: unprofiled forwards first (allocator and kernel warm-up).
        as_string: return formatted strings (``"1.2 G"``) instead of ints.
        output_file: write the report to this file instead of the log.
        ignore_modules: module types whose work is left out.
        mode: ``"forward"`` calls ``model(*args, **kwargs)``; ``"generate"`` calls
            ``model.generate(*args, **kwargs)``.

    Raises:
        ValueError: neither ``input_shape`` nor ``args``/``kwargs``, or an unknown ``mode``.

    Example:
        >>> from torch import nn
        >>> get_model_profile(nn.Linear(10, 10), input_shape=(4, 10), print_profile=False)
        ('800', '400 MACs', '110')
    """
    if mode not in ("forward", "generate"):
        raise ValueError(f"mode={mode!r} is not supported: use 'forward' or 'generate'")
    call_args = list(args or [])
    call_kwargs = dict(kwargs or {})
    if input_shape is not None:
        param = next(model.parameters(), None)
        dtype = param.dtype if param is not None else torch.float32
        device = param.device if param is not None else torch.device("cpu")
        call_args = [torch.ones(tuple(input_shape), dtype=dtype, device=device), *call_args]
    if not call_args and not call_kwargs:
        raise ValueError("get_model_profile needs input_shape=... or args=/kwargs= for the model's forward")
    run: Callable[..., object] = getattr(model, "generate") if mode == "generate" else model  # noqa: B009 - not every module has it

    with torch.no_grad():
        for _ in range(warm_up):
            run(*call_args, **call_kwargs)
        profiler = FlopsProfiler(model)
        profiler.start_profile(ignore_list=ignore_modules)
        try:
            run(*call_args, **call_kwargs)
        finally:
            profiler.stop_profile()
    if print_profile:
        profiler.print_model_profile(
            profile_step=None,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            output_file=output_file,
        )
    flops, macs, params = (
        profiler.get_total_flops(as_string),
        profiler.get_total_macs(as_string),
        profiler.get_total_params(as_string),
    )
    profiler.end_profile()
    return flops, macs, params
