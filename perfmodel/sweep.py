"""Sweeps over parallel layouts and concurrency; the throughput-interactivity Pareto front.

A sweep of N chips enumerates the parallel layouts that fit them (tensor parallelism `tp` in
powers of two up to the scale-up domain, experts over `ep` in {1, tp} and DP attention for
MoE models, pipeline stages `pp` only where the weights need them, `N / (tp pp)` replicas),
evaluates every layout over a log grid of concurrency with one vmapped `predict` (hard max, as
for reports), drops points whose running batch does not fit in memory, and keeps the points no
other point beats on both throughput per chip and interactivity: the front InferenceMAX plots
(throughput per GPU against tokens/s/user).

Replicas do not change per-chip metrics of a closed loop: R replicas at concurrency R c serve
exactly as one replica at c (`serving.predict` splits concurrency evenly), so each layout is
evaluated once, with one replica, and its points are reported at R times the concurrency.

`auto_chips` picks the smallest power-of-two chip count whose best layout holds a useful batch
of sequences in memory: one or a few GPUs for most models, hundreds to thousands of
SRAM-only Groq chips or small TPUs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .architecture import Model
from .compiled import QUICK_COMPILE, filter_jit, on_host
from .design import (
    Design,
    Layout,
    LayoutNumbers,
    Precision,
    Runtime,
    SliceMapping,
    SpecDecode,
    precision,
)
from .hardware import Chip
from .kvcache import max_batch
from .presets import get_chip, get_model
from .progress import bar
from .serving import COLUMNS, METRIC_KEYS, Metrics, predict
from .smooth import DEFAULT_SHARPNESS
from .workload import Workload

#: Concurrency per replica of the default sweep: powers of two from 1 to 4096 (requests).
DEFAULT_GRID: tuple[float, ...] = tuple(2.0**k for k in range(13))

#: Low-precision formats in order of preference for `default_precision`.
_PREFERENCE = ("fp4", "fp8", "int8", "bf16")

#: Chip specs `elasticities` perturbs by default: datasheet numbers, dotted paths into `Chip`.
CHIP_SPECS: tuple[str, ...] = ("peak_flops", "hbm_bandwidth", "hbm_capacity", "slice_bandwidth",
                               "scale_up.bandwidth", "scale_out.bandwidth", "tdp", "idle_power")

#: Per-point values a `Sweep`'s rows carry beyond `serving.METRIC_KEYS`: the other
#: `serving.COLUMNS` (the points kept all fit, so `fits` says nothing there).
EXTRA_KEYS = tuple(k for k in COLUMNS.values() if k not in METRIC_KEYS and k != "fits")


def _resolve(model: Model | str, chip: Chip | str) -> tuple[Model, Chip]:
    model = get_model(model) if isinstance(model, str) else model
    chip = get_chip(chip) if isinstance(chip, str) else chip
    if not isinstance(model, Model):
        raise ValueError("model must be a perfmodel Model or a preset name "
                         "(perfmodel.model_names())")
    if not isinstance(chip, Chip):
        raise ValueError("chip must be a perfmodel Chip or a preset name "
                         "(perfmodel.chip_names())")
    return model, chip


def default_precision(chip: Chip, model: Model) -> str:
    """The narrowest weight format the chip computes natively: fp4, else fp8, int8, bf16.

    Args:
        chip: decides which compute classes are native.
        model: unused today beyond validation; kept so a model-aware rule can be added
            without changing callers.

    Returns:
        A format name accepted by `design.precision`.

    Example:
        >>> from perfmodel.presets import get_chip, get_model
        >>> [default_precision(get_chip(c), get_model("deepseek-r1")) for c in ("b200", "h100")]
        ['fp4', 'fp8']
    """
    del model
    for fmt in _PREFERENCE:
        if fmt in chip.native_classes:
            return fmt
    return "bf16"


def default_runtime(chip: Chip) -> Runtime:
    """Serving-runtime settings of a sweep: `Runtime()` with the activation reserve capped at
    10% of the chip's memory, so 230 MB SRAM-only chips (Groq) are not swamped by the 4 GB
    reserve of an 80 GB GPU (an assumption: activations shrink with the per-chip share of a
    layer).

    Example:
        >>> from perfmodel.presets import get_chip
        >>> float(default_runtime(get_chip("h100")).activation_reserve) / 1e9
        4.0
    """
    reserve = min(4e9, 0.1 * float(chip.hbm_capacity))
    return Runtime(activation_reserve=reserve)


def _as_precision(chip: Chip, model: Model, fmt: Precision | str | None) -> Precision:
    if isinstance(fmt, Precision):
        return fmt
    return precision(chip, model, fmt if fmt is not None else default_precision(chip, model))


def _context(workload: Workload, runtime: Runtime) -> float:
    # The context serving.predict sizes the KV cache at (`Runtime.kv_context`).
    return float(on_host(runtime).kv_context(on_host(workload)))


def _check_lengths(isl, osl):
    for name, value, low in (("input length (isl)", isl, 1), ("output length (osl)", osl, 2)):
        if not (np.isfinite(float(value)) and float(value) >= low):
            raise ValueError(f"{name} must be >= {low} tokens, got {value!r}")


def _memory_key(chip: Chip, prec: Precision, runtime: Runtime) -> tuple[float, ...]:
    # The numbers the batch that fits depends on, as a hashable key (concrete specs only).
    return tuple(float(x) for x in (chip.hbm_capacity, chip.num_slices, prec.weight_bytes,
                                    prec.expert_bytes, prec.kv_bytes, runtime.memory_fraction,
                                    runtime.activation_reserve, runtime.fraction_of_free))


class _Bytes(NamedTuple):
    """The fields of a `Precision` that `kvcache.max_batch` reads, as host numbers."""

    weight_bytes: float
    expert_bytes: float
    kv_bytes: float


@functools.lru_cache(maxsize=8192)
def _fit(model: Model, key: tuple[float, ...], tp: int, ep: int, pp: int, dpa: bool,
         context: float) -> float:
    # On host numbers (a static layout, floats): no eager jax.numpy operation, each of which
    # would be a compiled program of its own.
    capacity, slices, weight, expert, kv, fraction, reserve, of_free = key
    layout = Layout(tp=tp, ep=ep, pp=pp, dp_attention=dpa)
    return float(max_batch(model, layout, _Bytes(weight, expert, kv), capacity, context,
                           fraction, reserve, None, slices, of_free))


def batch_that_fits(model, chip, prec, runtime, layout, context) -> float:
    """Sequences per replica whose KV fits (kvcache.max_batch), cached per layout shape."""
    return _fit(model, _memory_key(chip, prec, runtime), layout.tp, layout.ep, layout.pp,
                layout.dp_attention, context)


def layout_shapes(model: Model, chip: Chip):
    """(tp, ep, dp_attention) candidates, before memory and chip-count checks."""
    tp = 1
    while tp <= chip.domain_size:
        eps = sorted({1, tp}) if model.is_moe else [1]
        for ep in eps:
            if model.is_moe and model.num_experts % ep:
                continue
            for dpa in ((False, True) if (model.is_moe and tp > 1) else (False,)):
                if model.split_problem(tp, dpa) is None:
                    yield tp, ep, dpa
        tp *= 2


def candidate_layouts(model: Model | str, chip: Chip | str, chips: int,
                      workload: Workload | None = None, precision: Precision | str | None = None,
                      runtime: Runtime | None = None, min_batch: float = 1.0
                      ) -> tuple[Layout, ...]:
    """The parallel layouts of `chips` chips that hold the weights and `min_batch` sequences.

    `tp` runs over powers of two up to min(chips, scale-up domain) (past the query heads it
    splits head dimensions, a fractional head count in `roofline`; `Model.split_problem` drops
    degrees that cannot split the heads), `ep` over {1, tp} where it
    divides the experts, DP attention on and off for MoE models, and `pp` is the smallest
    power of two (at most the layer count) for which the weights and `min_batch` sequences of
    KV fit; the rest of the chips are replicas.

    Args:
        model, chip: specs or preset names.
        chips: chips in the deployment (a positive integer).
        workload: sizes the KV cache of a sequence (default ISL 8192, OSL 1024).
        precision: a `Precision` or a weight format name (default: `default_precision`).
        runtime: memory fraction and reserve (default: `default_runtime`).
        min_batch: sequences per replica that must fit (count).

    Returns:
        Layouts, sorted by tp, ep, dp_attention.

    Raises:
        ValueError: a non-positive chip count.

    Example:
        >>> [l.describe() for l in candidate_layouts("llama-3.1-70b", "h100", 4)]
        ['2xtp1-pp2', '2xtp2', 'tp4']
    """
    model, chip = _resolve(model, chip)
    if not isinstance(chips, (int, np.integer)) or isinstance(chips, bool) or chips < 1:
        raise ValueError(f"chips must be a positive integer, got {chips!r}")
    chips = int(chips)
    workload = workload if workload is not None else Workload(8192, 1024)
    prec = _as_precision(chip, model, precision)
    runtime = runtime if runtime is not None else default_runtime(chip)
    context = _context(workload, runtime)
    found = []
    for tp, ep, dpa in layout_shapes(model, chip):
        if tp > chips:
            break
        pp = 1
        while pp <= model.num_layers and tp * pp <= chips:
            if chips % (tp * pp) == 0:
                layout = Layout(tp=tp, ep=ep, pp=pp, dp_attention=dpa,
                                replicas=chips // (tp * pp))
                if batch_that_fits(model, chip, prec, runtime, layout, context) >= min_batch:
                    found.append(layout)
                    break
            pp *= 2
    return tuple(found)


def auto_chips(model: Model | str, chip: Chip | str, precision: Precision | str | None = None,
               isl: float = 8192, osl: float = 1024, *, min_batch: float = 32.0,
               max_chips: int = 1 << 16) -> int:
    """The smallest power-of-two chip count with a layout that holds a useful batch.

    A useful batch is `min_batch` sequences per replica at the mean context of the workload.
    Where no count up to `max_chips` reaches it (the KV of a long request outgrows a small
    SRAM even at the deepest pipeline), the smallest count that reaches the largest batch any
    count allows is returned.

    Args:
        model, chip: specs or preset names.
        precision: a `Precision` or weight format name (default: `default_precision`).
        isl, osl: nominal input and output lengths (tokens).
        min_batch: sequences per replica (count).
        max_chips: the largest count tried.

    Returns:
        A chip count (a power of two).

    Raises:
        ValueError: non-positive lengths, or the weights fit on no count up to `max_chips`.

    Example:
        >>> auto_chips("llama-3.1-8b", "h100", "bf16", 1024, 1024)
        1
        >>> auto_chips("deepseek-r1", "gb200", "fp4", 8192, 1024)
        4
    """
    model, chip = _resolve(model, chip)
    _check_lengths(isl, osl)
    workload = Workload(float(isl), float(osl))
    prec = _as_precision(chip, model, precision)
    runtime = default_runtime(chip)
    context = _context(workload, runtime)
    best, best_chips = 0.0, None
    chips = 1
    while chips <= max_chips:
        fits = [batch_that_fits(model, chip, prec, runtime, layout, context)
                for layout in candidate_layouts(model, chip, chips, workload, prec, runtime)]
        batch = max(fits, default=0.0)
        if batch >= min_batch:
            return chips
        if batch > best * (1.0 + 1e-9):
            best, best_chips = batch, chips
        chips *= 2
    if best_chips is None:
        raise ValueError(f"{model.name} ({'/'.join(prec.names)}) fits on no count of up to "
                         f"{max_chips} {chip.name} chips")
    return best_chips


@dataclasses.dataclass(frozen=True, eq=False)
class Sweep:
    """Every fitting point of a sweep and its Pareto front.

    Attributes:
        model, chip: preset names.
        chips: chips in the deployment.
        precision: (weights, experts, kv) format names.
        input_len, output_len: nominal ISL and OSL (tokens).
        layouts: the layouts evaluated.
        layout_index: index into `layouts` of each point (int array).
        values: per-point arrays keyed by `serving.METRIC_KEYS` and `EXTRA_KEYS`;
            `concurrency` counts requests over the whole deployment.
        front: indices of the Pareto-optimal points, by rising throughput per chip.
    """

    model: str
    chip: str
    chips: int
    precision: tuple[str, ...]
    input_len: float
    output_len: float
    layouts: tuple[Layout, ...]
    layout_index: np.ndarray
    values: dict
    front: np.ndarray

    def rows(self, which: str = "front") -> list[dict]:
        """Points as dicts of plain Python values (`which` is "front" or "all").

        Each row has the `serving.METRIC_KEYS`, `EXTRA_KEYS`, `layout` (e.g. "2xtp4-ep4-dpa")
        and its `tp`, `ep`, `pp`, `dp_attention`, `replicas`, `chips`, and `precision`.
        """
        if which not in ("front", "all"):
            raise ValueError(f"which must be 'front' or 'all', got {which!r}")
        index = self.front if which == "front" else np.arange(len(self.layout_index))
        out = []
        for i in index:
            layout = self.layouts[int(self.layout_index[i])]
            row = {key: self.values[key][i].item() for key in METRIC_KEYS + EXTRA_KEYS}
            row.update(layout=layout.describe(), tp=layout.tp, ep=layout.ep, pp=layout.pp,
                       dp_attention=layout.dp_attention, replicas=layout.replicas,
                       chips=layout.chips, precision="/".join(self.precision))
            out.append(row)
        return out


def pareto_front(throughput, interactivity) -> np.ndarray:
    """Indices of the points no other point beats on both axes (larger is better on each).

    Ties keep one point. Non-finite points are never on the front.

    Args:
        throughput: throughput per chip of each point (any positive unit).
        interactivity: tokens/s/user of each point.

    Returns:
        Indices sorted by rising throughput (hence falling interactivity).

    Example:
        >>> pareto_front([1.0, 2.0, 1.5, 3.0], [9.0, 5.0, 4.0, 1.0]).tolist()
        [0, 1, 3]
    """
    x = np.asarray(throughput, dtype=float).ravel()
    y = np.asarray(interactivity, dtype=float).ravel()
    if x.shape != y.shape:
        raise ValueError(f"throughput has {x.size} points but interactivity has {y.size}")
    ok = np.flatnonzero(np.isfinite(x) & np.isfinite(y))
    # Highest throughput first; among equal throughput, highest interactivity first.
    order = ok[np.lexsort((-y[ok], -x[ok]))]
    keep, best = [], -np.inf
    for i in order:
        if y[i] > best:
            keep.append(i)
            best = y[i]
    return np.asarray(keep[::-1], dtype=int)


def point_row(model: Model, chip: Chip, runtime: Runtime, prec: Precision,
              layout: LayoutNumbers, concurrency, input_len, output_len,
              shape: Workload | None = None) -> dict:
    """`predict(...).to_row()` of one point whose layout, concurrency and lengths are numbers
    (hard max, no run-time checks: callers filter non-finite points themselves). Every layout
    of a model then shares one kernel, here and in `perfmodel.grid`. `shape`, when given,
    lends the point its length ranges, first wave and output spread (`Workload` fields; the
    point keeps its own lengths and runs closed-loop); None: `Workload`'s defaults."""
    # Fresh defaults: class-level ones were built at import, before x64 may have been on.
    # The concurrency goes in after construction: `Design` checks a concrete one.
    design = Design(concurrency=1.0, layout=layout, precision=prec, runtime=runtime,
                    mapping=SliceMapping(), speculative=SpecDecode())
    design = eqx.tree_at(lambda d: d.concurrency, design, concurrency)
    workload = Workload(input_len, output_len) if shape is None \
        else shape.closed_loop(input_len, output_len)
    return predict(model, chip, workload, design, hard=True, check=False,
                   unfit="value").to_row()


def _evaluate(model: Model, chip: Chip, runtime: Runtime, prec: Precision, points: dict,
              shape: Workload | None = None):
    """`point_row` vmapped over `points` (arrays tp, ep, pp, dpa, concurrency, isl, osl),
    each point one replica, every point with `shape`'s ranges and spread."""

    def one(p):
        layout = LayoutNumbers(tp=p["tp"], ep=p["ep"], pp=p["pp"],
                               replicas=jnp.ones_like(p["tp"]), dp_attention=p["dpa"])
        return point_row(model, chip, runtime, prec, layout, p["concurrency"], p["isl"],
                         p["osl"], shape)

    return jax.vmap(one)(points)


# `QUICK_COMPILE`: a pareto or compare sweep is a few thousand points, run once per process,
# so compiling is its cost (`perfmodel sweep`'s million-point kernel is `grid.evaluate`'s).
_evaluate_jit = filter_jit(_evaluate, lambda: QUICK_COMPILE)


def sweep(model: Model | str, chip: Chip | str, workload: Workload | None = None, *,
          chips: int | None = None, precision: Precision | str | None = None,
          grid=DEFAULT_GRID, runtime: Runtime | None = None, jit: bool = False,
          progress: bool | None = None) -> Sweep:
    """Evaluate every layout of `chips` chips over a concurrency grid; find the Pareto front.

    Each layout is one vmapped `predict` over the grid (per replica), plus one point at the
    largest batch that fits, so the front reaches the memory limit. Points whose batch does
    not fit or whose metrics are not finite are dropped.

    Args:
        model, chip: specs or preset names.
        workload: request lengths, their ranges and output spread (default ISL 8192, OSL
            1024); every point runs closed-loop at the grid's concurrencies, so a
            `request_rate` is not read.
        chips: chips in the deployment (default: `auto_chips`).
        precision: a `Precision` or weight format name (default: `default_precision`).
        grid: concurrencies per replica (requests, positive).
        runtime: serving-runtime settings (default: `default_runtime`).
        jit: compile the one kernel that evaluates every point of every layout (layouts as
            numbers, `compiled.filter_jit`: with a persistent compilation cache, a later
            process loads it without tracing); otherwise the same vmapped predict runs
            eagerly, op by op. Compiling pays for repeated sweeps and for the command line.
        progress: a bar over the kernel on standard error (`perfmodel.progress`; None:
            on a terminal).

    Returns:
        A `Sweep`.

    Raises:
        ValueError: invalid lengths, chip count or grid; no layout of `chips` chips holds the
            model, naming the smallest count that does.

    Example:
        >>> s = sweep("llama-3.1-8b", "h100", Workload(1024, 1024), chips=1, grid=(1., 8., 64.))
        >>> rows = s.rows()
        >>> rows[0]["layout"], rows[0]["tput_per_chip_total"] < rows[-1]["tput_per_chip_total"]
        ('tp1', True)
    """
    model, chip = _resolve(model, chip)
    workload = workload if workload is not None else Workload(8192, 1024)
    _check_lengths(float(workload.input_len), float(workload.output_len))
    prec = _as_precision(chip, model, precision)
    runtime = runtime if runtime is not None else default_runtime(chip)
    grid = np.asarray(grid, dtype=float).ravel()
    if grid.size == 0 or not np.all(np.isfinite(grid) & (grid > 0)):
        raise ValueError(f"grid must hold positive finite concurrencies, got {grid.tolist()}")
    isl, osl = float(workload.input_len), float(workload.output_len)
    if chips is None:
        chips = auto_chips(model, chip, prec, isl, osl)
    layouts = candidate_layouts(model, chip, chips, workload, prec, runtime)
    if not layouts:
        try:
            smallest = auto_chips(model, chip, prec, isl, osl, min_batch=1.0)
            need = f"; the smallest count that holds it is {smallest}"
        except ValueError:
            need = ""
        raise ValueError(f"{model.name} ({'/'.join(prec.names)}) does not fit in {chips} "
                         f"{chip.name} chip(s) at ISL {isl:g} / OSL {osl:g}{need}")
    context = _context(workload, runtime)
    per_replica = [_layout_grid(model, chip, prec, runtime, layout, grid, context)
                   for layout in layouts]
    sizes = [len(c) for c, _ in per_replica]
    n = sum(sizes)
    layout_index = np.repeat(np.arange(len(layouts)), sizes)
    take = padded_take(n)
    conc = np.concatenate([c for c, _ in per_replica])
    degrees = np.asarray([(lay.tp, lay.ep, lay.pp) for lay in layouts], dtype=np.int64)
    points = {"tp": degrees[layout_index, 0], "ep": degrees[layout_index, 1],
              "pp": degrees[layout_index, 2],
              "dpa": np.asarray([lay.dp_attention for lay in layouts])[layout_index],
              "concurrency": conc, "isl": np.full(n, isl), "osl": np.full(n, osl)}
    points = {k: jnp.asarray(v[take]) for k, v in points.items()}
    with bar(1, f"{model.name} on {chips} x {chip.name}, {len(layouts)} layouts", progress,
             unit="kernel") as shown:
        args = (model, chip, runtime, prec, points, workload)
        # Lowered and compiled apart from jit's call path, whose caches compile one kernel
        # at a time: sweeps run from several threads (`perfmodel compare`) then compile
        # side by side.
        out = _evaluate_jit.lower(*args)(*args) if jit else _evaluate(*args)
        out = {k: np.asarray(v)[:n] for k, v in out.items()}
        shown.update(1)
    replicas = np.asarray([lay.replicas for lay in layouts])[layout_index]
    out["concurrency"] = out["concurrency"] * replicas
    fit = np.concatenate([np.full(len(c), f) for c, f in per_replica])
    finite = np.all([np.isfinite(out[k]) for k in METRIC_KEYS], axis=0)
    keep = out["fits"] & finite & (conc <= fit * (1.0 + 1e-9))
    values = {k: v[keep] for k, v in out.items()}
    layout_index = layout_index[keep]
    front = pareto_front(values["tput_per_chip_total"], values["interactivity"])
    return Sweep(model=model.name, chip=chip.name, chips=int(chips), precision=prec.names,
                 input_len=isl, output_len=osl, layouts=layouts, layout_index=layout_index,
                 values=values, front=front)


def padded_take(n: int, least: int = 64) -> np.ndarray:
    """Indices that pad `n` points to a power of four (at least `least`) by repeating the
    last: grids of similar sizes then share one compiled kernel. Keep the first `n` outputs.

    Powers of four, not two: a sweep's kernel compiles for 1-2 s and runs a thousand points
    in milliseconds, so padding up to 4x costs less than a second kernel. `perfmodel
    compare` re-sweeps each chip at its fitted top concurrency, a few more points than its
    first sweep; with powers of two gpt-oss-120b's re-sweep crossed from 512 to 1,024
    points and compiled its kernel again.

    Example:
        >>> padded_take(3, least=4).tolist()
        [0, 1, 2, 2]
        >>> len(padded_take(300)), len(padded_take(600)), len(padded_take(5, least=1))
        (1024, 1024, 16)
    """
    if n < 1:
        raise ValueError(f"n: {n} points cannot be padded; give at least one point")
    size = max(least, 1 << (2 * (((n - 1).bit_length() + 1) // 2)))
    return np.minimum(np.arange(size), n - 1)


def _layout_grid(model, chip, prec, runtime, layout, grid, context):
    """(concurrencies per replica, the batch that fits): the grid plus the largest batch
    that fits, where it is below the grid's top."""
    fit = batch_that_fits(model, chip, prec, runtime, layout, context)
    cap = float(np.floor(fit))
    per_replica = np.unique(np.concatenate([grid, [cap]])) if cap < grid.max() else grid
    return per_replica, fit


def _spec(chip: Chip, path: str):
    node = chip
    for part in path.split("."):
        node = getattr(node, part)
    return node


def elasticities(model: Model | str, chip: Chip | str, workload: Workload, design: Design,
                 metric: str = "tok_s_per_kw_tdp", specs: tuple[str, ...] = CHIP_SPECS,
                 sharpness=DEFAULT_SHARPNESS) -> dict[str, float]:
    """Elasticities d log(metric) / d log(spec) of a design's metric to the chip's specs.

    One reverse-mode gradient through the smooth model: +1 means 1% more of the spec gives 1%
    more of the metric; 0 means the spec does not bind. A vector spec (`peak_flops`) is scaled
    as a whole.

    Args:
        model, chip: specs or preset names.
        workload, design: the operating point.
        metric: a `Metrics` field (e.g. "tok_s_per_kw_tdp", "throughput_per_chip",
            "interactivity").
        specs: dotted paths of positive array leaves of `Chip` (see `CHIP_SPECS`).
        sharpness: p of the smooth max.

    Returns:
        {spec: elasticity}.

    Raises:
        ValueError: an unknown metric or spec.

    Example:
        >>> import perfmodel as pm
        >>> chip, model = pm.get_chip("h100"), pm.get_model("llama-3.1-8b")
        >>> d = pm.Design(concurrency=1.0, layout=pm.Layout(tp=1),
        ...               precision=pm.precision(chip, model, "fp8"))
        >>> e = elasticities(model, chip, pm.Workload(1024, 1024), d, "interactivity")
        >>> max(e, key=e.get)          # batch 1 decode is bandwidth-bound
        'hbm_bandwidth'
    """
    model, chip = _resolve(model, chip)
    if metric not in {f.name for f in dataclasses.fields(Metrics)}:
        valid = ", ".join(f.name for f in dataclasses.fields(Metrics))
        raise ValueError(f"unknown metric {metric!r}; valid metrics: {valid}")
    for path in specs:
        try:
            leaf = _spec(chip, path)
        except AttributeError:
            raise ValueError(f"unknown chip spec {path!r}; try one of {CHIP_SPECS}") from None
        if not eqx.is_array(leaf):
            raise ValueError(f"chip spec {path!r} is not an array leaf")
    getters = tuple((lambda c, p=path: _spec(c, p)) for path in specs)

    def log_metric(log_scale):
        leaves = tuple(get(chip) * jnp.exp(s) for get, s in zip(getters, log_scale, strict=True))
        scaled = eqx.tree_at(lambda c: tuple(get(c) for get in getters), chip, leaves)
        out = predict(model, scaled, workload, design, sharpness=sharpness, unfit="value")
        return jnp.log(getattr(out, metric))

    grads = jax.grad(log_metric)(jnp.zeros(len(specs)))
    return {path: float(g) for path, g in zip(specs, grads, strict=True)}

