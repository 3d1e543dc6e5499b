"""The flops profiler's report: the summary, top modules per depth and per-module table
(:class:`FlopsReport`, a mixin of :class:`~shardwise.profiling.flops_profiler.FlopsProfiler`),
and the number formats it uses (:func:`format_count`, :func:`format_time`)."""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any

from shardwise.utils.report import report_logger

if TYPE_CHECKING:
    from shardwise.profiling.flops_profiler import ModuleStats

__all__ = ["FlopsReport", "format_count", "format_time"]


def format_count(value: float, unit: str = "", precision: int = 2) -> str:
    """A number with an SI prefix: ``format_count(1.5e9, "FLOPS")`` -> ``"1.5 GFLOPS"``.

    Example:
        >>> format_count(212), format_count(1536), format_count(2.5e6, "MACs"), format_count(3e12, "FLOPS")
        ('212', '1.54 K', '2.5 MMACs', '3.0 TFLOPS')
    """
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= factor:
            return f"{round(value / factor, precision)} {prefix}{unit}"
    if float(value).is_integer():
        return f"{int(value)} {unit}".rstrip()
    return f"{round(float(value), precision)} {unit}".rstrip()


def format_time(seconds: float, precision: int = 2) -> str:
    """Seconds with a readable unit: ``format_time(0.0123)`` -> ``"12.3 ms"``.

    Example:
        >>> format_time(2.5), format_time(0.0123), format_time(4.2e-5)
        ('2.5 s', '12.3 ms', '42.0 us')
    """
    if seconds >= 1:
        return f"{round(seconds, precision)} s"
    if seconds >= 1e-3:
        return f"{round(seconds * 1e3, precision)} ms"
    return f"{round(seconds * 1e6, precision)} us"


class FlopsReport:
    """``format_profile`` / ``print_model_profile`` for a profiler that provides the totals, the
    per-module table and ``recompute_fwd_factor`` (mixed into ``FlopsProfiler``)."""

    recompute_fwd_factor: float

    @abstractmethod
    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Forward flops counted so far."""

    @abstractmethod
    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameters of the model."""

    @abstractmethod
    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Forward latency measured so far."""

    @abstractmethod
    def module_table(self, module_depth: int = -1) -> list[ModuleStats]:
        """Per-module stats in model order."""

    @abstractmethod
    def top_modules(self, top: int, module_depth: int = -1) -> dict[int, dict[str, list[ModuleStats]]]:
        """Per depth, the ``top`` modules by params, MACs and latency."""

    def format_profile(
        self,
        profile_step: int | None = None,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        context: dict[str, Any] | None = None,
    ) -> str:
        """The report as text: summary, top modules per depth, and (``detailed``) the per-module table.

        Args:
            profile_step: the step named in the title (None for a standalone profile).
            module_depth: deepest level shown (-1: all).
            top_modules: how many modules per depth in the aggregated part.
            detailed: include the per-module table.
            context: run facts from the engine: ``world_size``, ``dp_size``, ``mp_size``,
                ``batch_size`` (samples per rank in the profiled forwards), and the
                ``bwd_latency_s`` / ``step_latency_s`` measured by the timers.
        """
        ctx = dict(context or {})
        flops = int(self.get_total_flops())
        params = int(self.get_total_params())
        fwd_s = float(self.get_total_duration())
        mp = int(ctx.get("mp_size", 1))
        bwd_factor = 2.0 + self.recompute_fwd_factor
        lines = ["-" * 30 + " shardwise flops profiler " + "-" * 30]
        lines.append(
            f"Profile summary at step {profile_step}:" if profile_step is not None else "Profile summary:"
        )
        lines.append(
            "notation: params = parameters, MACs = multiply-accumulates, flops = floating-point operations "
            "(2 per MAC), FLOPS = flops per second; bwd flops = "
            f"{bwd_factor:g} x fwd flops (recompute_fwd_factor {self.recompute_fwd_factor:g})"
        )
        rows: list[tuple[str, str]] = []
        for key, label in (
            ("world_size", "world size"),
            ("dp_size", "data parallel size"),
            ("mp_size", "model parallel size"),
        ):
            if key in ctx:
                rows.append((label, str(ctx[key])))
        if "batch_size" in ctx:
            rows.append(("samples per rank (profiled forwards)", str(ctx["batch_size"])))
        rows += [
            ("params per rank", format_count(params)),
            ("params of model = params per rank x mp_size", format_count(params * mp)),
            ("fwd MACs per rank", format_count(flops // 2, "MACs")),
            ("fwd flops per rank", format_count(flops)),
            ("fwd flops of model = fwd flops per rank x mp_size", format_count(flops * mp)),
            ("fwd latency", format_time(fwd_s)),
            ("fwd FLOPS per rank", _rate(flops, fwd_s)),
        ]
        bwd_s = ctx.get("bwd_latency_s")
        step_s = ctx.get("step_latency_s")
        if bwd_s is not None:
            rows.append(("bwd latency", format_time(bwd_s)))
            rows.append(
                (
                    f"bwd FLOPS per rank = {bwd_factor:g} x fwd flops / bwd latency",
                    _rate(bwd_factor * flops, bwd_s),
                )
            )
            rows.append(
                (
                    f"fwd+bwd FLOPS per rank = {1 + bwd_factor:g} x fwd flops / (fwd+bwd latency)",
                    _rate((1 + bwd_factor) * flops, fwd_s + bwd_s),
                )
            )
        if bwd_s is not None and step_s is not None:
            iter_s = fwd_s + bwd_s + step_s
            rows.append(("step latency", format_time(step_s)))
            rows.append(("iter latency", format_time(iter_s)))
            rows.append(
                (
                    f"FLOPS per rank = {1 + bwd_factor:g} x fwd flops / iter latency",
                    _rate((1 + bwd_factor) * flops, iter_s),
                )
            )
            if "batch_size" in ctx and iter_s > 0:
                rows.append(("samples/second (this rank)", f"{ctx['batch_size'] / iter_s:.2f}"))
        width = max(len(label) for label, _ in rows) + 2
        lines += [f"{label + ':':<{width}} {value}" for label, value in rows]

        lines.append("-" * 30 + " top modules per depth " + "-" * 30)
        for depth, tops in self.top_modules(top_modules, module_depth).items():
            lines.append(f"depth {depth}:")
            lines.append("    params      - " + str({s.name: format_count(s.params) for s in tops["params"]}))
            lines.append(
                "    MACs        - " + str({s.name: format_count(s.macs, "MACs") for s in tops["MACs"]})
            )
            lines.append(
                "    fwd latency - " + str({s.name: format_time(s.latency_s) for s in tops["fwd latency"]})
            )
        if detailed:
            lines.append("-" * 30 + " per-module profile " + "-" * 30)
            lines.append(_table(self.module_table(module_depth), params, flops, fwd_s))
        return "\n".join(lines)

    def print_model_profile(
        self,
        profile_step: int | None = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
        context: dict[str, object] | None = None,
    ) -> str:
        """Log the report (or write it to ``output_file``) and return it."""
        text = self.format_profile(profile_step, module_depth, top_modules, detailed, context)
        if output_file:
            with open(output_file, "w") as handle:
                handle.write(text + "\n")
        else:
            report_logger().info("\n%s", text)
        return text


def _rate(flops: float, seconds: float) -> str:
    return format_count(flops / seconds, "FLOPS") if seconds > 0 else "n/a"


def _share(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.2f}%" if whole else "0.00%"


def _table(rows: list[ModuleStats], total_params: int, total_flops: int, total_s: float) -> str:
    header = ("module", "params", "%params", "MACs", "flops", "%flops", "fwd latency", "%latency", "FLOPS")
    cells = [header]
    for s in rows:
        label = "  " * s.depth + (f"{s.name} ({s.type_name})" if s.depth else f"{s.type_name}")
        cells.append(
            (
                label,
                format_count(s.params),
                _share(s.params, total_params),
                format_count(s.macs, "MACs"),
                format_count(s.flops),
                _share(s.flops, total_flops),
                format_time(s.latency_s),
                _share(s.latency_s, total_s),
                _rate(s.flops, s.latency_s),
            )
        )
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row)
        ).rstrip()
        for row in cells
    )
