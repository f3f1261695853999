"""Plots for the command line and the notebooks: Pareto fronts, chip rooflines with operators
placed by arithmetic intensity, KV-cache growth and spec elasticities.

Every function draws on a Matplotlib `Axes` it is given (or on a new `Figure` built without
pyplot, so no display backend is needed) and returns the axes; `save` writes a figure with the
Agg canvas. The numbers come from the model's own functions: no model logic lives here beyond
arranging them for a plot.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .architecture import Model
from .design import Design, Layout
from .formats import COMPUTE_CLASSES
from .hardware import Chip
from .kvcache import kv_bytes_per_request
from .roofline import attention_kernels, operator_time, operators

_PHASE_MARKERS = {"prefill": "o", "decode": "s"}


def _axes(ax: Axes | None, size=(6.4, 4.4)) -> Axes:
    if ax is not None:
        return ax
    return Figure(figsize=size, layout="constrained").add_subplot()


def save(figure: Figure, path: str, dpi: int = 150) -> None:
    """Write a figure to `path` (format from the extension) with the Agg canvas.

    Example:
        >>> import os, tempfile
        >>> ax = kv_growth(__import__("perfmodel").get_model("llama-3.1-8b"), 1024, 256, 2.0)
        >>> path = os.path.join(tempfile.mkdtemp(), "kv.png")
        >>> save(ax.figure, path); os.path.getsize(path) > 1000
        True
    """
    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=dpi)


def pareto(sweeps, ax: Axes | None = None, points: bool = True, title: str | None = None) -> Axes:
    """Throughput per chip against interactivity: every fitting point and each sweep's front.

    Args:
        sweeps: `perfmodel.sweep.Sweep` results (one per chip or setting).
        ax: axes to draw on (default: a new figure).
        points: also scatter the dominated points, faintly.
        title: default names the model and lengths.

    Returns:
        The axes.
    """
    ax = _axes(ax)
    for i, s in enumerate(sweeps):
        x, y = s.values["interactivity"], s.values["tput_per_chip_total"]
        label = f"{s.chip} x{s.chips} ({'/'.join(s.precision)})"
        color = f"C{i % 10}"
        if points:
            ax.scatter(x, y, s=8, alpha=0.25, color=color)
        front = s.front
        ax.plot(x[front], y[front], "-o", ms=3.5, color=color, label=label)
    first = sweeps[0] if len(sweeps) else None
    if title is None and first is not None:
        title = (f"{first.model}, ISL {first.input_len:g} / OSL {first.output_len:g}: "
                 "Pareto front")
    ax.set_title(title or "Pareto front")
    ax.set_xlabel("Interactivity (tokens/s/user)")
    ax.set_ylabel("Throughput per chip (tokens/s)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return ax


def roofline_points(model: Model, chip: Chip, design: Design, decode_seqs, decode_context,
                    prefill_tokens=0.0, prefill_context=0.0, prefill_seqs=0.0,
                    layout: Layout | None = None, phase: str = "decode") -> list[dict]:
    """Each operator of one engine step, placed for a roofline plot.

    Arguments are those of `roofline.operators` (per replica); `layout` defaults to the
    design's. The achieved rate is the operator's FLOPs over its modelled time (hard max),
    so a point sits under the roof by the efficiencies and overheads the model charges.

    Returns:
        Dicts with `name`, `phase`, `intensity` (FLOP/byte of HBM traffic), `flops_per_s`
        (achieved FLOP/s) and `time_s`; operators without FLOPs or HBM traffic are left out.
    """
    layout = design.layout if layout is None else layout
    ops = operators(model, chip, design, layout, decode_seqs, decode_context, prefill_tokens,
                    prefill_context, prefill_seqs)
    per_chip = jnp.asarray(decode_seqs, dtype=float) / layout.attention_ranks
    chip = attention_kernels(model, chip)   # as `step_cost` times the model's attention
    out = []
    for op in ops:
        flops, moved = float(op.flops), float(op.hbm_bytes)
        if flops <= 0 or moved <= 0:
            continue
        time, _ = operator_time(op, chip, design, per_chip, hard=True)
        out.append(dict(name=op.name, phase=phase, intensity=flops / moved,
                        flops_per_s=flops / float(time), time_s=float(time)))
    return out


def roofline(chip: Chip, points=(), ax: Axes | None = None, title: str | None = None) -> Axes:
    """A chip's roofline (one roof per native compute class, HBM-bandwidth slope) with
    operators placed by intensity and achieved FLOP/s.

    Args:
        chip: gives the peaks (dense datasheet FLOP/s) and HBM bandwidth.
        points: dicts from `roofline_points`.
        ax: axes to draw on.
        title: default names the chip.

    Returns:
        The axes (log-log).
    """
    ax = _axes(ax)
    bandwidth = float(chip.hbm_bandwidth)
    intensities = [p["intensity"] for p in points] or [1.0]
    low = min(0.1, 0.5 * min(intensities))
    peaks = {c: float(chip.peak_flops[COMPUTE_CLASSES.index(c)]) for c in chip.native_classes}
    high = max(2e4, 2.0 * max(intensities), 4.0 * max(peaks.values()) / bandwidth)
    x = np.geomspace(low, high, 256)
    roofs: dict[float, list[str]] = {}
    for cls, peak in peaks.items():   # classes with the same peak share one roof
        roofs.setdefault(peak, []).append(cls.upper())
    styles = ("-", "--", "-.", ":")
    for k, (peak, names) in enumerate(sorted(roofs.items())):
        ax.plot(x, np.minimum(peak, bandwidth * x), color="0.25", lw=1.3, ls=styles[k % 4],
                label=f"{'/'.join(names)} roof {peak / 1e15:.3g} PFLOP/s, "
                      f"ridge {peak / bandwidth:.0f} FLOP/B")
    for p in points:
        marker = _PHASE_MARKERS.get(p["phase"], "^")
        ax.scatter(p["intensity"], p["flops_per_s"], marker=marker, s=30, zorder=3,
                   color="C3" if p["phase"] == "prefill" else "C0")
        ax.annotate(f"{p['name']} ({p['phase']})", (p["intensity"], p["flops_per_s"]),
                    fontsize=6.5, xytext=(3, 3), textcoords="offset points")
    for phase, marker in _PHASE_MARKERS.items():
        if any(p["phase"] == phase for p in points):
            ax.scatter([], [], marker=marker, color="C3" if phase == "prefill" else "C0",
                       label=f"{phase} operators")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("Arithmetic intensity (FLOP per HBM byte)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(title or f"{chip.name} roofline (HBM {bandwidth / 1e12:.2g} TB/s)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="x-small")
    return ax


def kv_growth(model: Model, input_len, output_len, kv_bytes, ax: Axes | None = None,
              capacity=None, label: str | None = None, shade: bool = True) -> Axes:
    """KV-cache bytes of one request through prefill (0..ISL) and decode (ISL..ISL+OSL).

    Args:
        model: architecture (MLA, GQA and sliding windows change the slope).
        input_len, output_len: the request (tokens).
        kv_bytes: bytes per cached value (2 for BF16, 1 for FP8).
        ax: axes to draw on.
        capacity: optional bytes to draw as a horizontal line (e.g. one chip's free memory).
        label: line label (default the model's name).
        shade: shade the prefill and decode spans (once per axes when overlaying models).

    Returns:
        The axes.
    """
    ax = _axes(ax)
    total = float(input_len) + float(output_len)
    position = np.linspace(0.0, total, 257)
    size = np.asarray(kv_bytes_per_request(model, jnp.asarray(position), kv_bytes)) / 1e9
    ax.plot(position, size, label=label or model.name)
    if shade:
        ax.axvspan(0, float(input_len), color="C1", alpha=0.08, label="prefill")
        ax.axvspan(float(input_len), total, color="C2", alpha=0.08, label="decode")
    if capacity is not None:
        ax.axhline(float(capacity) / 1e9, color="k", ls="--", lw=1, label="capacity")
    ax.set_xlabel("Tokens in the context")
    ax.set_ylabel("KV cache of one request (GB)")
    ax.set_title(f"KV cache through an ISL {float(input_len):g} / OSL {float(output_len):g} "
                 "request")
    ax.set_xlim(0, total)
    top = max(float(np.max(line.get_ydata())) for line in ax.get_lines())
    ax.set_ylim(0, 1.05 * top)   # refit when several models share the axes
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return ax


def elasticities(values: dict, ax: Axes | None = None, title: str | None = None) -> Axes:
    """Horizontal bars of elasticities (from `perfmodel.sweep.elasticities`), largest
    magnitude on top."""
    ax = _axes(ax)
    items = sorted(values.items(), key=lambda kv: abs(kv[1]))
    names = [k for k, _ in items]
    numbers = [v for _, v in items]
    ax.barh(names, numbers, color=["C0" if v >= 0 else "C3" for v in numbers])
    ax.axvline(0.0, color="k", lw=0.8)
    ax.set_xlabel("d log(metric) / d log(spec)")
    ax.set_title(title or "Elasticities")
    ax.grid(alpha=0.3, axis="x")
    return ax
